"""The round loop's fallback for a draft tree its verifier cannot score
(loop.verify_tree_or_chain): the tree is verified as its main chain, with the main chain's
draft laws, and the policy drafts no tree again."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from speculative import loop
from speculative.sampling import SamplingParams
from speculative.tree import ROOT
from speculative.types import DraftBlock, DraftDists, TreesUnsupported


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_refused_tree_is_verified_as_exactly_its_main_chain(monkeypatch, temperature):
    """Nodes 0-2 are the main chain, node 3 a sibling of node 0 (drawn from the root's law
    without node 0). The chain verified holds nodes 0-2 and their rows of q only: one node
    more put the sibling at position 4, tested with a law it was not drawn from (sampled:
    not exact) and, with q cut to the chain, a token without its row."""
    weights = torch.rand(6, 8, generator=torch.Generator().manual_seed(0)).softmax(-1)
    tree = DraftBlock((5, 6, 7, 8, 9, 4), DraftDists.from_dense(weights),
                      parents=(ROOT, 0, 1, ROOT, 0, 1))
    asked = []

    async def verify(state, verifier, block, *args):
        asked.append(block)
        if block.parents is not None:
            raise TreesUnsupported(TreesUnsupported.reason)
        return "scores"

    monkeypatch.setattr(loop, "verify", verify)
    state = SimpleNamespace(request=SimpleNamespace(
        tree_width=1, sampling=SamplingParams(temperature=temperature)))
    refused = []
    policy = SimpleNamespace(refuse_trees=lambda: refused.append(True))
    chain, scores = asyncio.run(loop.verify_tree_or_chain(
        state, None, policy, tree, 0, None, 1, True))
    assert scores == "scores" and refused == [True] and asked[-1] is chain
    assert chain.token_ids == (5, 6, 7) and chain.parents is None
    assert torch.equal(chain.draft_probs.dense(), tree.draft_probs.rows(0, 3).dense())

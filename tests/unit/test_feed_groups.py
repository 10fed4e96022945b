"""A batch whose feeds differ widely in length (a prompt's prefill beside decodes) is laid
out in two groups, each padded to its own longest feed, and answers as each request alone.

Reference: a fresh full forward of each request's own tokens (as tests/unit/test_batch.py).
"""

from types import SimpleNamespace

import pytest
import torch

from engine import lean
from engine.attention import feed_groups
from engine.kv import SessionStore
from speculative.tree import DraftTree
from tests.unit.test_batch import ATOL, PLANS, full_logits, served, sync

TREE = DraftTree(token_ids=(10, 11, 12, 20, 21), parents=(-1, 0, 1, -1, 3))


def feeds(*shapes):
    """Stand-ins for segments: (tokens fed, position they start at)."""
    return [SimpleNamespace(token_ids=[0] * length, start=start) for length, start in shapes]


def test_decodes_beside_a_long_prompt_are_two_groups_short_first():
    assert feed_groups(feeds((5, 60), (200, 0), (5, 70), (1, 80))) == [[0, 2, 3], [1]]
    # single-token decodes at long contexts beside a short prompt: each padded to 20 queries
    assert feed_groups(feeds((1, 500), (1, 500), (20, 0))) == [[0, 1], [2]]


@pytest.mark.parametrize("shapes", [
    [(5, 60)],  # one feed
    [(5, 60), (5, 90), (5, 10)],  # equal feeds: nothing padded
    [(5, 60), (8, 60), (4, 60)],  # near lengths: two layouts would not halve the work
])
def test_feeds_that_pad_little_stay_one_layout(shapes):
    assert feed_groups(feeds(*shapes)) is None


def grouped_batch_error(runner) -> float:
    """Three decoding requests (one a draft tree, one past the sliding window) and a
    40-token prompt in one forward; the largest gap to each request's fresh forward."""
    store = SessionStore(8)
    prompts = {"a": [3, 1, 4, 1, 5], "b": list(range(5, 20)), "tree": [9, 2, 6],
               "prompt": [(7 * i) % 60 + 1 for i in range(40)]}
    for name in ("a", "b", "tree"):  # their contexts cached before the batch
        runner.forward([store.apply(name, sync([], prompts[name][:-1])).segment(runner, [], 1)])
    segments, wanted = [], []
    for name, ids in prompts.items():
        sequence = store.apply(name, sync(ids[:-1], ids[-1:]) if name != "prompt"
                               else sync([], ids))
        if name == "tree":
            segments.append(sequence.segment(runner, list(TREE.token_ids),
                                             len(TREE.token_ids) + 1, parents=TREE.parents))
            wanted.append(torch.stack(
                [full_logits(runner.model, ids)[-1]] +
                [full_logits(runner.model, ids + TREE.path(node))[-1]
                 for node in range(len(TREE.token_ids))]))
        else:
            drafted = [] if name == "prompt" else [8, 9]
            segments.append(sequence.segment(runner, drafted, len(drafted) + 1))
            wanted.append(full_logits(runner.model, ids + drafted)[-len(drafted) - 1:])
    assert feed_groups(segments) is not None  # the batch this test is about
    return max(float((logits - reference).abs().max())
               for logits, reference in zip(runner.forward(segments), wanted))


@pytest.mark.parametrize("backend", PLANS)
@pytest.mark.parametrize("name", ["llama", "mistral-sliding", "qwen2-mixed"])
def test_a_batch_laid_out_in_groups_equals_each_request_alone(name, backend):
    assert grouped_batch_error(served(name, backend)) < ATOL


@pytest.mark.parametrize("backend", PLANS)
def test_the_test_sees_a_group_answered_in_the_wrong_rows(backend, monkeypatch):
    """Mutant: a group's attention written back in reversed token order."""
    grouped = lean.GroupedPlan.__call__

    def reversed_rows(self, *args):
        out = grouped(self, *args)
        tokens = self.parts[0][0]
        out[tokens] = out[tokens.flip(0)]
        return out

    monkeypatch.setattr(lean.GroupedPlan, "__call__", reversed_rows)
    assert grouped_batch_error(served("llama", backend)) > 0.01

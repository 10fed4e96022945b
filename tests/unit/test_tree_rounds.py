"""Draft trees round after round, at random: random small trees (the drafter's layout, a main
chain and its siblings, or any parents), random accepted paths (on the main chain, off it,
the root alone) and random tokens committed after them (one equal to the next main node's,
or to a sibling's, or a few more as plain steps commit).

Each round's logits at every node equal a fresh forward of that node's path, and once a
round commits, the request's cache holds at every committed position the keys and values a
fresh prefill of the committed tokens writes: no key a rejected node left, none computed at
a slot's position instead of its depth's. And through the verifier: a tree's argmaxes and
its acceptance probabilities are those of its nodes' fresh laws.
"""

import random

import pytest
import torch

from engine.kv import SessionStore
from engine.runner import serving_runner
from speculative.sampling import SamplingParams, logits_to_probs
from speculative.tree import DraftTree, main_chain_length, tree_scores
from speculative.types import DraftDists, ScoreCall
from tests.unit.test_batch import ATOL, ENGINES, MODELS, full_logits, served, sync
from verifier.engine import ModelVerifier

CASES = [("llama", engine) for engine in ENGINES] + \
    [("mistral-sliding", "paged"), ("mistral-sliding", "regions")]


def random_tree(rng: random.Random) -> DraftTree:
    """1 to 7 nodes: a main chain first (each node the child of the one before), then nodes
    under its nodes (the drafter's layout) or, half the time, under any earlier node."""
    nodes = rng.randint(1, 7)
    chain = rng.randint(1, nodes)
    parents = list(range(-1, chain - 1))
    anywhere = rng.random() < 0.5
    while len(parents) < nodes:
        parents.append(rng.randint(-1, (len(parents) if anywhere else chain) - 1))
    tokens = [rng.randint(1, 63) for _ in range(nodes)]
    for node in range(chain, nodes):  # a sibling repeating a main token now and then
        if rng.random() < 0.3:
            tokens[node] = tokens[rng.randrange(chain)]
    return DraftTree(tuple(tokens), tuple(parents))


def committed_after(rng: random.Random, tree: DraftTree) -> list[int]:
    """The tokens a round commits: an accepted path (ROOT: none), then the round's last
    token, at times one a node holds (the next main node's: its keys stand where it goes);
    now and then a few more (a later round's plain steps)."""
    chain = main_chain_length(tree.parents)  # its last node: the whole main chain accepted
    node = rng.choice([-1, chain - 1, rng.randint(-1, len(tree.token_ids) - 1)])
    tokens = tree.path(node) + [rng.choice([rng.randint(1, 63), *tree.token_ids])]
    return tokens + [rng.randint(1, 63) for _ in range(rng.choice([0, 0, 0, 2]))]


def node_logits(model, tree: DraftTree, ids: list[int]) -> torch.Tensor:
    """[1 + nodes, V]: a fresh forward's logits after ids, then after each node's path."""
    return torch.stack([full_logits(model, ids + tree.path(node))[-1]
                        for node in range(-1, len(tree.token_ids))])


def cached(cache, length: int) -> list[torch.Tensor]:
    """Every layer's keys and values at a cache's first `length` positions, [length, H, D]
    each: a transformers cache's, a paged pool's (blocks) or a regions pool's."""
    if cache.pool is None:
        return [tensor[0, :, :length].transpose(0, 1) for layer in cache.layers
                for tensor in (layer.keys, layer.values)]
    pool, positions = cache.pool, torch.arange(length)
    out = []
    for layer in range(pool.keys.shape[0]):
        for tensor in (pool.keys, pool.values):
            if tensor.dim() == 5:  # regions: [layers, regions, H, positions, D]
                out.append(tensor[layer, cache.region, :, :length].transpose(0, 1))
            else:
                units = torch.tensor(cache.units)[positions // pool.block_size]
                out.append(tensor[layer, units * pool.block_size + positions % pool.block_size])
    return out


def prefilled(model, engine: str, ids: list[int]) -> list[torch.Tensor]:
    """The keys and values a fresh runner of the engine writes prefilling ids alone."""
    runner = serving_runner(model, "transformers") if engine == "transformers" else \
        serving_runner(model, "paged", engine, kv_cache_tokens=1024)
    sequence = SessionStore(1).apply("fresh", sync([], ids))
    runner.forward([sequence.segment(runner, [], 1)])
    return cached(sequence.cache, len(ids))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name, engine", CASES)
def test_random_tree_rounds_score_every_node_and_leave_a_fresh_prefills_cache(name, engine,
                                                                             seed):
    rng = random.Random(seed)
    runner = served(name, engine)
    store = SessionStore(2)
    known, new = [], [rng.randint(1, 63) for _ in range(rng.randint(1, 12))]
    for round_ in range(8):
        tree = random_tree(rng)
        sequence = store.apply("r", sync(known, new))
        known = known + new
        [logits] = runner.forward([sequence.segment(runner, list(tree.token_ids),
                                                    len(tree.token_ids) + 1,
                                                    parents=tree.parents)])
        gap = float((logits - node_logits(runner.model, tree, known)).abs().max())
        assert gap < ATOL, (round_, tree, gap)
        for got, fresh in zip(cached(sequence.cache, len(known)),
                              prefilled(runner.model, engine, known)):
            assert float((got - fresh).abs().max()) < ATOL, (round_, tree)
        new = committed_after(rng, tree)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_verifier_scores_a_tree_as_its_nodes_fresh_laws(engine):
    """A greedy tree's argmaxes and a sampled tree's acceptance probabilities (each sibling
    against the residual of those before it) are those of the fresh laws after each node's
    path, round after round (the cache of the round before reused where it holds)."""
    rng = random.Random(0)
    verifier = ModelVerifier(served("llama", engine))
    model = verifier.model
    sampled = SamplingParams(temperature=0.8, top_k=20)
    greedy = SamplingParams(temperature=0.0)
    known = {"g": [], "s": []}
    new = {key: [rng.randint(1, 63) for _ in range(5)] for key in known}
    for _ in range(5):
        trees = {key: random_tree(rng) for key in known}
        q = {key: torch.softmax(torch.randn(len(trees[key].token_ids), 64), -1)
             for key in known}
        calls = [ScoreCall(key, sync(known[key], new[key]), trees[key].token_ids,
                           greedy if key == "g" else sampled,
                           DraftDists.from_dense(q[key]) if key == "s" else None, seed=7,
                           draft_parents=trees[key].parents) for key in known]
        scored = dict(zip(known, verifier.score_batch(calls)))
        for key in known:
            known[key] = known[key] + new[key]
        rows = {key: node_logits(model, trees[key], known[key]) for key in known}
        assert list(scored["g"].target_token_ids) == rows["g"].argmax(-1).tolist()
        accept, _ = tree_scores(trees["s"], q["s"], logits_to_probs(rows["s"], sampled),
                                torch.Generator().manual_seed(0))
        torch.testing.assert_close(torch.tensor(scored["s"].accept_probs), accept,
                                   atol=1e-4, rtol=0)
        new = {key: committed_after(rng, trees[key]) for key in known}


def test_the_cases_cover_what_they_claim():
    """The random trees leave the main chain, take the root alone and nest off it."""
    rng = random.Random(0)
    trees = [random_tree(rng) for _ in range(200)]
    assert any(tree.parents[-1] >= 0 and tree.parents[-1] != len(tree.parents) - 2
               for tree in trees)
    assert MODELS["mistral-sliding"]().config.sliding_window == 8

"""The target's law through the real engines in the configurations the other law tests do not
reach: the seeded default K = 4 (in batches that requests join and leave), an adaptive K
("auto"), blocks cut short by the draft's confidence, caches rebuilt mid-request, a
pipelined drafter whose pre-drafts fail, a padded draft vocabulary at K = 3, a draft equal
to the target (every window ends in a bonus token), and draft trees (siblings drawn without
replacement from q where the draft is least sure, accepted by recursive rejection). Every
case decodes its requests 100 at a time through batched pools. Same pair, window and exact law as
tests/stats/test_pipelined_distribution.py (the three tokens after the first, whose law is
computed from the target's forwards); chi-square at a false-failure rate of 1e-6 per case,
samples seeded.

Each case has a mutant that breaks what the case is about and must fail the same check at
the same sample size (it stops as soon as the statistic passes the threshold).
"""

import dataclasses
import random

import numpy as np
import pytest

import speculative.loop as loop
import speculative.tree as tree_module
from drafter.model import ModelDrafter
from engine.paged import PagedCache
from engine.runner import ModelRunner, serving_runner
from speculative.sampling import SamplingParams
from speculative.types import PoolUnavailable
from tests.stats.test_pipelined_distribution import (  # noqa: F401 (fixtures)
    DRAFT_TOP_K,
    PROMPT,
    SAMPLES,
    VOCAB,
    bonus_from_last_drafted_position,
    chi2_passes,
    draft,
    exact_law,
    predraft_accepted_without_its_test,
    q_shifted_by_one,
    target,
)
from tests.tiny import Batched, noisy_copy, run_seeded
from verifier import engine as verifier_engine
from verifier.engine import ModelVerifier

CHUNK = 500  # a mutant's counts are checked after every CHUNK samples


class Forgetful:
    """A pool that loses a request's cache before half of its calls (seeded), as a replica
    restart or an eviction would: the next call finds no base and is rebuilt."""

    def __init__(self, pool, seed: int) -> None:
        self.pool, self.rng = pool, random.Random(seed)

    async def _forget_maybe(self, call) -> None:
        if self.rng.random() < 0.5:
            await self.pool.release(call.request_id)

    async def propose(self, call):
        await self._forget_maybe(call)
        return await self.pool.propose(call)

    async def score(self, call):
        await self._forget_maybe(call)
        return await self.pool.score(call)

    async def release(self, request_id):
        await self.pool.release(request_id)


def padded_drafter(target):
    """A close draft whose embedding has 3 rows more than the target's (as Qwen2.5 sizes
    differ), its q fitted to the target's vocabulary."""
    padded = noisy_copy(target, 0.05, seed=33)
    padded.resize_token_embeddings(VOCAB + 3)
    return ModelDrafter(padded, vocab_size=VOCAB, draft_top_k=DRAFT_TOP_K)


class FailingPredrafts:
    """The draft's pool failing 30% of its pre-drafts (seeded: calls that draft after
    tokens still being verified), after advancing its cache: the round goes on without the
    next block, the request's next rounds skip the drafter (backoff), and the next draft
    rebuilds the drafter's prefix."""

    def __init__(self, drafter, seed: int) -> None:
        self.drafter, self.rng = drafter, random.Random(seed)

    async def propose(self, call):
        block = await self.drafter.propose(call)
        if call.assumed_token_ids and self.rng.random() < 0.3:
            raise PoolUnavailable("drafter: UNAVAILABLE: injected")
        return block

    async def release(self, request_id):
        await self.drafter.release(request_id)


def close(draft):
    return Batched(ModelDrafter(draft, draft_top_k=DRAFT_TOP_K))


def verifying(target):
    return Batched(ModelVerifier(target))


# name: (k, max_tokens, pipelined, pools(target, draft) -> (drafter, verifier)); the pools
# are batched (tests.tiny.Batched), as a replica's are
CASES = {
    "K4": (4, 6, False, lambda t, d: (close(d), verifying(t))),
    "auto": ("auto", 6, False, lambda t, d: (close(d), verifying(t))),
    "rebuilds": (2, 5, False, lambda t, d: (Forgetful(close(d), seed=1),
                                            Forgetful(verifying(t), seed=2))),
    "pipelined-fallback": (2, 5, True, lambda t, d: (FailingPredrafts(close(d), seed=3),
                                                      verifying(t))),
    "padded-K3": (3, 5, False, lambda t, d: (Batched(padded_drafter(t)), verifying(t))),
    # the draft is the target (q = p): every block is accepted whole, so the window's last
    # token is always a bonus token, drawn from p(K+1)
    "bonus": (2, 5, False, lambda t, d: (Batched(ModelDrafter(t)), verifying(t))),
    # blocks that end once the draft's confidence falls below 0.3 (1 to 4 tokens)
    "confident": (4, 6, False, lambda t, d: (Batched(ModelDrafter(
        d, draft_top_k=DRAFT_TOP_K, draft_confidence=0.3)), verifying(t))),
    # blocks of 2 positions: every request after the first takes the prompt's first block
    # from the verifier's prefix cache (shared, reference-counted)
    "prefix-hits": (3, 5, False, lambda t, d: (close(d), Batched(ModelVerifier(serving_runner(
        t, "paged", "paged", kv_cache_tokens=4096, block_size=2))))),
    # trees of 5 nodes: a main chain 2 deep and 3 siblings, up to 2 at a node, placed where
    # the main token is least sure (so the shape follows the main chain's draws), drawn
    # without replacement from q (dense: a truncated q rarely holds what the residual
    # wants), tested by recursive rejection over them
    "tree": (2, 5, False, lambda t, d: (Batched(ModelDrafter(d)), verifying(t))),
}
TREE_SHAPES = {"tree": (3, 5)}  # (width, nodes)


def sample_counts(case: str, target, draft, exact_law=None) -> tuple[np.ndarray, dict]:
    """Counts of the window over SAMPLES seeded requests (decoded concurrently, a group at a
    time); with exact_law, stops early once the counts fail the check (a mutant's run)."""
    k, max_tokens, pipelined, pools = CASES[case]
    drafter, verifier = pools(target, draft)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    counts = np.zeros((VOCAB,) * 3)
    totals = {"accepted": 0, "drafted": 0, "misses": 0, "fallbacks": 0, "pipelined": 0,
              "ks": set()}
    for i, (out, state) in enumerate(run_seeded(drafter, verifier, PROMPT, params, k, SAMPLES,
                                                pipelined, *TREE_SHAPES.get(case, (1, 0)))):
        counts[tuple(out[1:4])] += 1
        stats = state.stats
        totals["accepted"] += stats.num_accepted_tokens
        totals["drafted"] += stats.num_draft_tokens
        totals["misses"] += stats.cache_misses
        totals["cached"] = totals.get("cached", 0) + (stats.cached_tokens > 0)
        totals["fallbacks"] += stats.draft_fallback_rounds
        totals["pipelined"] += stats.pipelined_rounds
        totals["siblings"] = totals.get("siblings", 0) + stats.sibling_rounds
        totals["ks"] |= set(stats.rounds_by_k)
        if exact_law is not None and (i + 1) % CHUNK == 0 and not chi2_passes(counts,
                                                                                exact_law)[0]:
            break
    totals["batches"] = getattr(verifier, "batch_sizes", [])  # calls per verify forward
    return counts, totals


def what_ran(case: str, totals: dict) -> bool:
    """Whether the case's own path really ran (else the law check proves nothing of it)."""
    # K4 also shows requests joining and leaving the verifier's batches (they end at
    # different rounds): the logits-of-a-batch-mate mutant is what that path can get wrong
    batches = totals["batches"]
    ran = {"K4": 4 in totals["ks"] and max(batches) >= 16 and min(batches) < max(batches),
           "auto": len(totals["ks"] - {0}) > 1,
           "confident": {1, 4} <= totals["ks"],
           "rebuilds": totals["misses"] > SAMPLES / 2,
           "pipelined-fallback": totals["fallbacks"] > SAMPLES / 20
           and totals["pipelined"] > SAMPLES / 20,
           "padded-K3": 3 in totals["ks"],
           "bonus": totals["accepted"] > 0.99 * totals["drafted"] > 0,
           "prefix-hits": totals["cached"] > SAMPLES / 2,
           "tree": totals["siblings"] > SAMPLES / 20}
    return ran[case] and (case == "bonus" or 0 < totals["accepted"] < totals["drafted"])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_three_tokens_follow_the_target_law(target, draft, exact_law, case):
    counts, totals = sample_counts(case, target, draft)
    passes, message = chi2_passes(counts, exact_law)
    assert passes, f"{message}: a correct implementation fails with probability 1e-6"
    assert what_ran(case, totals), totals


real_call_pool = loop.RequestState.call_pool


async def rebuild_from_a_shorter_prefix(self, view, call):
    """Mutant of RequestState.call_pool: a rebuild (the resend after StaleBase) carries the
    prefix less its last token."""
    sent = 0

    async def shortened(sync):
        nonlocal sent
        sent += 1
        if sent > 1:
            sync = dataclasses.replace(sync, new_token_ids=sync.new_token_ids[:-1])
        return await call(sync)

    return await real_call_pool(self, view, shortened)


real_forward = ModelRunner.forward


def logits_of_a_batch_mate(runner, segments):
    """Mutant of the batched forward: each call gets the logits of the next call in its
    batch with as many positions."""
    out = real_forward(runner, segments)
    by_shape: dict[int, list[int]] = {}
    for index, rows in enumerate(out):
        by_shape.setdefault(rows.shape[0], []).append(index)
    swapped = list(out)
    for indices in by_shape.values():
        for a, b in zip(indices, indices[1:] + indices[:1]):
            swapped[a] = out[b]
    return swapped


def adopted_a_block_late(cache, holder, tokens):
    """Mutant of a prefix hit (engine.paged's adopt): the holder's block table read one
    block late, so the prompt's first block holds the keys and values of the holder's
    second (its holders keep their output's blocks too: there is one)."""
    blocks = tokens // cache.pool.block_size
    cache.units = cache.pool.share(holder.units[1:blocks + 1])


MUTANTS = [  # (case, mutant name, patch)
    ("K4", "q-shifted", lambda mp: mp.setattr(ModelDrafter, "propose_batch", q_shifted_by_one)),
    ("K4", "logits-of-a-batch-mate", lambda mp: mp.setattr(
        ModelRunner, "forward", logits_of_a_batch_mate)),
    ("auto", "q-shifted", lambda mp: mp.setattr(ModelDrafter, "propose_batch",
                                                q_shifted_by_one)),
    ("confident", "q-shifted", lambda mp: mp.setattr(ModelDrafter, "propose_batch",
                                                     q_shifted_by_one)),
    ("rebuilds", "rebuild-drops-a-token", lambda mp: mp.setattr(
        loop.RequestState, "call_pool", rebuild_from_a_shorter_prefix)),
    ("pipelined-fallback", "predraft-untested", lambda mp: mp.setattr(
        loop, "continue_with_predraft", predraft_accepted_without_its_test)),
    ("padded-K3", "q-shifted", lambda mp: mp.setattr(ModelDrafter, "propose_batch",
                                                     q_shifted_by_one)),
    ("tree", "sibling-against-unreduced-p", lambda mp: mp.setattr(
        tree_module, "residual_rows", lambda target, draft: target)),
    ("bonus", "bonus-from-p_K", lambda mp: mp.setattr(
        verifier_engine, "draw_recovered_and_bonus", bonus_from_last_drafted_position)),
    ("prefix-hits", "hit-a-block-late", lambda mp: mp.setattr(
        PagedCache, "adopt", adopted_a_block_late)),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, name, patch", MUTANTS, ids=[f"{c}-{n}" for c, n, _ in MUTANTS])
def test_each_case_catches_its_mutant(target, draft, exact_law, monkeypatch, case, name, patch):
    patch(monkeypatch)
    counts, _ = sample_counts(case, target, draft, exact_law)
    passes, message = chi2_passes(counts, exact_law)
    assert not passes, f"{case}: the {name} mutant passed: {message}"

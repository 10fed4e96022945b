"""How a pipelined request's round without candidates runs (AdaptiveK.restarts_fresh): the
target alone beside a fresh draft of K + 1, or a draft of K first, verified beside the next
block's pre-draft. The closed loop: the policy drives a simulated pair at one stream whose
pools run on separate cores (a pre-draft beside a verify costs nothing more), with i.i.d.
Bernoulli acceptance. Shapes as measured on this project's 2-core machines: the demo pair
(a verify of 6 ms, a draft token 1.2 ms) and the scaled target with the demo draft (a
verify of 45 ms, nearly flat in its tokens, a draft token 1.5 ms)."""

import random

import pytest

from speculative.costs import CostModel, RoundCost
from speculative.fixed_k import FixedK
from speculative.policy import AdaptiveK, KBounds
from tests.tiny import DraftsFirst

DEMO = {"verify_ms": 6.0, "verify_per_token_ms": 0.7, "draft_per_token_ms": 1.2}
SCALED = {"verify_ms": 45.0, "verify_per_token_ms": 0.4, "draft_per_token_ms": 1.5}
DRAFT_CALL_MS, HOP_MS = 0.3, 2.0


class OneStream:
    """Pipelined rounds of one request: carried (a pre-drafted block verified beside the
    next pre-draft), fresh and drafted restarts, and plain rounds at K = 0. Each reports
    its costs as the round's meter does (speculative.meter)."""

    def __init__(self, shape: dict, alpha: float, seed: int) -> None:
        self.shape, self.alpha, self.random = shape, alpha, random.Random(seed)
        self.carried = 0  # the length of the block pre-drafted for the next round

    def verify(self, block: int) -> float:
        return (self.shape["verify_ms"] + self.shape["verify_per_token_ms"] * block) / 1000

    def draft(self, tokens: int) -> float:
        return (DRAFT_CALL_MS + self.shape["draft_per_token_ms"] * tokens) / 1000

    def accepted(self, block: int) -> int:
        n = 0
        while n < block and self.random.random() < self.alpha:
            n += 1
        return n

    def round(self, policy, first: bool) -> tuple[int, float]:
        k, hop = policy.num_speculative_tokens(), HOP_MS / 1000
        if not k:
            self.carried = 0
            policy.update(0, 0, RoundCost(1, self.verify(0), 0, 0.0, hop, kind="plain",
                                          wall_seconds=self.verify(0) + hop, tokens=1))
            return 1, self.verify(0) + hop
        block = self.carried
        kind = "carried" if block else "fresh" if policy.restarts_fresh() else "sequential"
        if kind == "sequential":
            block = k
        waited = self.draft(block) + hop if kind == "sequential" else 0.0
        verify, beside = self.verify(block), self.draft(k + 1)
        accepted = self.accepted(block)
        tested, tokens, self.carried = accepted + (accepted < block), accepted + 1, 0
        if accepted == block:  # y1 of the pre-draft is tested at the bonus position
            tested += 1
            if self.random.random() < self.alpha:
                accepted, self.carried = accepted + 1, k
        wall = waited + max(verify, beside) + hop
        drafted = (block, self.draft(block)) if kind == "sequential" else (k + 1, beside)
        policy.update(tested, accepted, RoundCost(
            block + 1, verify, *drafted, wall - waited + (hop if waited else 0.0)
            - max(verify, beside), draft_hop_seconds=hop if waited else 0.0,
            comparable=not first, kind=kind, wall_seconds=wall, tokens=tokens))
        return tokens, wall


def tokens_per_second(shape: dict, alpha: float, policy, seed: int, rounds: int = 3000
                      ) -> float:
    pair, tokens, seconds = OneStream(shape, alpha, seed), 0, 0.0
    for i in range(rounds):
        n, s = pair.round(policy, first=i == 0)
        tokens, seconds = tokens + n, seconds + s
    return tokens / seconds


def fixed_rates(shape: dict, alpha: float) -> dict:
    return {(way.__name__, k): tokens_per_second(shape, alpha, way(k), seed=k)
            for way in (FixedK, DraftsFirst) for k in range(1, 9)}


def adaptive_rate(shape: dict, alpha: float) -> float:
    policy = AdaptiveK(KBounds(0, 8), CostModel(), pipelined=True, greedy=True)
    return tokens_per_second(shape, alpha, policy, seed=99)


def best(rates: dict, way: str) -> float:
    return max(rate for (name, _), rate in rates.items() if name == way)


@pytest.mark.parametrize("shape, alpha", [(SCALED, 0.7), (SCALED, 0.5), (DEMO, 0.75)],
                         ids=["scaled-0.7", "scaled-0.5", "demo-0.75"])
def test_the_adaptive_k_restarts_the_way_that_pays(shape, alpha):
    rates = fixed_rates(shape, alpha)
    adaptive = adaptive_rate(shape, alpha)
    assert adaptive >= 0.93 * max(rates.values()), (adaptive, rates)
    if shape is SCALED:  # a fresh round spends a whole dear verify on one token
        assert best(rates, "DraftsFirst") > 1.15 * best(rates, "FixedK")


def test_a_mutant_that_always_restarts_fresh_fails(monkeypatch):
    rates = fixed_rates(SCALED, 0.7)
    monkeypatch.setattr(AdaptiveK, "restarts_fresh", lambda self: True)
    assert adaptive_rate(SCALED, 0.7) < 0.9 * max(rates.values())


def test_under_batch_load_restarts_stay_fresh():
    policy = AdaptiveK(KBounds(0, 8), CostModel(), pipelined=True, greedy=True)
    policy.load = 16.0
    policy.k = 4
    assert policy.restarts_fresh()
    assert FixedK(4).restarts_fresh() and not DraftsFirst(4).restarts_fresh()

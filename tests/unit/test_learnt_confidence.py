"""draft_confidence "auto": the cut learnt from acceptance and costs (speculative.confidence),
carried by each draft call and fed back by each chain the drafter reports."""

import asyncio

import pytest

from speculative.confidence import EDGES, ConfidenceCut, bucket_of
from speculative.costs import CostModel
from speculative.driver import Generation
from speculative.fixed_k import FixedK
from speculative.state import Request
from speculative.policy import AdaptiveK, KBounds, k_policy
from speculative.sampling import SamplingParams
from speculative.types import DraftBlock, TargetScores
from tests.tiny import cutting_costs


def test_a_cut_with_nothing_measured_keeps_every_token():
    assert ConfidenceCut().threshold(400.0, 0.002) == 0.0


def test_token_j_plus_one_is_counted_against_the_confidence_before_it():
    cut = ConfidenceCut()
    cut.observe((0.9, 0.5, 0.15), 1)  # token 2 accepted (1 > 1 is false: no), 3 no
    high, mid, low = bucket_of(0.9), bucket_of(0.5), bucket_of(0.15)
    prior = ConfidenceCut.prior_weight * ConfidenceCut.decay
    assert cut.seen[high] == pytest.approx(prior + 1) and cut.accepted[high] == pytest.approx(prior)
    assert cut.seen[mid] == pytest.approx(prior + 1) and cut.accepted[mid] == pytest.approx(prior)
    assert cut.seen[low] == pytest.approx(prior)  # the last token is followed by none
    cut.observe((0.9, 0.5, 0.15), 3)
    assert cut.accepted[high] == pytest.approx(prior * ConfidenceCut.decay + 1)


def test_buckets_weigh_as_often_as_their_confidences_occur():
    cut = ConfidenceCut()
    for i in range(1000):  # confidences near 0.9 ten times as often as near 0.15
        cut.observe((0.9, 0.5) if i % 11 else (0.15, 0.1), 2)
    assert cut.seen[bucket_of(0.9)] / cut.seen[bucket_of(0.15)] == pytest.approx(10, rel=0.1)


def test_the_cut_rises_to_where_tokens_stop_paying():
    cut = ConfidenceCut()
    for _ in range(200):  # tokens after c >= 0.3 accepted, after c < 0.3 never
        cut.observe((0.9, 0.5, 0.25, 0.15, 0.05), 3)
    # a token must make half of what the request makes in its time
    assert cut.threshold(tokens_per_second=500.0, token_seconds=0.001) == 0.3
    # a token that costs next to nothing always pays while it is ever accepted
    cut.observe((0.25, 0.2), 2)
    assert cut.threshold(500.0, 1e-6) == 0.0


def test_a_draft_that_is_right_where_it_is_unsure_is_never_cut():
    cut = ConfidenceCut()
    for _ in range(200):  # the distilled draft: its argmax right however flat its law
        cut.observe((0.4, 0.1, 0.03, 0.01), 4)
    assert cut.threshold(500.0, 0.001) == 0.0


def test_a_draft_whose_tokens_never_pay_is_cut_at_the_top_edge():
    cut = ConfidenceCut()
    for _ in range(200):
        cut.observe((0.7, 0.5, 0.25, 0.15, 0.05, 0.03, 0.01), 0)
    assert cut.threshold(500.0, 0.001) == EDGES[-1]


def test_one_noisy_bucket_does_not_cut_the_paying_ones_below_it():
    cut = ConfidenceCut()
    for _ in range(200):
        cut.observe((0.5, 0.25, 0.15, 0.05, 0.03, 0.01), 6)  # all paying, below 0.45 too
        cut.observe((0.35, 0.01), 0)  # ...but one bucket, [0.3, 0.45), never is
    assert cut.threshold(500.0, 0.001) == 0.0


def adaptive(confidence, costs: CostModel | None = None) -> AdaptiveK:
    return AdaptiveK(KBounds(1, 8, initial=4), costs or CostModel(), pipelined=False,
                     greedy=True, confidence=confidence)


def test_the_policies_carry_the_cut():
    assert FixedK(4).draft_confidence() is None  # the pool's own
    assert FixedK(4, 0.3).draft_confidence() == 0.3
    assert adaptive(None).draft_confidence() is None
    assert adaptive(0.2).draft_confidence() == 0.2
    # "auto" needs an adaptive K and sequential rounds: else the cut is the pool's
    assert k_policy(4, False, True, confidence="auto").draft_confidence() is None
    assert k_policy("auto", True, True, confidence="auto").draft_confidence() is None
    assert k_policy("auto", False, True, confidence="auto").draft_confidence() == 0.0


def test_an_adaptive_k_learns_the_cut_and_lifts_it_to_measure():
    policy = adaptive("auto", cutting_costs())
    assert policy.draft_confidence() == 0.3
    policy.k = policy.chosen + 1  # a round that explores a neighbouring K
    assert policy.draft_confidence() == 0.0
    policy.k, policy.loaded = policy.chosen, True  # under batch load: the batch's one K
    assert policy.draft_confidence() == 0.0
    cut, high = policy.costs.confidence, bucket_of(0.9)
    seen = cut.seen[high]
    policy.observe_confidences((0.9, 0.1), 0)  # the router's shared cut learns from it
    assert cut.seen[high] == pytest.approx(seen * ConfidenceCut.decay + 1)
    adaptive(0.2, policy.costs).observe_confidences((0.9, 0.1), 0)  # not learning: ignored
    assert cut.seen[high] == pytest.approx(seen * ConfidenceCut.decay + 1)


class Reporting:
    """A drafter that reports a falling confidence and a verifier that accepts 2 of each
    block's tokens; both record what they were asked."""

    def __init__(self) -> None:
        self.thresholds = []

    async def propose(self, call):
        k = call.num_speculative_tokens
        self.thresholds.append((k, call.draft_confidence))
        return DraftBlock((1,) * k, None, confidences=tuple(0.5 ** i for i in range(1, k + 1)))

    async def score(self, call):
        k = len(call.draft_token_ids)
        return TargetScores(target_token_ids=((1, 1) + (2,) * k)[:k + 1])

    async def release(self, request_id):
        pass


class Recording(FixedK):
    def __init__(self) -> None:
        super().__init__(4, 0.25)
        self.observed = []

    def observe_confidences(self, confidences, num_accepted):
        self.observed.append((confidences, num_accepted))


def test_the_loop_sends_the_policys_cut_and_feeds_back_each_reported_chain():
    pools, policy = Reporting(), Recording()
    generation = Generation(Request("r", (5, 6), SamplingParams(temperature=0, max_tokens=9)))
    asyncio.run(generation.run(pools, pools, policy, False))
    assert pools.thresholds and {cut for _, cut in pools.thresholds} == {0.25}
    # each block of K > 0 (the first call is the drafter's prefill beside the first verify)
    assert policy.observed[0] == ((0.5, 0.25, 0.125, 0.0625), 2)
    assert [len(seen) for seen, _ in policy.observed] == [k for k, _ in pools.thresholds if k]

"""A round's clock (speculative.meter) at its edges: the counters a round books besides its
time (fallbacks, pre-drafts, cached prompt tokens, batch sizes) and how it names its kind
for a K policy, each on a round built by hand."""

import asyncio
import speculative.meter as meter
from speculative.costs import RoundCost
from speculative.rejection import RoundOutcome
from speculative.stats import SpecStats
from speculative.types import BatchLoad, DraftBlock, TargetScores
from tests.unit.test_meter import clock_for

OUTCOME = RoundOutcome((5, 6, 7), 2)


def settle(clock: meter.RoundMeter, block: DraftBlock | None) -> None:
    async def predraft():
        return block

    asyncio.run(clock.settled(predraft()))


def undrafted(clock: meter.RoundMeter, **scores) -> RoundCost:
    """A round whose draft was empty: the verifier's one token (5), and whatever `scores`
    adds (cached tokens, continued steps, compute)."""
    block = clock.drafted(DraftBlock((), None))
    verified = clock.verified(TargetScores(target_token_ids=(5,), **scores))
    return clock.finish(block, verified, RoundOutcome((5,), 0), None)


def test_a_round_without_its_draft_counts_as_a_fallback():
    stats = SpecStats()
    for fell_back in (True, False):
        clock = clock_for(stats, carried=False)
        clock.fell_back = fell_back
        undrafted(clock)
    assert stats.draft_fallback_rounds == 1 and stats.rounds == 2


def test_a_carried_blocks_compute_was_booked_in_the_round_before():
    """A carried round verifies a block drafted beside the previous verify: its compute is
    not this round's draft time, and its drafter batch is the pre-draft's."""
    stats = SpecStats()
    clock = clock_for(stats, carried=True)
    block = clock.drafted(DraftBlock((5, 6), None, compute_seconds=0.010,
                                     load=BatchLoad(batch_size=7)))
    scores = clock.verified(TargetScores(target_token_ids=(5, 6, 7)))
    settle(clock, DraftBlock((8, 9), None, load=BatchLoad(batch_size=3)))
    cost = clock.finish(block, scores, OUTCOME, None)
    assert stats.draft_compute_seconds == 0.0 and cost.draft_tokens == 2  # the pre-draft's
    assert stats.drafter_batch_calls == 3 and stats.drafter_batches == 1
    assert cost.kind == "carried"


def test_a_carried_round_without_a_predraft_is_of_no_kind():
    stats = SpecStats()
    clock = clock_for(stats, carried=True)
    block = clock.drafted(DraftBlock((5, 6), None))
    cost = clock.finish(block, clock.verified(TargetScores(target_token_ids=(5, 6, 7))),
                        OUTCOME, None)
    assert cost.kind == "" and stats.predrafts == 0


def test_the_drafters_prefill_beside_a_first_verify_is_no_predraft():
    """beside = 0: what ran beside the verify was the drafter's prefill, no draft."""
    stats = SpecStats()
    for beside in (0, 2):
        clock = clock_for(stats, carried=False)
        block = clock.drafted(DraftBlock((), None))
        scores = clock.verified(TargetScores(target_token_ids=(5,)))
        settle(clock, DraftBlock((8, 9)[:beside], None))
        clock.finish(block, scores, RoundOutcome((5,), 0), beside)
    assert stats.predrafts == 1


def test_cached_prompt_tokens_are_read_at_the_prompts_prefill_only():
    """A later round's verify may rebuild its cache from the prefix cache: the request had
    computed its prompt already, so its cached tokens are not the usage's."""
    stats = SpecStats()
    for num_output_tokens, cached in ((0, 3), (4, 9)):
        undrafted(clock_for(stats, carried=False, num_output_tokens=num_output_tokens),
                  cached_tokens=cached)
    assert stats.cached_tokens == 3


def test_a_prefill_round_says_nothing_about_k():
    comparable = []
    for num_output_tokens in (0, 4):
        clock = clock_for(SpecStats(), carried=False, num_output_tokens=num_output_tokens)
        comparable.append(undrafted(clock).comparable)
    assert comparable == [False, True]


def test_a_verify_of_several_steps_teaches_one_forwards_time():
    """A round without a draft that asked the verifier for three steps: the verify line
    learns a third of its compute, one forward's."""
    cost = undrafted(clock_for(SpecStats(), carried=False), continued_token_ids=(6, 7),
                     compute_seconds=0.030)
    assert cost.steps == 3 and abs(cost.verify_seconds - 0.010) < 1e-12

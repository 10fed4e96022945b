"""A round's clock (speculative.meter) at its edges: the counters a round books besides its
time (fallbacks, pre-drafts, cached prompt tokens, batch sizes) and how it names its kind
for a K policy, each on a round built by hand."""

import asyncio
from types import SimpleNamespace

import speculative.meter as meter
from speculative.rejection import RoundOutcome
from speculative.stats import SpecStats
from speculative.types import BatchLoad, DraftBlock, TargetScores

OUTCOME = RoundOutcome((5, 6, 7), 2)


def clock_for(stats: SpecStats, carried: bool, num_output_tokens: int = 4) -> meter.RoundMeter:
    state = SimpleNamespace(stats=stats, drafter_called=True, num_output_tokens=num_output_tokens,
                            committed=[1, 2, 3, 4], drafter_view=SimpleNamespace(known_len=4))
    return meter.RoundMeter(state, carried=carried)


def settle(clock: meter.RoundMeter, block: DraftBlock | None) -> None:
    async def predraft():
        return block

    asyncio.run(clock.settled(predraft()))


def test_a_round_without_its_draft_counts_as_a_fallback():
    stats = SpecStats()
    for fell_back in (True, False):
        clock = clock_for(stats, carried=False)
        clock.fell_back = fell_back
        clock.finish(clock.drafted(DraftBlock((), None)), TargetScores(target_token_ids=(5,)),
                     RoundOutcome((5,), 0), None)
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
        clock = clock_for(stats, carried=False, num_output_tokens=num_output_tokens)
        block = clock.drafted(DraftBlock((), None))
        scores = clock.verified(TargetScores(target_token_ids=(5,), cached_tokens=cached))
        clock.finish(block, scores, RoundOutcome((5,), 0), None)
    assert stats.cached_tokens == 3


def test_a_prefill_round_says_nothing_about_k():
    comparable = []
    for num_output_tokens in (0, 4):
        clock = clock_for(SpecStats(), carried=False, num_output_tokens=num_output_tokens)
        block = clock.drafted(DraftBlock((), None))
        scores = clock.verified(TargetScores(target_token_ids=(5,)))
        comparable.append(clock.finish(block, scores, RoundOutcome((5,), 0), None).comparable)
    assert comparable == [False, True]


def test_a_verify_of_several_steps_teaches_one_forwards_time():
    """A round without a draft that asked the verifier for three steps: the verify line
    learns a third of its compute, one forward's."""
    clock = clock_for(SpecStats(), carried=False)
    block = clock.drafted(DraftBlock((), None))
    scores = clock.verified(TargetScores(target_token_ids=(5,), continued_token_ids=(6, 7),
                                         compute_seconds=0.030))
    cost = clock.finish(block, scores, RoundOutcome((5,), 0), None)
    assert cost.steps == 3 and abs(cost.verify_seconds - 0.010) < 1e-12

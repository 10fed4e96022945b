"""A round's clock (speculative.meter): where a round's time is booked in its request's
SpecStats, on a clock the test moves."""

import asyncio
from types import SimpleNamespace

import speculative.meter as meter
from speculative.rejection import RoundOutcome
from speculative.stats import SpecStats
from speculative.types import DraftBlock, TargetScores


def clock_for(stats: SpecStats, carried: bool, num_output_tokens: int = 4,
              committed: int = 4) -> meter.RoundMeter:
    """A round's clock for a request past its first drafter call, `committed` tokens in, its
    drafter having seen 4 of them."""
    state = SimpleNamespace(stats=stats, drafter_called=True, num_output_tokens=num_output_tokens,
                            committed=list(range(committed)),
                            drafter_view=SimpleNamespace(known_len=4))
    return meter.RoundMeter(state, carried=carried)


def test_a_predrafts_compute_past_the_verify_is_the_drafters_not_transport(monkeypatch):
    """A carried round: its verify takes 10 ms (8 of them the verifier's compute) beside a
    pre-draft of 25 ms of compute, for which the round then waits 20 ms: the last 15 of its
    compute and 5 of its call's way back. The 15 ms were booked as transport."""
    now = [0.0]
    monkeypatch.setattr(meter.time, "perf_counter", lambda: now[0])
    stats = SpecStats()
    clock = clock_for(stats, carried=True)
    block = clock.drafted(DraftBlock((5, 6), None))
    now[0] += 0.010
    scores = clock.verified(TargetScores(target_token_ids=(5, 6, 7), compute_seconds=0.008))

    async def predraft():
        now[0] += 0.020
        return DraftBlock((8, 9), None, compute_seconds=0.025)

    asyncio.run(clock.settled(predraft()))
    clock.finish(block, scores, RoundOutcome((5, 6, 7), 2), None)
    phases = {name: round(ms, 6) for name, ms in stats.ms_per_round().items()}
    assert phases == {"draft": 15.0, "verify": 8.0, "transport": 7.0, "router": 0.0,
                      "total": 30.0}
    assert stats.overhead_ms_p50 == 7.0  # beyond the compute the round waited for


def test_a_failed_predraft_is_no_predraft():
    """A pre-draft call that failed (the drafter unreachable, busy or late: settled answers
    None) drafted nothing: it was counted in `predrafts` as a draft run beside the verify."""
    stats = SpecStats()
    for failed in (True, False):
        clock = clock_for(stats, carried=True)
        block = clock.drafted(DraftBlock((5, 6), None))
        scores = clock.verified(TargetScores(target_token_ids=(5, 6, 7)))

        async def predraft():
            return None if failed else DraftBlock((8, 9), None)

        asyncio.run(clock.settled(predraft()))
        clock.finish(block, scores, RoundOutcome((5, 6, 7), 2), None)
    assert stats.predrafts == 1 and stats.rounds == 2

"""A pool with no room for a call now (PoolBusy: its KV cache, or its calls in flight, full)
is waited for, not failed: the same call again after doubling pauses, within a deadline.

The round is the same round again (the same block, the same seed), so a retry is exact; a
pool that dropped the request's cache meanwhile answers StaleBase and RequestState.call_pool
resends the prefix. A request waits whether or not its output has begun: a stream has
already answered 200, and one choice of n refused while its siblings stream would end them
all. Past the deadline the PoolBusy goes up (the router's 429, or a stream's error event).

A drafter that fails is not waited for: the rounds go on without it a while (DraftBackoff).
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from speculative.stats import SpecStats
from speculative.types import PoolBusy

BUSY_PAUSE_S, MAX_BUSY_PAUSE_S = 0.05, 1.0
T = TypeVar("T")


async def retried_while_busy(wait_s: float, stats: SpecStats,
                             call: Callable[[], Awaitable[T]],
                             clock: Callable[[], float] = time.monotonic,
                             sleep: Callable[[float], Awaitable] = asyncio.sleep,
                             counted: str = "busy_seconds") -> T:
    """await call(), again after pauses of 0.05 s doubling to 1 s while it raises PoolBusy,
    while the next pause ends within wait_s of the first call (a pool answers a refusal
    after its batch in hand: the refused calls' time counts, not only the pauses); counted
    in stats (busy_retries, and busy_seconds, the refused calls and the pauses, which the
    round's meter leaves out of its timings; counted: the stats' field that sums them, a
    drafter's apart from the verifier's)."""
    deadline, pause = clock() + wait_s, BUSY_PAUSE_S
    while True:
        started = clock()
        try:
            return await call()
        except PoolBusy:
            if clock() + pause > deadline:
                raise
        stats.busy_retries += 1
        await sleep(pause)
        setattr(stats, counted, getattr(stats, counted) + clock() - started)
        pause = min(2 * pause, MAX_BUSY_PAUSE_S)


MAX_SKIPPED_DRAFTS = 32


class DraftBackoff:
    """The drafter is an accelerator, not a dependency: after a draft fails (the pool is
    down, overloaded or past its deadline) the request's next rounds run without one, 1, 2,
    4 ... up to MAX_SKIPPED_DRAFTS rounds after consecutive failures, so a dead pool costs a
    few failed calls, not one per round; a draft that arrives resets it."""

    def __init__(self) -> None:
        self.failures = 0
        self.skipping = 0  # rounds left to run without asking the drafter

    def may_draft(self) -> bool:
        """Whether this round may ask the drafter (a round that may not counts down)."""
        if self.skipping:
            self.skipping -= 1
            return False
        return True

    def failed(self) -> None:
        self.failures += 1
        self.skipping = min(2 ** (self.failures - 1), MAX_SKIPPED_DRAFTS)

    def succeeded(self) -> None:
        self.failures = 0

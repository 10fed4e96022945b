"""A pool replica's health as Serve's periodic check_health reads it (deployments.pools).

Unhealthy: a stuck model worker, or a dead engine. Stuck: a batch has run for longer than
health_stall_s, or calls have waited that long with no batch finished. A batch counts from
when it was formed, whether or not its callers still wait: the router gives up on a draft
after draft_timeout_s (1 s) and on a verify after call_timeout_s (30 s), both well within
the stall bound, so calls that time out one after another never wait through a stall of 60 s.
Dead: the engine has failed every batch for health_stall_s, FAILED_BATCHES at least (a
sticky CUDA error fails every forward after it; answered fast, such a replica never looks
stalled, and a drafter's failures only turn rounds into the target's alone). Not sooner: a
request that fails the engine (a bug), retried by its client, would otherwise restart a
replica that serves everyone else; one batch answered in between ends the streak. Refusals
(bad input, a full KV cache) are answers, not failures. Serve replaces an unhealthy
replica; the pools' callers fall back to Serve's routing and rebuild their caches (exact).
"""

import contextlib
import logging
import time

log = logging.getLogger("ray.serve")

FAILED_BATCHES = 3  # engine failures in a row (over health_stall_s) that make it unhealthy
LOGGED_REQUEST_IDS = 8  # a failed batch's log line names at most this many of its requests
# a streak's first failure is logged with its traceback, later ones at most this often (a
# dead engine under load fails a batch every few milliseconds until Serve replaces it)
FAILURES_LOGGED_EVERY_S = 5.0


class Throttle:
    """Whether a repeated event is said in the log now: the first time, then at most once
    every `every_s` seconds (a dead engine, a drafter app that is down: a line each time
    would flood the log)."""

    def __init__(self, every_s: float) -> None:
        self.every_s, self.last = every_s, None

    def due(self, now: float, first: bool = False) -> bool:
        if first or self.last is None or now - self.last >= self.every_s:
            self.last = now
            return True
        return False


class FailureLog:
    """A warning for calls that fail, at most once every `every_s` seconds, with how many
    failed since the one before."""

    def __init__(self, what: str, every_s: float, clock=time.monotonic) -> None:
        self.what, self.logged, self.clock = what, Throttle(every_s), clock
        self.failed = 0

    def failure(self, error: Exception) -> None:
        self.failed += 1
        if self.logged.due(self.clock()):
            log.warning("%s: %d failed since the last warning; the latest: %s",
                        self.what, self.failed, error)
            self.failed = 0


class BatchHealth:
    def __init__(self, stall_s: float, refusals: tuple[type, ...]) -> None:
        """refusals: what a batch may raise that refuses its calls (an answer, not a fault)."""
        self.stall_s, self.refusals = stall_s, refusals
        self.last_progress = time.monotonic()  # when the worker last finished a batch
        self.running_since: float | None = None  # the batch in progress was formed then
        self.failed = 0  # batches in a row the engine failed
        self.failing = (0.0, 0.0)  # when the first and the last of them failed
        self.failure: Exception | None = None  # the last of them
        self.logged = Throttle(FAILURES_LOGGED_EVERY_S)

    def idle(self) -> None:
        """Calls arrive at a replica where none waited: an idle worker is not a stalled one,
        but a batch still running is (its callers gave up; the worker did not finish)."""
        if self.running_since is None:
            self.last_progress = time.monotonic()

    @contextlib.contextmanager
    def batch(self, calls: list):
        """Around one batch's run: timed, and a failure (not a refusal) logged with the
        requests it failed (their ids read then, not on every batch), and counted until a
        batch is answered."""
        self.running_since = time.monotonic()
        try:
            yield
        except self.refusals:
            raise
        except Exception as error:
            now = time.monotonic()
            self.failing = (self.failing[0] if self.failed else now, now)
            self.failed, self.failure = self.failed + 1, error
            if self.logged.due(now, first=self.failed == 1):
                shown = ", ".join(call.request_id for call in calls[:LOGGED_REQUEST_IDS])
                more = len(calls) - LOGGED_REQUEST_IDS
                log.error("the engine failed a batch of %d calls (%s%s); %d in a row",
                          len(calls), shown, f" and {more} more" if more > 0 else "",
                          self.failed, exc_info=self.failed == 1)  # a streak's traceback
            raise
        else:
            self.failed, self.failure = 0, None
        finally:
            self.running_since = None
            self.last_progress = time.monotonic()

    def check(self, waiting: int) -> None:
        """RuntimeError when the replica is stuck or its engine dead; waiting: calls
        submitted and not answered."""
        now = time.monotonic()
        if self.running_since is not None and now - self.running_since > self.stall_s:
            raise RuntimeError(f"the model worker has not finished a batch formed "
                               f"{now - self.running_since:.0f} s ago")
        stalled = now - self.last_progress
        if waiting and stalled > self.stall_s:
            raise RuntimeError(f"{waiting} calls wait and the model worker has not "
                               f"finished a batch for {stalled:.0f} s")
        first, last = self.failing
        if self.failed >= FAILED_BATCHES and last - first >= self.stall_s:
            raise RuntimeError(f"the engine failed the last {self.failed} batches, over "
                               f"{last - first:.0f} s: {self.failure!r}")

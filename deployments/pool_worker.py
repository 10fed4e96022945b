"""Where a pool replica's engine runs: on its one worker thread (the engine and its caches are
single-threaded), so that the event loop stays free for gRPC, health checks and metrics while
the model runs, or on the event loop itself for a lone small call (`runs_inline`).
deployments.pools' PoolReplica serves the calls; this mixin owns the worker, the lock of
whoever runs the engine, and the engine's gauges read after each run."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from deployments.metrics import PoolMetrics
from engine.kv import PoolEngine

# a lone call feeding at most this many tokens runs on the event loop, not the worker thread
INLINE_MAX_TOKENS = 32


class EngineWorker:
    engine: PoolEngine  # the replica's (deployments.pools), and its gauges
    metrics: PoolMetrics

    def open_worker(self) -> None:
        """The worker thread, running torch with as many threads as this one."""
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine",
                                         initializer=torch.set_num_threads,
                                         initargs=(torch.get_num_threads(),))
        self.engine_lock = threading.Lock()  # whoever runs the engine holds it

    def engine_batch(self, run_batch, calls: list) -> list:
        """On the worker: drop sessions idle past their TTL, then run the batch."""
        self.engine.sessions.sweep()
        return run_batch(calls)

    async def run_engine(self, run_batch, calls: list) -> list:
        """The batch's answers: on the event loop when it runs inline and the engine is
        free, else on the worker, as is one that may close sessions (a TTL sweep due, an
        eviction: a suffix drafter indexes each closed output, about 170 us a token)."""
        if self.runs_inline(calls) and self.engine_lock.acquire(blocking=False):
            try:
                if not self.engine.sessions.may_close(calls[0].request_id,
                                                      INLINE_MAX_TOKENS):
                    return self.engine_batch(run_batch, calls)
            finally:
                self.metrics.read_engine(self.engine)
                self.engine_lock.release()
        return await self.on_worker(self.engine_batch, run_batch, calls)

    def runs_inline(self, calls: list) -> bool:
        """A lone small call runs on the event loop itself, when the worker is not using the
        engine: the hop to the worker thread and back costs about 0.4 ms a call on a 2-core
        VM, a tenth of a small forward. The loop waits meanwhile, so a call that feeds many
        tokens (a prefill) goes to the worker, and so does a batch (its callers' next calls
        arrive while it runs)."""
        return len(calls) == 1 and self.feed_tokens(calls[0]) <= INLINE_MAX_TOKENS

    def feed_tokens(self, call) -> int:
        """Tokens the engine forwards for the call (a bound)."""
        raise NotImplementedError

    async def on_worker(self, work, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, self.owning,
                                                                work, *args)

    def owning(self, work, *args):
        """On the worker: `work` with the engine to itself, then the engine's gauges read."""
        with self.engine_lock:
            try:
                return work(*args)
            finally:
                self.metrics.read_engine(self.engine)

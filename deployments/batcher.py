"""Continuous batching for a pool replica: the calls that arrive while the model is busy run
together as soon as it is free.

Serve's `serve.batch` seals a batch when it forms it (at the first call plus
batch_wait_timeout_s) and queues the sealed batches behind the running one: measured here,
three calls arriving during a forward ran as three batches of one. A verifier must instead
form its next batch at the moment the model frees up, from everything that has arrived, with
no added wait at low load (a lone call runs at once). That is this loop.

Under load, requests fall into cohorts: the calls answered by one batch come back (after the
router's turn, or a draft) while the next batch runs, so two or more groups alternate and
every forward carries a fraction of the requests (measured, 16 greedy streams at K = 0:
9.4 calls a batch out of 16). Each forward streams all the weights whatever its size, so
the batcher lingers: when the model is free and calls wait, but requests of the previous
batch have not come back, it waits for them up to `linger` times the previous run's
duration (at most MAX_LINGER_S). A lone request never waits (nothing else is waiting
when it comes back).
"""

import asyncio
import time

MAX_LINGER_S = 0.01


def without_frames(error: BaseException) -> BaseException:
    """error, and the errors it was raised from or during, without their tracebacks (the run
    has logged them): their frames hold the failed forward's tensors (an out-of-memory
    error's activations), kept through the next batches by whoever keeps the error."""
    link, seen = error, set()
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return error


class ContinuousBatcher:
    """`await batcher.submit(call)` -> its answer from `run(calls) -> answers` (a coroutine);
    at most max_batch_size calls per run, one run at a time, in arrival order. An answer
    for which `unfinished(answer)` holds (a prefill cut to the forward's token budget) is
    no answer yet: its call goes first into the next run, up to half the batch's calls,
    rounded down (more wait behind the calls that arrived meanwhile, so long prompts cannot
    fill every slot while decodes wait)."""

    def __init__(self, run, max_batch_size: int, unfinished=lambda answer: False,
                 key=None, linger: float = 0.0, idle=None) -> None:
        """key(call): the request a call belongs to (lingering needs it); linger: the
        fraction of the previous run's duration a batch may wait for the requests of the
        previous batch to come back (0: never waits); idle(): called when no call is left
        to run (a gauge of the running batch reads 0 then, not the last batch for good)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if linger < 0:
            raise ValueError(f"linger must be >= 0, got {linger}")
        self.run, self.max_batch_size, self.unfinished = run, max_batch_size, unfinished
        self.idle = idle
        self.key, self.linger = key, linger if key is not None else 0.0
        self.returning: set = set()  # requests answered by the last batch, not back yet
        self.ended: set = set()  # released while calls of theirs wait or run
        self.withdrawn: dict = {}  # request -> the answer its calls in the running batch get
        self.running: list = []  # the running batch's calls
        self.last_run_s = 0.0
        self.waiting: list[tuple[object, asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None

    async def submit(self, call):
        return await self.enqueue(call)

    def enqueue(self, call) -> asyncio.Future:
        """The future of `call`'s answer, queued for the next run (cancel it to withdraw the
        call); calls enqueued in one go wait together and so share a run."""
        task = self._loop_task
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            # the serving task belongs to the event loop it runs on (a replica has one; a
            # test may run several in turn)
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.create_task(self._serve())
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((call, future))
        self._wakeup.set()
        return future

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            ran = False
            while True:
                if not self._drop_cancelled():
                    break
                await self._wait_for_returning()
                live = self._drop_cancelled()
                if not live:  # every caller left while the batch waited: no empty run
                    break
                batch, self.waiting = live[:self.max_batch_size], live[self.max_batch_size:]
                started, ran = time.perf_counter(), True
                self.withdrawn = {}  # (what withdraw() says while this batch runs)
                self.running = [call for call, _ in batch]
                try:
                    answers = await self.run(self.running)
                except Exception as error:  # the whole batch failed: every caller learns why
                    error = without_frames(error)
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    continue
                finally:
                    self.last_run_s = time.perf_counter() - started
                    self.running = []
                again, withdrawn = [], self.withdrawn
                for (call, future), answer in zip(batch, answers):
                    if self.unfinished(answer) and withdrawn and self.key(call) in withdrawn:
                        if not future.done():  # cut short and withdrawn: it goes no further
                            future.set_result(withdrawn[self.key(call)])
                    elif self.unfinished(answer):
                        again.append((call, future))
                    elif not future.done():
                        future.set_result(answer)
                if self.linger:  # (none while calls go again: they fill the next batch)
                    self.returning = set() if again else {
                        self.key(call) for (call, _), answer in zip(batch, answers)
                        if not self.unfinished(answer)} - self.ended
                first = self.max_batch_size // 2  # (of a batch of one: none; else a
                # prefill took every forward until its last while the others waited)
                self.waiting = again[:first] + self.waiting + again[first:]
                if again:  # the loop serves between two runs of a call (a lone call's steps
                    await asyncio.sleep(0)  # run inline), and what arrives joins the next
                if self.ended:  # kept while calls of theirs wait
                    self.ended &= {self.key(call) for call, _ in self.waiting}
            if ran and self.idle is not None:  # the loop above ends when no call waits
                self.idle()

    def _drop_cancelled(self) -> list:
        """The waiting calls whose callers still wait (a client gone leaves its call)."""
        self.waiting = [(call, future) for call, future in self.waiting if not future.done()]
        return self.waiting

    async def _wait_for_returning(self) -> None:
        """Wait (up to the linger) for the requests of the previous batch that have not come
        back, while the batch-to-be has room for them."""
        missing = self._missing()
        if not missing:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(MAX_LINGER_S, self.linger * self.last_run_s)
        while missing and len(self.waiting) < self.max_batch_size:
            left = deadline - loop.time()
            if left <= 0:
                break
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except asyncio.TimeoutError:
                break
            missing = self._missing()
        self.returning = set()  # whoever is not back by now is not waited for again

    def _missing(self) -> set:
        if not self.returning:
            return set()
        return self.returning - {self.key(call) for call, _ in self.waiting}

    def withdraw(self, key, answer) -> bool:
        """Answer `answer` to the calls of request `key` that wait (and to those of the
        running batch that come back unfinished: a prefill cut short, a call of several
        steps), so that none of them runs on (a request released before the cancels of its
        calls came). Whether a call of `key` was waiting or running."""
        found = self.runs(key)
        if found:  # (kept for this batch alone: an idle replica kept every release's)
            self.withdrawn[key] = answer
        for call, future in self.waiting:
            if self.key(call) == key and not future.done():
                future.set_result(answer)
                found = True
        return found

    def runs(self, key) -> bool:
        return any(self.key(call) == key for call in self.running)

    def forget(self, key) -> None:
        """A request that ended (released) will not come back: never wait for it. Its calls
        still waiting stay (withdraw answers them)."""
        self.returning.discard(key)
        # nor once its calls queued or running now are answered (one with neither is in no
        # batch: kept, an idle replica kept every release's)
        if self.linger and (self.runs(key) or any(self.key(c) == key for c, _ in self.waiting)):
            self.ended.add(key)
        if self._wakeup is not None:  # a batch lingering for it stops waiting now
            self._wakeup.set()

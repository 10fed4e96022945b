"""Continuous batching for a pool replica: the calls that arrive while the model is busy run
together as soon as it is free.

Serve's `serve.batch` seals a batch when it forms it (at the first call plus
batch_wait_timeout_s) and queues the sealed batches behind the running one: measured here,
three calls arriving during a forward ran as three batches of one. A verifier must instead
form its next batch at the moment the model frees up, from everything that has arrived, with
no added wait at low load (a lone call runs at once). That is this loop.
"""

import asyncio


class ContinuousBatcher:
    """`await batcher.submit(call)` -> its answer from `run(calls) -> answers` (a coroutine);
    at most max_batch_size calls per run, one run at a time, in arrival order. An answer
    for which `unfinished(answer)` holds (a prefill cut to the forward's token budget) is
    no answer yet: its call goes first into the next run, up to half the batch's calls
    (more wait behind the calls that arrived meanwhile, so long prompts cannot fill every
    slot while decodes wait)."""

    def __init__(self, run, max_batch_size: int, unfinished=lambda answer: False) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.run, self.max_batch_size, self.unfinished = run, max_batch_size, unfinished
        self.waiting: list[tuple[object, asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None

    async def submit(self, call):
        task = self._loop_task
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            # the serving task belongs to the event loop it runs on (a replica has one; a
            # test may run several in turn)
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.create_task(self._serve())
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((call, future))
        self._wakeup.set()
        return await future

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while True:
                # a cancelled caller (a client gone) leaves its call behind
                live = [(call, future) for call, future in self.waiting if not future.done()]
                if not live:
                    self.waiting.clear()
                    break
                batch, self.waiting = live[:self.max_batch_size], live[self.max_batch_size:]
                try:
                    answers = await self.run([call for call, _ in batch])
                except Exception as error:  # the whole batch failed: every caller learns why
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    continue
                again = []
                for (call, future), answer in zip(batch, answers):
                    if self.unfinished(answer):
                        again.append((call, future))
                    elif not future.done():
                        future.set_result(answer)
                first = max(1, self.max_batch_size // 2)
                self.waiting = again[:first] + self.waiting + again[first:]

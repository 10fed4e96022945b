"""Admission: choices (n counts) running at once in one router replica. A request whose
choices do not fit waits its turn in a queue, first come first served as vLLM's scheduler
takes its waiting requests (or by priority, then arrival, under vLLM's priority policy);
beyond max_waiting waiting requests it is refused at once with 429 and Retry-After. Its
load (vLLM's /load) is the requests admitted or waiting."""

import asyncio
import bisect
import itertools

from deployments.ingress import BadRequest, retry_later


class Admission:
    def __init__(self, max_running: int, on_change=lambda running: None, *,
                 max_waiting: int = 0, on_waiting=lambda waiting: None,
                 by_priority: bool = False) -> None:
        self.max_running = max_running
        self.by_priority = by_priority  # vLLM's priority policy; else FCFS
        self.max_waiting = max_waiting  # requests (not choices) waiting; 0: none wait
        self._running = 0  # admitted choices not yet finished
        self.admitted = 0  # the requests those choices are of
        # ((priority, arrival), choices, the future set once they are taken for it), in turn
        self._waiting: list[tuple[tuple[int, int], int, asyncio.Future]] = []
        self._arrivals = itertools.count()
        self.on_change = on_change  # told each new count (the router's running gauge)
        self.on_waiting = on_waiting  # told each new queue length (its waiting gauge)

    @property
    def running(self) -> int:
        return self._running

    @running.setter
    def running(self, value: int) -> None:
        self._running = value
        self.on_change(value)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def load(self) -> int:
        """vLLM's server_load: requests (not choices) admitted or waiting for their turn."""
        return self.admitted + self.waiting

    def fits_now(self, num_choices: int, priority: int = 0) -> bool:
        """Whether the choices would run now: slots free, and nobody waiting ahead of them
        (of its priority or before it: lower first, as vLLM's; one priority is FCFS)."""
        ahead = self._waiting and self._waiting[0][0][0] <= priority
        return not ahead and self.running + num_choices <= self.max_running

    def admit(self, num_choices: int) -> "Ticket":
        """A ticket for the request's choices at once, for a caller that does not wait: 429
        while others hold or wait for the slots it needs, 400 as check's."""
        self.check(num_choices)
        ticket = self.taken(num_choices)
        if ticket is None:
            raise self.at_capacity()
        return ticket

    def taken(self, num_choices: int, priority: int = 0) -> "Ticket | None":
        """A ticket for the choices if they run now (fits_now), their slots taken; else
        None."""
        if not self.fits_now(num_choices, priority):
            return None
        self.running += num_choices
        self.admitted += 1
        return Ticket(self, num_choices)

    async def wait_turn(self, num_choices: int, priority: int = 0) -> "Ticket":
        """A ticket for the request's choices once they fit and the requests queued ahead of
        it have theirs; 429 when the queue is full, 400 as check's. A waiter cancelled (its
        client gone: asyncio.CancelledError) leaves the queue holding no slot."""
        self.check(num_choices, priority)
        if (ticket := self.taken(num_choices, priority)) is not None:
            return ticket
        turn = ((priority, next(self._arrivals)), num_choices,
                asyncio.get_running_loop().create_future())
        bisect.insort(self._waiting, turn, key=lambda waiter: waiter[0])
        self.on_waiting(self.waiting)
        try:
            await turn[2]
        except BaseException:  # asyncio.CancelledError: its client went away
            self.leave(turn)
            raise
        return Ticket(self, num_choices)  # its slots were taken for it (hand_over)

    def check(self, num_choices: int, priority: int = 0, param: str = "n",
              counted: str = "the request's {} choices (its prompts x n)") -> None:
        """wait_turn's refusal, if it would refuse now, without queueing: asked before a
        request's prompts are read, as vLLM does (tokenizing a 1 MiB prompt holds the
        router's one tokenizing thread 0.65 s and its event loop 0.26 s, spent for nothing on
        a request then refused). Choices that could never run at once: a 400 naming `param`,
        saying what they are (`counted`, formatted with their number)."""
        if priority and not self.by_priority:  # as vLLM's FCFS refuses it
            raise BadRequest(f"priority {priority} asks for priority scheduling, which this "
                             "router does not run (its scheduling_policy: fcfs)",
                             param="priority")
        if num_choices > self.max_running:  # it could never run
            raise BadRequest(f"{counted.format(num_choices)} exceed the {self.max_running} "
                             "this server runs at once (the router's max_running_requests)",
                             param=param)
        if not self.fits_now(num_choices, priority) and self.waiting >= self.max_waiting:
            raise self.at_capacity()

    def at_capacity(self) -> BadRequest:
        return retry_later(f"the server is at capacity ({self.max_running} running choices, "
                           f"{self.waiting} requests waiting); retry later", 429)

    def release(self, num_choices: int) -> None:
        """A ticket's choices given back: the slots go to the waiters whose turn it is."""
        self.running -= num_choices
        self.admitted -= 1
        self.hand_over()

    def hand_over(self) -> None:
        """Free slots taken for the waiters in turn (first come first served, as vLLM's
        scheduler; by priority first under its priority policy): while the head's choices
        (n > 1) do not fit, none behind it is admitted, so that a request of many choices is
        not overtaken by later small ones for ever. A cancelled waiter at the head leaves,
        holding nothing."""
        queued = self.waiting
        while self._waiting:
            _, num_choices, future = self._waiting[0]
            if not future.done() and self.running + num_choices > self.max_running:
                break
            self._waiting.pop(0)
            if not future.done():
                self.running += num_choices  # taken now: nobody overtakes it before it runs
                self.admitted += 1
                future.set_result(None)
        if self.waiting != queued:
            self.on_waiting(self.waiting)

    def leave(self, turn: tuple[tuple[int, int], int, asyncio.Future]) -> None:
        """A waiter cancelled: out of the queue; slots already taken for it (handed over as
        it was cancelled) go back. Either way the waiters behind it may now go: it may have
        been the head they waited behind, or the one a release woke."""
        _, num_choices, future = turn
        if future.done() and not future.cancelled():
            self.running -= num_choices
            self.admitted -= 1
        elif turn in self._waiting:
            self._waiting.remove(turn)
            self.on_waiting(self.waiting)
        self.hand_over()


class Ticket:
    """An admitted request's running choices, given back once however the request ends."""

    def __init__(self, admission: Admission, num_choices: int) -> None:
        self.admission, self.num_choices = admission, num_choices
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.release(self.num_choices)

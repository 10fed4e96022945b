"""Admission: choices (n counts) running at once in one router replica. Beyond the limit a
request is refused at once with 429 and Retry-After instead of queueing."""

from deployments.ingress import BadRequest, retry_later


class Admission:
    def __init__(self, max_running: int, on_change=lambda running: None) -> None:
        self.max_running = max_running
        self._running = 0  # admitted choices not yet finished
        self.on_change = on_change  # told each new count (the router's running gauge)

    @property
    def running(self) -> int:
        return self._running

    @running.setter
    def running(self, value: int) -> None:
        self._running = value
        self.on_change(value)

    def admit(self, num_choices: int) -> "Ticket":
        """A ticket for the request's choices; 429 while others hold the slots it needs,
        400 when it asks for more than there are (it could never run)."""
        self.check(num_choices)
        self.running += num_choices
        return Ticket(self, num_choices)

    def check(self, num_choices: int) -> None:
        """admit's refusal, if it would refuse now, without taking the slots: asked before a
        request's prompts are read, as vLLM does (tokenizing a 1 MiB prompt holds the
        router's one tokenizing thread 0.65 s and its event loop 0.26 s, spent for nothing on
        a request then refused)."""
        if num_choices > self.max_running:
            raise BadRequest(f"the request's {num_choices} choices (its prompts x n) exceed the "
                             f"{self.max_running} this server runs at once (the router's "
                             "max_running_requests)", param="n")
        if self.running + num_choices > self.max_running:
            raise retry_later(f"the server is at capacity ({self.max_running} running "
                              "choices); retry later", 429)


class Ticket:
    """An admitted request's running choices, given back once however the request ends."""

    def __init__(self, admission: Admission, num_choices: int) -> None:
        self.admission, self.num_choices = admission, num_choices
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.running -= self.num_choices

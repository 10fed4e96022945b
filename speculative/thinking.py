"""vLLM 0.32's thinking_token_budget: once an output has spent `budget` tokens inside a
thinking section, the end-of-thinking ids are forced, one a step, then it decodes freely.

As vLLM's ThinkingBudgetStateHolder reads a plain decode (one token a step): a section opens
at the start ids (in the output, or in the prompt where its last start ids come after its
last end ids: the tokens after them there count too, less len(start) - 1 unless they spent
the budget already, as vLLM counts them from the start ids' last id) and closes at the first
end ids after its start, or once the forced ones are in. Its count is the tokens after the
start ids; when it reaches the budget, the next tokens are the end ids. As vLLM's too, end
ids that stood in the output before a section's start ids (after the last section) leave
that section without a natural close: only the forced ids end it. Forced ids need no model,
so the router commits them itself, cutting the round there
(speculative.state.RequestState.commit): the output is the target's own decode under vLLM's
forcing whatever the rounds commit at once.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingBudget:
    """The budget and the reasoning parser's ids (deployments.reasoning.ThinkTokens)."""

    budget: int
    start: tuple[int, ...]
    end: tuple[int, ...]

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 0:
            raise ValueError(f"thinking budget must be a non-negative integer, got "
                             f"{self.budget!r}")
        if not self.start or not self.end:
            raise ValueError("a thinking budget needs the start and end ids")


def last_at(ids: Sequence[int], part: tuple[int, ...]) -> int:
    """Where `part` last occurs in ids; -1 where it does not (a long prompt is searched
    for its last id at C speed, not sliced at each position)."""
    backwards, width = list(reversed(ids)), len(part)
    at = 0
    while True:
        try:
            at = backwards.index(part[-1], at)
        except ValueError:
            return -1
        end = len(ids) - at
        if end >= width and tuple(ids[end - width:end]) == part:
            return end - width
        at += 1


class ThinkingTracker:
    """One request's section state, advanced a committed output token at a time."""

    def __init__(self, budget: ThinkingBudget, prompt: Sequence[int]) -> None:
        self.budget = budget
        start, end = last_at(prompt, budget.start), last_at(prompt, budget.end)
        self.inside = start > end  # the prompt opened a section (a template's <think>)
        self.count = len(prompt) - start - len(budget.start) if self.inside else 0
        if self.inside and self.count < budget.budget:  # as vLLM's count after the prompt:
            # from the start ids' last id, not past them (len(start) - 1 tokens later)
            self.count -= len(budget.start) - 1
        self.ending: int | None = None  # the end ids forced so far, while forcing
        self.pinned = False  # end ids stood in the output before this section's start
        self.tail: list[int] = []  # the output since the last section closed (vLLM's scan)

    def forced(self) -> int | None:
        """The id the next output token must be, or None where the model chooses it."""
        if self.ending is None and self.inside and self.count >= self.budget.budget:
            self.ending = 0
        return None if self.ending is None else self.budget.end[self.ending]

    def free(self) -> int:
        """The output ids the model chooses at least before a forced one can come."""
        if self.ending is not None:
            return 0
        if self.inside:
            return max(0, self.budget.budget - self.count)
        return self.budget.budget + 1  # a token completes the start ids at the soonest

    def advance(self, token: int) -> None:
        """The next output token committed (a forced one: the id forced() gave)."""
        if self.ending is not None:
            self.ending += 1
            if self.ending == len(self.budget.end):
                self.closed()
            return
        self.tail.append(token)
        if not self.inside:
            if self.completes(self.budget.start):
                self.inside, self.count = True, 0
            elif self.completes(self.budget.end):
                self.pinned = True
        elif not self.pinned and self.completes(self.budget.end):
            self.closed()
        else:
            self.count += 1

    def completes(self, part: tuple[int, ...]) -> bool:
        return len(self.tail) >= len(part) and tuple(self.tail[-len(part):]) == part

    def closed(self) -> None:
        self.inside, self.count, self.ending, self.pinned = False, 0, None, False
        self.tail = []

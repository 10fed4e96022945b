"""What a K policy answers the round loop (KPolicy), and the policy that drafts the same K
every round (FixedK, vLLM's num_speculative_tokens); the adaptive one is
speculative.policy's AdaptiveK, and speculative.policy.k_policy chooses between them."""

from typing import Protocol

from speculative.costs import RoundCost


class KPolicy(Protocol):
    def num_speculative_tokens(self) -> int: ...

    def update(self, num_drafted: int, num_accepted: int,
               cost: RoundCost | None = None) -> None: ...

    def draft_confidence(self) -> float | None:
        """The next draft call's draft_confidence (None: the pool's own)."""

    def observe_confidences(self, confidences, num_accepted: int) -> None:
        """A chain's reported confidences and how many of its tokens were accepted."""

    def round_shape(self, free: bool) -> tuple[int, int] | None:
        """(depth, nodes) of a draft tree for this round's draft, or None: a chain of K.
        Asked every round; free: whether the round drafts K now, sequentially (else it is
        a chain whatever the answer)."""

    def refuse_trees(self) -> None:
        """The verifier scores no draft tree: no round_shape gives one again (the rounds of
        every request that shares this policy's costs)."""

    def restarts_fresh(self) -> bool:
        """Whether a pipelined round without candidates (the first, or one after a
        rejection) runs the target alone beside a fresh draft of K + 1 (True), or drafts its
        K first and verifies them beside the next block's pre-draft (False)."""


class FixedK:
    """The same K every round (vLLM's num_speculative_tokens), and the same
    draft_confidence (None: the pool's own)."""

    def __init__(self, num_speculative_tokens: int, confidence: float | None = None) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.k, self.confidence = num_speculative_tokens, confidence

    def num_speculative_tokens(self) -> int:
        return self.k

    def update(self, num_drafted: int, num_accepted: int, cost: RoundCost | None = None) -> None:
        pass

    def draft_confidence(self) -> float | None:
        return self.confidence

    def observe_confidences(self, confidences, num_accepted: int) -> None:
        pass

    def round_shape(self, free: bool) -> tuple[int, int] | None:
        return None

    def refuse_trees(self) -> None:
        pass

    def restarts_fresh(self) -> bool:
        return True

"""How many tokens to draft next round (the K policy)."""

from typing import Protocol


class KPolicy(Protocol):
    def num_speculative_tokens(self) -> int: ...

    def update(self, num_drafted: int, num_accepted: int) -> None: ...


class FixedK:
    """The same K every round (vLLM's num_speculative_tokens)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.k = num_speculative_tokens

    def num_speculative_tokens(self) -> int:
        return self.k

    def update(self, num_drafted: int, num_accepted: int) -> None:
        pass

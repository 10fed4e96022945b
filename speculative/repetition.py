"""vLLM's repetition_detection: an output ends (finish_reason "repetition", stop_reason
"repetition_detected") once its tail is one pattern of ids repeated min_count times in a row.

As vLLM's scheduler checks it (vllm.v1.core.sched.utils.check_stop): on the output's ids
alone, after each token is appended, once the output holds min_tokens tokens, and only where
neither a stop id nor the length ended it at that token; under speculation the router checks
each committed token in turn (speculative.state.RequestState.commit), so a round that
accepts several ids ends at the first that completes a pattern, as a plain decode would.
"""

from collections.abc import Sequence
from dataclasses import dataclass

REPETITION_DETECTED = "repetition_detected"  # the stop_reason of an output it ended
# vLLM bounds none; each committed token scans up to this many ids for a candidate size
MAX_PATTERN_SIZE = 1024


@dataclass(frozen=True)
class RepetitionDetection:
    """Patterns of min_pattern_size (0: 1) to max_pattern_size ids, repeated min_count
    times; max_pattern_size 0 detects nothing (the request's field is then dropped)."""

    max_pattern_size: int
    min_pattern_size: int
    min_count: int

    def __post_init__(self) -> None:
        for value in (self.max_pattern_size, self.min_pattern_size, self.min_count):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError("repetition_detection takes integers")
        error = repetition_error(self.max_pattern_size, self.min_pattern_size, self.min_count)
        if error is not None:
            raise ValueError(error)
        if self.max_pattern_size > MAX_PATTERN_SIZE:
            raise ValueError(f"max_pattern_size is at most {MAX_PATTERN_SIZE} here, got "
                             f"{self.max_pattern_size}")

    def repeats(self, token_ids: Sequence[int], length: int) -> bool:
        """Whether the last `length` ids of token_ids (the output so far, at the end of the
        committed ids) end in one pattern of a size in bounds, min_count times in a row:
        each of the min_count - 1 blocks of that size before the last one is the last one
        (vLLM's _has_repeating_pattern)."""
        largest = min(self.max_pattern_size, length // self.min_count)
        smallest = max(self.min_pattern_size, 1)
        if largest < smallest:
            return False
        end, last = len(token_ids), token_ids[-1]
        # back[i]: the id i + 1 before the last; a size can repeat only where it is the last
        back = token_ids[end - 1 - largest : end - 1][::-1]
        at = smallest - 1
        while True:
            try:
                at = back.index(last, at)
            except ValueError:
                return False
            size = at + 1
            pattern = token_ids[end - size :]
            if all(token_ids[end - size * (m + 1) : end - size * m] == pattern
                   for m in range(1, self.min_count)):
                return True
            at += 1


def repetition_error(max_pattern_size: int, min_pattern_size: int, min_count: int
                     ) -> str | None:
    """vLLM's refusal of the three values (its RepetitionDetectionParams'), or None."""
    if max_pattern_size < 0 or min_pattern_size < 0 or min_pattern_size > max_pattern_size:
        return ("max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
                "max_pattern_size. Set both to 0 to disable repetitive pattern detection.")
    if max_pattern_size > 0 and min_count < 2:
        return ("min_count must be >= 2 to detect repetitive patterns in engine output. If "
                "you do not wish to detect repetitive patterns, set max_pattern_size to 0.")
    return None

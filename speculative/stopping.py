"""Stop sequences: text-level stops, checked by whoever holds the tokenizer (router, CLI)."""

from collections.abc import Callable, Sequence


def find_stop(text: str, stop: Sequence[str]) -> int | None:
    """Index of the earliest stop string in text, or None."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


def truncate_at_stop(
    token_ids: Sequence[int], decode: Callable[[Sequence[int]], str], stop: Sequence[str]
) -> tuple[str, list[int]] | None:
    """(text before the earliest stop string, the ids up to the token that completed it),
    or None when no stop string occurs. The stop string itself is not returned (OpenAI API)."""
    text = decode(token_ids)
    cut = find_stop(text, stop)
    if cut is None:
        return None
    n = next(n for n in range(1, len(token_ids) + 1)
             if find_stop(decode(token_ids[:n]), stop) is not None)
    return text[:cut], list(token_ids[:n])


class TextStream:
    """Incremental detokenization with stop strings, for streaming.

    update() returns the text that is final: it holds back a trailing incomplete character
    and any tail that could still grow into a stop string, so the concatenated deltas equal
    the non-streamed text exactly.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str]) -> None:
        self.decode, self.stop = decode, tuple(stop)
        self.sent = ""
        self.stopped = False
        self._text = ""

    def update(self, token_ids: Sequence[int]) -> str:
        text = self.decode(token_ids)
        cut = find_stop(text, self.stop)
        if cut is not None:
            self.stopped, text = True, text[:cut]
        self._text = text
        if self.stopped:
            return self._take(text)
        end = len(text.rstrip("\ufffd"))
        # a tail of the text that is a prefix of a stop string may still become one
        hold = max((n for s in self.stop for n in range(1, min(len(s), end + 1))
                    if text[end - n : end] == s[:n]), default=0)
        return self._take(text[: end - hold])

    def finish(self) -> str:
        """Everything not yet returned (at the end of the request)."""
        return self._take(self._text)

    def _take(self, text: str) -> str:
        if not text.startswith(self.sent):  # decoding changed earlier text: resend nothing
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

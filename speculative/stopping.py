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

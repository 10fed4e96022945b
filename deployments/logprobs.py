"""Logprobs in OpenAI's two shapes: the completions API's parallel lists and the chat API's
per-token entries. Each token's text is its own decoding (special tokens decode to "")."""

from collections.abc import Callable

from speculative.driver import Decode
from speculative.types import TokenLogprob

TokenBytes = Callable[[int], bytes | None]  # a token id -> its own bytes (None: its text's)


def token_bytes_of(ll_tokenizer) -> TokenBytes | None:
    """Each token's own bytes, read from llguidance's view of the tokenizer (byte-level BPE
    and SentencePiece byte fallback alike), or None without one. A token that holds part of
    a UTF-8 character decodes to U+FFFD, but its bytes are its part (as OpenAI's `bytes`:
    joined, a character's tokens give the character). A special token's (llguidance marks
    them, and ids the tokenizer lacks): None, its text's bytes."""
    if ll_tokenizer is None:
        return None
    return lambda token_id: None if ll_tokenizer.is_special_token(token_id) else \
        ll_tokenizer.decode_bytes([token_id])


def completion_logprobs(entries: list[TokenLogprob], decode: Decode, start: int = 0) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset}; offsets count characters from
    the start of the completion's text (`start`: the first entry's, in a stream)."""
    tokens = [decode([entry.token_id]) for entry in entries]
    offsets, offset = [], start
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens,
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [top_dict(entry, decode) for entry in entries],
            "text_offset": offsets}


def top_dict(entry: TokenLogprob, decode: Decode) -> dict[str, float]:
    """The position's top n and the chosen token, as the completions API returns them
    (OpenAI: up to logprobs + 1 entries; vLLM), as {token text: logprob} (two ids with one
    text keep the more likely, as a dict must)."""
    top: dict[str, float] = {}
    for token_id, logprob in (*entry.top, (entry.token_id, entry.logprob)):
        top.setdefault(decode([token_id]), logprob)
    return top


def chat_logprobs(entries: list[TokenLogprob], decode: Decode,
                  token_bytes: TokenBytes | None = None) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]};
    bytes: the token's own (token_bytes), else its text's."""
    def item(token_id: int, logprob: float) -> dict:
        text = decode([token_id])
        raw = token_bytes(token_id) if token_bytes else None
        return {"token": text, "logprob": logprob,
                "bytes": list(text.encode("utf-8") if raw is None else raw)}

    return {"content": [{**item(entry.token_id, entry.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in entry.top]}
                        for entry in entries]}

"""Logprobs in OpenAI's two shapes: the completions API's parallel lists and the chat API's
per-token entries. Each token's text is its own decoding (special tokens decode to "")."""

from speculative.driver import Decode
from speculative.types import TokenLogprob


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


def chat_logprobs(entries: list[TokenLogprob], decode: Decode) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def item(token_id: int, logprob: float) -> dict:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(entry.token_id, entry.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in entry.top]}
                        for entry in entries]}

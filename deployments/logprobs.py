"""Logprobs in OpenAI's two shapes: the completions API's parallel lists and the chat API's
per-token entries. Each token's text is the text it adds to the output where it stands
(`TokenTexts`), so that a completion's tokens join into its text and its offsets point into
it (special tokens add "")."""

from collections.abc import Callable, Sequence

from speculative.driver import Decode, Detokenizer, Generation
from speculative.types import TokenLogprob

TokenBytes = Callable[[int], bytes | None]  # a token id -> its own bytes (None: its text's)

# the least logprob an answer shows, as vLLM's: a model whose raw logits hold -inf (a masked
# token) would otherwise give -inf, which JSON cannot carry (a 500 for the whole answer)
LEAST_LOGPROB = -9999.0


def shown(logprob: float) -> float:
    """The logprob, floored at LEAST_LOGPROB; NaN too (a greedy row whose logits hold NaN or
    +inf is served, its argmax the target's: verifier.engine), which max() let through: a
    whole answer's encoding failed (a 500), a stream's chunk carried NaN, which is no JSON."""
    return logprob if logprob >= LEAST_LOGPROB else LEAST_LOGPROB


def token_bytes_of(ll_tokenizer) -> TokenBytes | None:
    """Each token's own bytes, read from llguidance's view of the tokenizer (byte-level BPE
    and SentencePiece byte fallback alike), or None without one. A token that holds part of
    a UTF-8 character adds no text, or the whole character, but its bytes are its part (as
    OpenAI's `bytes`: joined, a character's tokens give the character). A special token's
    (llguidance marks them, and ids the tokenizer lacks): None, its text's bytes."""
    if ll_tokenizer is None:
        return None
    return lambda token_id: None if ll_tokenizer.is_special_token(token_id) else \
        ll_tokenizer.decode_bytes([token_id])


class TokenTexts:
    """The texts of a choice's logprob positions, read in order: at each, the text its chosen
    token adds to the output and the text each top token would have added there, as the
    choice's own text is detokenized (speculative.driver.Detokenizer, from the same prompt).
    A token decoded alone says otherwise under SentencePiece (its leading space dropped) and
    where a character spans tokens (a U+FFFD each): offsets counted from those drift off the
    text. Here a character's last token carries it, the tokens before it ""."""

    def __init__(self, decode: Decode, context_ids: Sequence[int] = ()) -> None:
        self.detokenizer = Detokenizer(decode, context_ids)

    def position(self, entry: TokenLogprob) -> dict[int, str]:
        """{token id: text} of the entry's top tokens and its chosen one, which it reads."""
        texts = {token_id: self.detokenizer.peek(token_id) for token_id, _ in entry.top}
        texts[entry.token_id] = self.detokenizer.add(entry.token_id)
        return texts

    def positions(self, entries: list[TokenLogprob], end: bool = False) -> list[dict[int, str]]:
        """position() of each entry; end: they are the output's last, so the last one's text
        takes what the detokenizer still holds (an incomplete character's U+FFFD), as the
        output's text does at its end (Generation.stream): the tokens join into the text."""
        read = [self.position(entry) for entry in entries]
        if end and read:
            read[-1][entries[-1].token_id] += self.detokenizer.flush()
        return read


def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, start: int = 0,
                        end: bool = False) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset}; offsets count characters from
    the start of the completion's text (`start`: the first entry's, in a stream); end: the
    output's last entries (TokenTexts.positions)."""
    positions = texts.positions(entries, end)
    tokens = [position[entry.token_id] for entry, position in zip(entries, positions)]
    offsets, offset = [], start
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens,
            "token_logprobs": [shown(entry.logprob) for entry in entries],
            "top_logprobs": [top_dict(entry, position)
                             for entry, position in zip(entries, positions)],
            "text_offset": offsets}


def top_dict(entry: TokenLogprob, texts: dict[int, str]) -> dict[str, float]:
    """The position's top n and the chosen token, as the completions API returns them
    (OpenAI: up to logprobs + 1 entries; vLLM), as {token text: logprob} (two ids with one
    text keep the more likely, as a dict must)."""
    top: dict[str, float] = {}
    for token_id, logprob in (*entry.top, (entry.token_id, entry.logprob)):
        top.setdefault(texts[token_id], shown(logprob))
    return top


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts,
                  token_bytes: TokenBytes | None = None, end: bool = False) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]};
    bytes: the token's own (token_bytes), else its text's; end: as completion_logprobs'."""
    def item(token_id: int, logprob: float, text: str) -> dict:
        raw = token_bytes(token_id) if token_bytes else None
        return {"token": text, "logprob": shown(logprob),
                "bytes": list(text.encode("utf-8") if raw is None else raw)}

    content = []
    for entry, position in zip(entries, texts.positions(entries, end)):
        content.append({**item(entry.token_id, entry.logprob, position[entry.token_id]),
                        "top_logprobs": [item(t, lp, position[t]) for t, lp in entry.top]})
    return {"content": content}


def id_name(token_id: int) -> str:
    """A token named by its id (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}"


def named_by_id(shaped: dict, entries: list[TokenLogprob], chat: bool) -> dict:
    """Logprobs in either shape with each token named "token_id:<id>" (vLLM's
    return_tokens_as_token_ids), a completion's top_logprobs keyed so too (two ids of one
    text no longer share a key); the texts' offsets and the tokens' bytes stay theirs."""
    if chat:
        for item, entry in zip(shaped["content"], entries):
            item["token"] = id_name(entry.token_id)
            for top, (token_id, _) in zip(item["top_logprobs"], entry.top):
                top["token"] = id_name(token_id)
        return shaped
    shaped["tokens"] = [id_name(entry.token_id) for entry in entries]
    shaped["top_logprobs"] = [top_dict(entry, {token_id: id_name(token_id) for token_id, _ in
                                               (*entry.top, (entry.token_id, 0))})
                              for entry in entries]
    return shaped


class ChoiceLogprobs:
    """The logprobs of a request's choices in their API's shape, whole or a stream's chunk
    at a time: deployments.choices.Choices' (a base of it), which holds what is read here:
    plan, decode, chat, token_bytes (chat logprobs' bytes) and tokens_as_ids (tokens named
    by id, vLLM's option)."""

    def streamed_logprobs(self, index: int, offset: int = 0):
        """None without logprobs; else (generation, last=False) -> the logprobs of the choice's
        tokens not yet sent, in its API's shape (a completion's text offsets running on
        across chunks from `offset`; the last chunk's None when nothing is left)."""
        request = self.plan.choices[index].request
        if request.sampling.logprobs is None:
            return None
        sent = 0
        texts = TokenTexts(self.decode, request.prompt_token_ids)  # read across the chunks

        def since(generation: Generation, last: bool = False) -> dict | None:
            nonlocal sent, offset
            entries = generation.state.logprobs[sent:]
            sent += len(entries)
            if last and not entries:
                return None
            shaped = self.shaped_logprobs(entries, texts, offset, generation.ends_held_text)
            if not self.chat:
                offset += sum(len(token) for token in shaped["tokens"])
            return self.named(shaped, entries)

        return since

    def logprobs(self, generation: Generation) -> dict | None:
        """The choice's logprobs in its API's shape, when the request asked for them."""
        if generation.state.request.sampling.logprobs is None:
            return None
        texts = TokenTexts(self.decode, generation.state.request.prompt_token_ids)
        return self.named(self.shaped_logprobs(generation.state.logprobs, texts,
                                               end=generation.ends_held_text),
                          generation.state.logprobs)

    def named(self, shaped: dict, entries: list) -> dict:
        """Logprobs with their tokens named by id when the request asked (its texts'
        offsets counted before: named_by_id)."""
        return named_by_id(shaped, entries, self.chat) if self.tokens_as_ids else shaped

    def shaped_logprobs(self, entries: list, texts: TokenTexts, offset: int = 0,
                        end: bool = False) -> dict:
        """Entries in this API's shape (a completion's text offsets from `offset`), their
        texts read on from the last entries `texts` read; end: the output's last entries
        (TokenTexts.positions)."""
        if self.chat:
            return chat_logprobs(entries, texts, self.token_bytes, end)
        return completion_logprobs(entries, texts, offset, end)

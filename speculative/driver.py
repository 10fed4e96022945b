"""The one request driver: prompt ids in; text, output ids and the finish reason out.

The CLI, the router, the benchmark and the tests run every request through `Generation`, so the
front ends cannot disagree on where a request stops or what text it returns. It drives the
round loop and applies the stopping rules in the order the tokens were committed: stop token
ids (the loop's, the token stays in the output), stop strings (the text is cut before the stop
string and the output ids after the token that completed it, as vLLM does) and max_tokens.
"""

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from speculative.fixed_k import KPolicy
from speculative.loop import run_rounds
from speculative.repetition import REPETITION_DETECTED
from speculative.state import Request, RequestState
from speculative.types import Drafter, Verifier

Decode = Callable[[Sequence[int]], str]  # token ids -> text (special tokens skipped, as asked)

# prompt tokens the detokenizer decodes before the first output token, so that the first
# token's text is what it reads as a continuation (a SentencePiece leading space, say)
CONTEXT_TOKENS = 6
# how far back from a context's end its window may end: past the context's trailing U+FFFDs
CONTEXT_SEARCH = 4 * CONTEXT_TOKENS
# a UTF-8 character has at most 4 bytes, each token at least one: text still ending in U+FFFD
# after this many tokens held is no incomplete character but bytes that never form one
MAX_HELD_TOKENS = 8
CHARACTER_TOKENS = 3  # the tokens an incomplete character's bytes can span (4 bytes at most)
# tokens that each end inside a character are held whole up to this many (then their decodes
# would grow with every token)
HELD_RUN_TOKENS = 32
REPLACEMENT = "\ufffd"  # what a decode makes of bytes that form no (complete) character


def text_decoder(tokenizer, keep: tuple[str, ...] = (),
                 skip_special: bool = True) -> Decode:
    """The tokenizer's decode, special tokens skipped but those whose text is in `keep` (a
    tool call's tags, which some checkpoints register as special, while a request's tools
    are read out of its text), or none skipped (skip_special false). A fast tokenizer that
    cleans up no spaces decodes through its Rust backend directly: the same text, without
    transformers' argument handling around it (the detokenizer on the demo tokenizer: 8.0 ->
    3.3 us a token, two decodes each)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = backend if backend is not None and \
        getattr(tokenizer, "clean_up_tokenization_spaces", None) is False else tokenizer

    def decode(ids: Sequence[int]) -> str:
        return decoder.decode(ids, skip_special_tokens=skip_special)

    special = {token_id: token.content for token_id, token in
               (getattr(tokenizer, "added_tokens_decoder", None) or {}).items() if token.special}
    if not skip_special or not set(special.values()) & set(keep):
        return decode
    # the other special tokens dropped, the rest decoded as one text (decoded in pieces, a
    # SentencePiece tokenizer dropped the leading space of the text after each kept tag)
    skipped = frozenset(token_id for token_id, text in special.items() if text not in keep)

    def keeping(ids: Sequence[int]) -> str:
        return decoder.decode([i for i in ids if i not in skipped], skip_special_tokens=False)

    return keeping


def context_window(decode: Decode, context_ids: Sequence[int]) -> list[int]:
    """The last CONTEXT_TOKENS of the context's ids that start and end on a character.

    A window that starts inside a character decodes to U+FFFD there, and under
    SentencePiece's byte fallback so does its whole run of byte tokens, the output's bytes
    that continue the run included: the window starts after such bytes. One that ends
    inside a character (a prompt of token ids may: a cut-off output fed back) reads the
    output's bytes that complete it into the window's text, which then differs from the one
    its offset was taken from (under byte fallback a U+FFFD per byte became one character:
    the output's next characters were lost): the window ends before such bytes, which the
    output's then read as no character. Its tokens are those before the context's trailing
    U+FFFDs, real ones too (a decode cannot tell them apart), up to CONTEXT_SEARCH tokens
    back: trimmed within the last CONTEXT_TOKENS, a prompt that ended in two real U+FFFD
    byte-fallback characters left no window, and the output's first token lost its
    SentencePiece leading space (a stop string that began with it was found tokens late)."""
    for end in range(len(context_ids), max(0, len(context_ids) - CONTEXT_SEARCH), -1):
        context = list(context_ids[max(0, end - CONTEXT_TOKENS) : end])
        while context and decode(context).startswith(REPLACEMENT):
            del context[0]
        if context and not decode(context).endswith(REPLACEMENT):
            return context
    return []


class Detokenizer:
    """Offset-based incremental detokenization (as in vLLM and TGI).

    A token's text is decode(window + token) minus decode(window), the window being the few
    tokens before it. Decoding a short window costs the same at every step, never drops text
    when a tokenizer's decode of a longer sequence rewrites earlier text, and holds back a
    trailing U+FFFD (an incomplete UTF-8 character) until the bytes that complete it arrive;
    the text before it goes out at once (a stop string there ends the output at its own
    token). Bytes that form no character go out as U+FFFDs after MAX_HELD_TOKENS tokens, so
    the decodes stay short.
    """

    def __init__(self, decode: Decode, context_ids: Sequence[int] = ()) -> None:
        self.decode = decode
        self.ids = context_window(decode, context_ids)  # the window, then tokens not yet read
        self.window = len(self.ids)
        self.sent = 0  # characters of the unread tokens' text already returned
        self._window, self._prefix = None, ""  # the window's ids and text, last decoded

    def add(self, token_id: int) -> str:
        """The text that token_id adds (possibly "" while a character is incomplete)."""
        self.ids.append(token_id)
        text = self._unread()
        if text and not text.endswith(REPLACEMENT):
            return self._read(len(self.ids), text)
        delta = ""
        if len(self.ids) - self.window >= MAX_HELD_TOKENS:
            delta, text = self._read_held(text)
        final = text.rstrip(REPLACEMENT)  # what precedes the incomplete character
        delta += final[self.sent :]
        self.sent = max(self.sent, len(final))
        return delta

    def peek(self, token_id: int) -> str:
        """What add(token_id) would return, the state left as it is (the text of a token the
        output could have had in its place)."""
        ids, window, sent = list(self.ids), self.window, self.sent
        try:
            return self.add(token_id)
        finally:
            self.ids, self.window, self.sent = ids, window, sent

    def flush(self) -> str:
        """Text still held back at the end of a request (an incomplete character)."""
        return self._read(len(self.ids), self._unread())

    def _read_held(self, text: str) -> tuple[str, str]:
        """Bytes that form no character: read the held tokens up to the last cut that leaves
        their text (`text`) as it is; returns (what that reads, the text after the cut).
        The cut leaves CHARACTER_TOKENS tokens, 3 bytes or more, so that a character begun
        before it is complete or broken: complete, the cut would change the text. Tokens
        that each end inside a character (a byte-level token may hold the end of one and
        the start of the next) leave no such cut; past HELD_RUN_TOKENS they are cut anyway."""
        last = len(self.ids) - CHARACTER_TOKENS
        if len(self.ids) - self.window < HELD_RUN_TOKENS:
            for end in range(last, self.window, -1):
                head = self._unread(end)
                if text.startswith(head):
                    return self._read(end, head), text[len(head) :]
            return "", text
        return self._read(last, self._unread(last)), self._unread()

    def _read(self, end: int, text: str) -> str:
        """Move the window to ids[:end], `text` being their text after the old window; returns
        what of it was not yet sent."""
        delta = text[self.sent :]
        self.sent = max(0, self.sent - len(text))
        del self.ids[: self.window]
        self.window = end - self.window
        return delta

    def _unread(self, end: int | None = None) -> str:
        window = tuple(self.ids[: self.window])
        if window != self._window:  # decoded once while tokens are held or peeked at
            self._window, self._prefix = window, self.decode(self.ids[: self.window])
        text = self.decode(self.ids[:end])
        return text[len(self._prefix) :] if len(text) > len(self._prefix) else ""


# the characters an output's text keeps in one string at its end (GrowingText): room for the
# longest stop string (256) and a round's text beyond it
TAIL_CHARS = 4096


class GrowingText:
    """An output's text, grown a token's text at a time and read near its end (where a stop
    string can end, what can go out). A str grown by += is copied whole at every token: 1.3
    s of the event loop over a 128k-token output. Here the last TAIL_CHARS or more
    characters are one string and the rest pieces of TAIL_CHARS or more, so that reading
    text[start:] costs what it reads and a piece, and the whole is joined once, at the end."""

    def __init__(self) -> None:
        self.pieces: list[str] = []  # the text before the tail
        self.before = 0  # their characters
        self.tail = ""

    def __len__(self) -> int:
        return self.before + len(self.tail)

    def __str__(self) -> str:
        return "".join(self.pieces) + self.tail

    def append(self, delta: str) -> None:
        self.tail += delta
        if len(self.tail) > 2 * TAIL_CHARS:  # each character moves out once
            cut = len(self.tail) - TAIL_CHARS
            self.pieces.append(self.tail[:cut])
            self.before, self.tail = self.before + cut, self.tail[cut:]

    def since(self, start: int) -> str:
        """text[start:]"""
        start, at, first = max(0, start), len(self.pieces), self.before
        while first > start:  # back to the piece that holds start (a round's text: seldom)
            at -= 1
            first -= len(self.pieces[at])
        return ("".join(self.pieces[at:]) + self.tail)[start - first :]

    def cut(self, end: int) -> None:
        """Keep text[:end] (a stop string's cut: once, near the end)."""
        if end < self.before:
            self.tail, self.pieces, self.before = str(self)[:end], [], 0
        else:
            self.tail = self.tail[: end - self.before]


def find_stop(text: str, stop: Sequence[str], new_from: int = 0) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string that ends in text[new_from:] (each
    searched from where it could first overlap that new text, as vLLM does), or None."""
    hits = [(i, s) for s in stop if (i := text.find(s, max(0, new_from - len(s) + 1))) >= 0]
    return min(hits) if hits else None


class Generation:
    """One request from prompt ids to its output: rounds, stopping rules, incremental text.

    `stream()` yields text deltas that are final (a tail that could still grow into a stop
    string is held back), so the deltas concatenate to `text`; afterwards `token_ids`,
    `finish_reason` ("stop" or "length") and `stop_reason` describe the output. As in vLLM,
    stop_reason is the stop string or the stop token id that ended it, None at max_tokens
    and at the model's own end tokens (those not in `reported_stop_ids`; None: every stop id
    is reported), and a stop token's text is not part of `text`, nor a stop string, unless the
    request includes them (include_stop_str_in_output: the text then ends with it). Without
    a decode function it produces ids only.
    """

    def __init__(self, request: Request, decode: Decode | None = None,
                 reported_stop_ids: Sequence[int] | None = None) -> None:
        self.state = RequestState(request)
        self.reported_stop_ids = reported_stop_ids
        self.stop = request.sampling.stop
        self._longest_stop = max(map(len, self.stop), default=0)  # how far back one can start
        self.include_stop = request.sampling.include_stop_str_in_output
        if self.stop and decode is None:
            raise ValueError("stop strings need a tokenizer to decode with")
        self.detokenizer = Detokenizer(decode, request.prompt_token_ids) if decode else None
        self._text = GrowingText()
        self.stop_reason: int | str | None = None
        self._sent = 0  # characters of text already yielded

    @property
    def text(self) -> str:
        return str(self._text)

    @property
    def token_ids(self) -> list[int]:
        return self.state.output_token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.state.finish_reason

    @property
    def stats(self):
        return self.state.stats

    @property
    def ends_held_text(self) -> bool:
        """Whether the text has ended, with what the detokenizer held (an incomplete
        character's U+FFFD): not while it runs, nor when a stop string, which the text is
        cut at, ended it."""
        return self.finish_reason is not None and not (
            self.finish_reason == "stop" and self.stop_reason in self.stop)

    async def stream(self, drafter: Drafter, verifier: Verifier, policy: KPolicy,
                     pipelined: bool = False) -> AsyncIterator[str]:
        """Text deltas as rounds commit; pipelined: draft the next block during each verify."""
        if self.finish_reason is None:  # else max_tokens 0: no round, no pool called
            rounds = run_rounds(self.state, drafter, verifier, policy, pipelined)
            async with contextlib.aclosing(rounds):  # an early stop releases the pools at once
                async for added in rounds:
                    self._take(added)
                    if delta := self._ready():
                        yield delta
                    if self.finish_reason is not None:
                        break
        if self.detokenizer is not None and self.ends_held_text:
            self._text.append(self.detokenizer.flush())
        if tail := self._text.since(self._sent):
            self._sent = len(self._text)
            yield tail

    async def run(self, drafter: Drafter, verifier: Verifier, policy: KPolicy,
                  pipelined: bool = False) -> "Generation":
        async for _ in self.stream(drafter, verifier, policy, pipelined):
            pass
        return self

    def settle(self, token_ids: Sequence[int], logprobs: list, finish_reason: str,
               stop_reason: int | None, shown: int) -> "Generation":
        """Take an output searched elsewhere (a beam search's: speculative.beams): its ids,
        their logprobs and how it ended; its text read from its first `shown` ids (an end
        token left out, as the text of a stop id is)."""
        self.state.committed.extend(token_ids)
        self.state.logprobs.extend(logprobs)
        self.state.finish_reason, self.stop_reason = finish_reason, stop_reason
        if self.detokenizer is not None:
            for token in token_ids[:shown]:
                self._text.append(self.detokenizer.add(token))
            self._text.append(self.detokenizer.flush())
        return self

    def _take(self, added: list[int]) -> None:
        """Detokenize a round's committed tokens one by one, stopping at a stop string (once
        the output holds more than min_tokens tokens)."""
        stop_ids, reported = self.state.request.stop_token_ids, self.reported_stop_ids
        at_stop_id = self.finish_reason == "stop" and added and added[-1] in stop_ids
        if at_stop_id and (reported is None or added[-1] in reported):
            self.stop_reason = added[-1]
        if self.finish_reason == "repetition":  # vLLM's; a stop string in `added` overrides
            self.stop_reason = REPETITION_DETECTED
        if self.detokenizer is None:
            return
        first_output = self.state.num_output_tokens - len(added)
        # no stop string until the output holds more than min_tokens tokens (as vLLM's V1)
        min_tokens = self.state.request.sampling.min_tokens
        read = added[:-1] if at_stop_id and not self.include_stop else added
        for offset, token in enumerate(read):
            delta = self.detokenizer.add(token)
            new_from = len(self._text)
            self._text.append(delta)
            checked = delta and self.stop and first_output + offset + 1 > min_tokens
            hit = self._find_stop(new_from) if checked else None
            if hit is not None:
                self._text.cut(hit[0] + (len(hit[1]) if self.include_stop else 0))
                self.state.stop_after(first_output + offset + 1)
                self.stop_reason = hit[1]
                return

    def _find_stop(self, new_from: int) -> tuple[int, str] | None:
        """find_stop over the end of the text, where a stop string that ends after new_from
        starts."""
        start = max(0, new_from - self._longest_stop + 1)
        hit = find_stop(self._text.since(start), self.stop, new_from - start)
        return None if hit is None else (start + hit[0], hit[1])

    def _ready(self) -> str:
        """Text not yet yielded that no stop string can still claim."""
        end = len(self._text)
        if self.finish_reason is None and self.stop and not self.include_stop:
            # a tail that is a prefix of a stop string may still become one (and be cut)
            tail = self._text.since(end - self._longest_stop)
            end -= max((n for s in self.stop for n in range(1, min(len(s), end + 1))
                        if tail.endswith(s[:n])), default=0)
        delta = self._text.since(self._sent)[: max(0, end - self._sent)]
        self._sent = max(self._sent, end)
        return delta

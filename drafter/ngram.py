"""Prompt-lookup drafting: propose what followed the latest n-gram earlier in the context.

A continuation that runs into the end of the context (the n-gram recurs within K tokens: a
loop, a run of one token) goes on repeating itself up to K tokens, as the context would if
the repeat held: the latest match of a loop of period d otherwise proposed d tokens a round
(one for a run), where vLLM's proposer, which takes the earliest occurrence, proposes K.

No model, no KV cache: the draft distribution of each proposed token is one-hot, so the
rejection sampler accepts x with probability p(x) and otherwise resamples from p without x,
which keeps the output exactly the target's.

A request's committed ids are kept as 4-byte machine ints in its session (`TokenBytes`, grown
as they commit), and the search for an n-gram is `bytearray.rfind` over them, in C: a scan
of list slices in Python took 4.5-14 ms a round at 16k tokens of context, the byte search
0.07-0.14 ms (three measurements on 2-core VMs, 2026-11-28/29). `lookup` is the plain
reference the tests hold it to.

A request's predicted output (OpenAI's `prediction`: text the answer is expected to repeat,
such as a file being edited) is searched first, at each n-gram length, then the context:
in it, the occurrence nearest at or after where the request's previous match in it went on
(`TokenBytes.cursor`: an edited answer walks through its prediction in order), else the
nearest before; the proposal is what follows there, up to K ids, never past its end. Before
the output's first token the proposal is the prediction's first K ids (it is an output).
Where the output has just replaced predicted ids in place (a name or a number edited), the
proposal goes on after them at once (`TokenBytes.realigned`), where an n-gram would find
the place again only n ids later. Measured (docs/benchmarks.md, predicted outputs): the
target's tokens per forward at K = 4 up 15 % with 10 % of the ids replaced, 2.5 % with edits
of 1-3 ids replaced, inserted or deleted alike, in sequential rounds; in pipelined rounds
(the router's default), whose rounds after a rejection verify one token, +4 % and -4 %.
"""

from array import array

import torch

from engine.kv import SessionStore
from speculative.checks import check_call, check_confidence, check_prompt_len, check_tree_width
from speculative.token_masks import matcher_after
from speculative.shaping import unmasked_prefix
from speculative.types import DraftBlock, DraftDists, ProposeCall, StaleBase, timed


def lookup(token_ids: list[int], num_tokens: int, min_ngram: int, max_ngram: int) -> list[int]:
    """num_tokens ids that followed the most recent earlier occurrence of the longest suffix
    n-gram (n from max_ngram down to min_ngram), repeated where they reach the context's end
    (`repeated`); [] when nothing matches."""
    for n in range(min(max_ngram, len(token_ids) - 1), min_ngram - 1, -1):
        suffix = token_ids[-n:]
        for start in range(len(token_ids) - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                return repeated(token_ids[start + n : start + n + num_tokens], num_tokens)
    return []


def repeated(following: list[int], num_tokens: int) -> list[int]:
    """The num_tokens that follow a match: its continuation, and where that reaches the end
    of the context (d tokens after the match), those d again and again (the context's last
    n tokens are the match's, so it goes on as it did d tokens back)."""
    if len(following) >= num_tokens or not following:
        return following
    return (following * (num_tokens // len(following) + 1))[:num_tokens]


def aligned_find(data, sub: bytes, start: int, end: int) -> int:
    """data.find(sub, start, end) at a 4-byte boundary (a token's), else -1."""
    while (at := data.find(sub, start, end)) >= 0:
        if at % 4 == 0:
            return at
        start = at + 4 - at % 4
    return -1


def aligned_rfind(data, sub: bytes, start: int, end: int) -> int:
    """data.rfind(sub, start, end) at a 4-byte boundary (a token's), else -1."""
    while (at := data.rfind(sub, start, end)) >= 0:
        if at % 4 == 0:
            return at
        end = at + len(sub) - 1  # the occurrences that start before this one
    return -1


class TokenBytes:
    """A request's committed ids as native 4-byte ints (its session's `drafter_state`),
    extended as they commit; dropped with the session or on a full-prefix rebuild. With a
    predicted output, its ids too, and where the last match in them went on (`cursor`)."""

    most_guesses = 2  # realigned proposals in a row refused whole (an edit of 2 ids)

    def __init__(self) -> None:
        self.data = bytearray()  # 4 bytes a committed id
        self.prediction_ids: tuple[int, ...] = ()
        self.prediction = b""  # 4 bytes a predicted id
        self.cursor = 0  # the predicted ids' index after the last match in them...
        self.anchor: int | None = None  # ...the context's length then (the output's index)
        self.guesses = 0  # realigned proposals in a row that nothing of was accepted

    def predicting(self, prediction_ids: tuple[int, ...]) -> "TokenBytes":
        """The request's predicted output (the same tuple every call: converted once)."""
        if prediction_ids is not self.prediction_ids:
            self.prediction_ids = prediction_ids
            self.prediction = array("i", prediction_ids).tobytes()
        return self

    def extended(self, committed: list[int]) -> "TokenBytes":
        held = len(self.data) // 4
        if len(committed) > held:
            self.data += array("i", committed[held:]).tobytes()
        return self

    def close(self, committed: list[int]) -> None:
        pass  # nothing outlives the request

    def lookup(self, assumed: list[int], num_tokens: int, min_ngram: int,
               max_ngram: int, context: list[int]) -> list[int]:
        """`lookup(context, ...)` where context is the committed ids then `assumed`; with
        a predicted output, each n-gram looked up in it first (`predicted`)."""
        data, tail = self.data, array("i", assumed).tobytes()
        data += tail  # searched in place, taken off again below
        try:
            for n in range(min(max_ngram, len(context)), min_ngram - 1, -1):
                suffix = bytes(data[-4 * n:])
                if self.prediction and (found := self.predicted(
                        suffix, n, num_tokens, context, n == min_ngram, bool(assumed))):
                    return found
                # a match ends before the last token: one follows it
                at = aligned_rfind(data, suffix, 0, len(data) - 4) if n < len(context) else -1
                if at >= 0:
                    start = at // 4 + n
                    return repeated(context[start:start + num_tokens], num_tokens)
            return []
        finally:
            if tail:
                del data[-len(tail):]

    def predicted(self, suffix: bytes, n: int, num_tokens: int, context: list[int],
                  last: bool = False, assuming: bool = False) -> list[int]:
        """Up to num_tokens predicted ids after the n-gram's occurrence in the prediction
        that goes on nearest at or after the cursor, else nearest before it (the cursor
        then moves there); [] when no occurrence has an id after it. At the last n-gram
        length, an output that replaced predicted ids in place goes on after them
        (`realigned`) unless the occurrence lies at or before that place. A match after
        assumed ids (a pre-draft's: nothing of them accepted yet) keeps the guesses."""
        data, end = self.prediction, len(self.prediction) - 4
        at = aligned_find(data, suffix, 4 * max(0, self.cursor - n), end)
        if at < 0 and self.cursor > n:  # goes on before the cursor: ends by cursor - 1
            at = aligned_rfind(data, suffix, 0, min(4 * (self.cursor - 1), end))
        resumed = self.realigned(context) if last else None
        if resumed is not None and (at < 0 or at // 4 > resumed):
            self.cursor, self.anchor = resumed, len(context)
            self.guesses += 1
            return list(self.prediction_ids[resumed:resumed + num_tokens])
        if at < 0:
            return []
        self.cursor, self.anchor = at // 4 + n, len(context)
        self.guesses = self.guesses if assuming else 0
        return list(self.prediction_ids[self.cursor:self.cursor + num_tokens])

    def realigned(self, context: list[int]) -> int | None:
        """Where the output goes on in the prediction if the ids it wrote since the last
        proposal from it replaced as many predicted ones (an edit in place: a name or a
        number changed), when its last id is such a replacement and at most
        `most_guesses` such proposals in a row were refused whole; else None. (Prompt
        lookup alone finds the place again only once n ids after the edit match.) The
        context may end before the anchor: a pre-draft's assumed ids set it, and the round
        took fewer of them (in place, the output's index i is the prediction's i + cursor -
        anchor either way)."""
        if self.anchor is None:
            return None
        at = self.cursor + len(context) - self.anchor
        if not 0 < at < len(self.prediction_ids) or \
                context[-1] == self.prediction_ids[at - 1]:
            return None
        if len(context) > self.anchor and \
                context[self.anchor] == self.prediction_ids[self.cursor]:
            self.guesses = 0  # the last proposal was accepted in part: an edit ahead
        return at if self.guesses < self.most_guesses else None


class NgramDrafter:
    def __init__(
        self,
        vocab_size: int,
        *,
        min_ngram: int = 1,
        max_ngram: int = 4,
        max_cached_requests: int = 1024,
        max_cached_tokens: int | None = None,
        session_ttl_s: float | None = None,
        grammar_tokenizer=None,
    ) -> None:
        """grammar_tokenizer: llguidance's tokenizer, to drop the proposals a request's
        grammar forbids (without it, a request with a grammar gets no proposals)."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size = vocab_size
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.sessions = SessionStore(max_cached_requests, max_cached_tokens, session_ttl_s)
        self.grammar_tokenizer = grammar_tokenizer

    async def propose(self, call: ProposeCall) -> DraftBlock:
        return timed(self.propose_now, call)

    async def release(self, request_id: str) -> None:
        self.release_now(request_id)

    def release_now(self, request_id: str) -> None:
        self.sessions.release(request_id)

    def propose_batch(self, calls: list[ProposeCall]) -> list[DraftBlock | Exception]:
        """No model, nothing to share: each call on its own (refusals are its answer)."""
        results = []
        for call in calls:
            try:
                results.append(timed(self.propose_now, call))
            except (ValueError, StaleBase) as error:
                results.append(error)
        return results

    def propose_now(self, call: ProposeCall) -> DraftBlock:
        check_call(call.sync.new_token_ids + call.assumed_token_ids, self.vocab_size,
                   call.num_speculative_tokens)
        check_prompt_len(call.prompt_len, call.sync.committed_len)
        check_confidence(call.draft_confidence)  # checked, then unused: no draft law
        wants_tree = call.tree_width > 1 and not call.assumed_token_ids and \
            call.sampling.grammar is None  # else a chain
        if wants_tree:
            check_tree_width(call)  # before the session moves
        sequence = self.sessions.apply(call.request_id, call.sync)
        context = sequence.committed + list(call.assumed_token_ids)
        if wants_tree:
            tree = self.lookup_tree(call, sequence, context)
            if tree is not None:  # deterministic: verified by matching the target's draws
                return DraftBlock(tree[0], None, parents=tree[1])
        token_ids = self.lookup(call, sequence, context)
        if call.sampling.grammar is not None and token_ids:
            token_ids = self.allowed_prefix(call, sequence, context, token_ids)
        token_ids = unmasked_prefix(call.sampling, context, token_ids, call.prompt_len)
        if call.sampling.greedy or not token_ids:
            return DraftBlock(tuple(token_ids), None)
        one_hot = DraftDists(torch.ones(len(token_ids), 1),  # [K, 1]: each q_i is x_i alone
                             torch.tensor(token_ids)[:, None], self.vocab_size)
        return DraftBlock(tuple(token_ids), one_hot)

    def lookup(self, call: ProposeCall, sequence, context: list[int]) -> list[int]:
        """The proposal for the context (the committed tokens, then the call's assumed ones)."""
        if sequence.drafter_state is None:
            sequence.drafter_state = TokenBytes()
        prediction = call.prediction_token_ids
        state = sequence.drafter_state.extended(sequence.committed).predicting(prediction)
        if prediction and len(context) == call.prompt_len:  # no output yet: it starts there
            state.cursor, state.anchor = 0, len(context)  # (an edit at once: `realigned`)
            return list(prediction[:call.num_speculative_tokens])
        return state.lookup(list(call.assumed_token_ids), call.num_speculative_tokens,
                            self.min_ngram, self.max_ngram, context)

    def lookup_tree(self, call: ProposeCall, sequence, context: list[int]
                    ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """A tree of proposals (tokens, parents) when the drafter has more than one
        continuation worth verifying, else None (a chain: `lookup`). Prompt lookup has one."""
        return None

    def allowed_prefix(self, call: ProposeCall, sequence, context: list[int],
                       token_ids: list[int]) -> list[int]:
        """The proposal's longest prefix the request's grammar allows after the context."""
        matcher = None if self.grammar_tokenizer is None else matcher_after(
            sequence, call.sampling, self.grammar_tokenizer, context[call.prompt_len:])
        return [] if matcher is None else token_ids[:matcher.allowed_prefix(token_ids)]

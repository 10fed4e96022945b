"""A request's grammar as masks: the tokens it allows at each position of a drafted block,
after the output so far (TokenMasks), which the drafter, the verifier and the router's
drafters all build the same way, and the logits masked by them (speculative.grammar compiles
the grammars from the API's fields)."""

import functools

import torch

from speculative.prefixes import common_prefix_len, found_in


class GrammarDeadEnd(ValueError):
    """A request's committed output that its grammar's matcher refuses: a token the mask
    allowed broke the matcher (a rule deeper than `dead_end` probes, recursing forever).
    The request cannot go on (its pool answers OUT_OF_RANGE, the router a 400)."""


def llguidance():
    import llguidance as module

    return module


class TokenMasks:
    """One request's matcher: follows its output (`follow`) and gives the allowed tokens of
    the next positions of a block (`masks`), or of one position at a time (`next_mask`,
    `advance`) for a drafter drawing token by token.

    after: the reasoning's end ids (vLLM 0.32's grammar after the reasoning, decided by the
    router: SamplingParams.grammar_after); non-empty, every position up to the first time
    they stand whole in the output is unconstrained (every id allowed, the end token and the
    special ones too), and the grammar, from its start, holds on the tokens after them. The
    drafter, the verifier and the router's drafters all mask through this class, so each
    drafted position is gated by the same rule.

    at: with `after`, the ids that end the reasoning implicitly (vLLM 0.32's qwen3
    `<tool_call>`, SamplingParams.grammar_at): where one stands before the end ids are whole,
    the reasoning ends there and the grammar holds from that id itself (vLLM's grammar_start
    at it, its constraint_start after it: its own position is unconstrained, as every
    reasoning position, and the grammar consumes it; one the grammar refuses breaks it)."""

    def __init__(self, tokenizer, grammar: str, after: tuple[int, ...] = (),
                 at: tuple[int, ...] = ()) -> None:
        self.tokenizer, self.grammar, self.after = tokenizer, grammar, tuple(after)
        self.at = tuple(at) if self.after else ()
        self.matcher = compiled(tokenizer, grammar).deep_copy()
        # the followed tokens before the grammar (the reasoning, through its end ids once
        # `opened`; before the `at` id that ended it where `implicit`), then those the
        # matcher consumed: together, the sequence followed
        self.head: list[int] = []
        self.opened = not self.after
        self.implicit = False
        self.consumed: list[int] = []

    def follow(self, output: list[int]) -> int:
        """Move to `output` (rolling back what it does not share); returns how many of its
        tokens the grammar allows (len(output) when all). The tokens it shares with those
        followed are found in C: a scan in Python cost 1.35 ms a call at 32k output tokens,
        at the verifier's calls and the drafter's (measured)."""
        shared = common_prefix_len(self.head, output)
        if shared < len(self.head) or not self.opened or self.left_its_end(output):
            # still inside the reasoning, or moved to another one (or off the id that ended
            # it implicitly): the grammar has consumed nothing
            del self.head[shared:]
            self.opened = self.implicit = False
            self.restart()
            return shared + self.advance(output[shared:])
        start = len(self.head)
        return start + self.follow_grammar(output[start:])

    def left_its_end(self, output: list[int]) -> bool:
        """Whether the reasoning ended implicitly but `output` (which holds the head) does
        not go on with an implicit end's id there (a rejected draft's)."""
        at = len(self.head)
        return self.implicit and first_of(output, self.at, at, at + 1) is None

    def follow_grammar(self, output: list[int]) -> int:
        """follow for the tokens after the reasoning."""
        shared = common_prefix_len(self.consumed, output)
        if shared < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - shared)
            del self.consumed[shared:]
        if self.matcher.is_error():
            # llguidance keeps an error through rollbacks: one that a token past the output
            # raised (a rejected draft that broke the matcher, or its rollback) ended outputs
            # the grammar allows, so the state is the output's alone: a fresh matcher replays
            # it (an output that breaks it still ends, as the target alone's would)
            self.restart()
            shared = 0
        return shared + self.advance(output[shared:])

    def restart(self) -> None:
        """The matcher back at the grammar's start (a copy: 2 us)."""
        if self.consumed or self.matcher.is_error():
            self.matcher = compiled(self.tokenizer, self.grammar).deep_copy()
            del self.consumed[:]

    def advance(self, tokens: list[int]) -> int:
        """Consume the allowed prefix of tokens; returns its length (the reasoning's tokens
        are all allowed)."""
        taken = self.reasoned(tokens)
        rest = tokens[taken:]
        if rest:
            consumed = self.matcher.try_consume_tokens(list(rest))
            self.consumed.extend(rest[:consumed])
            taken += consumed
        return taken

    def reasoned(self, tokens: list[int]) -> int:
        """How many of tokens are the reasoning's (through its end ids), taken into the
        head; 0 once the grammar holds."""
        if self.opened:
            return 0
        start = len(self.head)
        self.head.extend(tokens)
        end, self.implicit = self.reasoning_end(self.head, start)
        if end is None:
            return len(tokens)
        del self.head[end:]
        self.opened = True
        return end - start

    def reasoning_end(self, ids: list[int], start: int) -> tuple[int | None, bool]:
        """(where the grammar starts in ids, whether at an implicit end), looking from
        `start` on (the end ids may begin before it, with the ids before it); None: the
        reasoning goes on. An implicit end first: its id is the grammar's."""
        return reasoning_end(ids, start, self.after, self.at)

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many first tokens of a proposal after the followed sequence the rule allows
        (the reasoning's, then those the grammar validates), moving nothing."""
        if self.opened:
            return self.matcher.validate_tokens(list(tokens))
        # the head's last ids that may begin the end ids with the proposal's (no copy of a
        # long reasoning a proposal)
        window = self.head[max(0, len(self.head) - len(self.after) + 1):]
        end, _ = self.reasoning_end(window + list(tokens), len(window))
        if end is None:
            return len(tokens)
        taken = end - len(window)
        return taken + self.matcher.validate_tokens(list(tokens[taken:]))

    def next_mask(self, vocab_size: int, device=None) -> torch.Tensor:
        """[vocab_size] bool: the tokens allowed at the next position (all of them inside
        the reasoning)."""
        if not self.opened:
            return torch.ones(vocab_size, dtype=torch.bool, device=device)
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()),
                                   dtype=torch.uint8)[:vocab_size] > 0
        if allowed.shape[0] < vocab_size:
            allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[0]))
        return allowed.to(device)

    def masks(self, output: list[int], drafted: list[int], vocab_size: int,
              device=None) -> torch.Tensor:
        """[len(drafted) + 1, vocab_size] bool: row i allows what may follow output plus
        drafted[:i] (all ids while the reasoning goes on: a block may end it at any row).
        Past a drafted token the grammar forbids, the rows repeat the last reachable one
        (those positions are never committed: that token is rejected; an implicit end's id
        the grammar refuses is allowed where it stands, as vLLM's, and breaks the output
        once committed)."""
        taken = self.follow(output)
        if taken < len(output):
            raise GrammarDeadEnd(f"the committed output breaks the request's grammar after "
                                 f"{taken} tokens: {self.matcher.get_error() or 'refused'}")
        rows = [self.next_mask(vocab_size, device)]
        for token in drafted:
            if self.advance([token]) == 0:
                rows += [rows[-1]] * (len(drafted) + 1 - len(rows))
                break
            rows.append(self.next_mask(vocab_size, device))
        return torch.stack(rows)


@functools.lru_cache(maxsize=64)
def compiled(tokenizer, grammar: str):
    """A matcher at the start of `grammar`, never advanced: each request's is a copy of it.
    Compiling takes a millisecond or more (measured: 1.2-1.4 ms for a small regex or JSON
    schema over the demo vocabulary), a copy 2 us, and a pool and the router's drafter each
    start one matcher per constrained request; the n choices of a request share a grammar."""
    matcher = llguidance().LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"grammar does not compile: {matcher.get_error()}")
    return matcher


def request_matcher(holder, sampling, tokenizer) -> TokenMasks:
    """The matcher a pool keeps on a request's sequence (`holder.constraint`) for its
    sampling's grammar and gate (SamplingParams.grammar, grammar_after, grammar_at): a new
    one when any is new to it."""
    if tokenizer is None:
        raise ValueError("this pool has no tokenizer for grammars (structured outputs)")
    current = getattr(holder, "constraint", None)
    if current is None or current.grammar != sampling.grammar or \
            current.after != sampling.grammar_after or current.at != sampling.grammar_at:
        current = holder.constraint = TokenMasks(tokenizer, sampling.grammar,
                                                 sampling.grammar_after, sampling.grammar_at)
    return current


def reasoning_end(ids: list[int], start: int, after: tuple[int, ...],
                  at: tuple[int, ...] = ()) -> tuple[int | None, bool]:
    """TokenMasks.reasoning_end for the gate (after, at): where the grammar starts in ids
    (after the end ids, or at an implicit end's id), whether implicitly; None: it does not."""
    end = found_in(ids, after, max(0, start - len(after) + 1))
    implicit = first_of(ids, at, start, len(ids) if end is None else end - 1)
    return (end, False) if implicit is None else (implicit, True)


def first_of(ids: list[int], wanted: tuple[int, ...], start: int, stop: int) -> int | None:
    """Where one of the `wanted` ids first stands in ids[start:stop], or None (found at C
    speed: an implicit end of the reasoning in the output followed)."""
    places = []
    for token in wanted:
        try:
            places.append(ids.index(token, start, stop))
        except ValueError:
            pass
    return min(places, default=None)


def matcher_after(holder, sampling, tokenizer, output: list[int]) -> TokenMasks | None:
    """request_matcher moved to `output`, or None when the grammar forbids some of it (a
    drafter then proposes nothing: a forbidden token it builds on will be rejected)."""
    matcher = request_matcher(holder, sampling, tokenizer)
    return matcher if matcher.follow(output) == len(output) else None


def masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits with the disallowed tokens at -inf; a row allowing nothing (a grammar with no
    way on, not even the end token) is left whole rather than turned into NaNs."""
    if allowed is None:
        return logits
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    return logits.masked_fill(~allowed, float("-inf"))

"""Reasoning outputs (vLLM's `--reasoning-parser`): a thinking model's chat output split into
its reasoning, the text inside `<think>...</think>`, and its content, the text after.

Only the text is split: the tokens and logprobs are the output's own, and usage counts the
reasoning's tokens apart too (ThinkTokens, OpenAI's `completion_tokens_details`). As vLLM's
`deepseek_r1` and `qwen3` parsers read it: a `<think>` that opens the output is dropped; the
output may start inside the reasoning without one (DeepSeek-R1's and Qwen3.5's templates end
the prompt with `<think>`); the first `</think>` ends the reasoning, and the text after it
is the content (null when empty; tool calls are read out of it alone); an output that
never reaches `</think>` (max_tokens inside the reasoning) is all reasoning, its content
null; under deepseek_r1 a `<think>` after text is text where it stands (vLLM 0.32's whole
`deepseek_r1` answer drops all before its first `<think>` anywhere, a reasoning already
streamed included: no stream can follow it, vLLM's own neither). vLLM 0.32's `qwen3` (its
parser engine's grammar) differs in three ways: a `<tool_call>` ends the reasoning
implicitly too, and starts the content (kept in it, a call's opening; `deepseek_r1` reads
it as reasoning); every `<think>` inside the reasoning is dropped (not only an opening one,
and the whitespace before it is reasoning); and every `</think>` after the end is dropped
from the content (a call's text included). The reasoning goes out in current vLLM's field,
`reasoning` (earlier vLLM's `reasoning_content`, which it no longer sends).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from deployments.held_text import Opening, held_prefix
from speculative.prefixes import find_ids
from speculative.thinking import ThinkingBudget, last_at

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# vLLM 0.32's qwen3 parser: a `<tool_call>` inside the reasoning ends it where it stands, the
# tag itself the content's (its grammar's transition REASONING -> TOOL_PREAMBLE)
IMPLICIT_ENDS = {"qwen3": ("<tool_call>",)}
CALL_CLOSE = "</tool_call>"
TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")  # ChatML's, vLLM's qwen3 parser's
ReasoningParserName = Literal["deepseek_r1", "qwen3"]


def reasoning_split(parser: ReasoningParserName | None, chat_template_kwargs: dict | None,
                    constrained: bool, shown: bool = True,
                    ended: bool = False) -> "ReasoningSplit | None":
    """The split a chat request's output gets; None where its text is all content: no
    parser, Qwen3 asked not to think (`chat_template_kwargs.enable_thinking` false: its
    template closes an empty think block in the prompt, as vLLM reads the prompt as ended
    reasoning), or an output a grammar constrains from its first token (grammar_gate gave
    it no room to think); shown: the request's include_reasoning; ended: the prompt ended
    the reasoning already (prompt_ended_reasoning)."""
    if parser is None or constrained or ended:
        return None
    if parser == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking", True) is False:
        return None
    return ReasoningSplit(parser, shown)


def prompt_ended_reasoning(continued: str | None,
                           parser: ReasoningParserName | None = None) -> bool:
    """Whether a continued assistant message (continue_final_message's) closed its
    reasoning: its last `</think>` (for qwen3, or `<tool_call>`) after its last `<think>`, so
    the output carries on in the content (as vLLM reads a prompt that ends the reasoning)."""
    if continued is None:
        return False
    ends = (THINK_CLOSE, *IMPLICIT_ENDS.get(parser, ()))
    return max(continued.rfind(end) for end in ends) > continued.rfind(THINK_OPEN)


def continued_text(body) -> str | None:
    """The assistant message a chat continues (continue_final_message), or None."""
    return body.messages[-1].content if body.continue_final_message else None


def request_split(parser: ReasoningParserName | None, body, plan,
                  in_reasoning: "ThinkTokens | None" = None) -> "ReasoningSplit | None":
    """reasoning_split for a chat `body` planned as `plan`: not where a grammar constrains
    its outputs from their first token (a grammar after the reasoning splits them as any),
    nor after a continued message that ended its reasoning. in_reasoning: the parser's tags
    under the router's structured_outputs_enable_in_reasoning, whose grammars all hold from
    the first token: the split is the one grammar_gate's gate gives, as vLLM's front end
    splits the text whatever its engine's gate."""
    # the gate of each prompt, read once: a prompt's choices share its ids (a scan of them
    # a choice took 0.63 s of the router's loop for 128 choices of a 128k-token prompt)
    ungated: dict[int, bool] = {}

    def constrained(request) -> bool:
        if request.sampling.grammar is None:
            return False
        if in_reasoning is None:
            return not request.sampling.grammar_after
        prompt = request.prompt_token_ids
        if id(prompt) not in ungated:
            ungated[id(prompt)] = grammar_gate(parser, in_reasoning, body, True,
                                               prompt) == UNGATED
        return ungated[id(prompt)]

    return reasoning_split(parser, body.template_kwargs(),
                           any(constrained(c.request) for c in plan.choices),
                           body.include_reasoning,
                           prompt_ended_reasoning(continued_text(body), parser))


Gate = tuple[tuple[int, ...], tuple[int, ...]]  # SamplingParams.grammar_after, grammar_at
UNGATED: Gate = ((), ())


def grammar_gate(parser: ReasoningParserName | None, tags: "ThinkTokens | None", body,
                 chat: bool, prompt: Sequence[int]) -> Gate:
    """A constrained request's SamplingParams (grammar_after, grammar_at): `</think>`'s ids
    where its grammar holds only after the reasoning, and the ids that end it implicitly
    (qwen3's `<tool_call>`: the grammar holds from that token itself); ((), ()) where from
    the output's first token. As vLLM 0.32 decides it (its structured outputs'
    reasoning_ended, without `enable_in_reasoning`): with a reasoning parser, a chat's
    grammar waits for the reasoning's end unless include_reasoning is false, or its prompt
    ended the reasoning (reasoning_split's reading: Qwen3 asked not to think, a continued
    message that closed it; and prompt_ids_ended); a completion's, unless its prompt's ids
    ended it."""
    if parser is None or tags is None or not tags.end:
        return UNGATED
    if chat and (not body.include_reasoning or reasoning_split(
            parser, body.template_kwargs(), False,
            ended=prompt_ended_reasoning(continued_text(body), parser)) is None):
        return UNGATED
    return UNGATED if prompt_ids_ended(parser, tags, prompt) else (tags.end, tags.implicit)


def prompt_ids_ended(parser: ReasoningParserName, tags: "ThinkTokens",
                     prompt: Sequence[int]) -> bool:
    """vLLM's is_reasoning_end of the prompt's ids: its last `</think>` after its last
    `<think>` (deepseek_r1's, over the whole prompt), and for qwen3 after its last turn
    boundary too (`<|im_start|>`, `<|im_end|>`: the reply's own turn alone), its last
    `<tool_call>` (tags.implicit) ending it as a `</think>` does."""
    end = max([last_at(prompt, tags.end)] + [last_at(prompt, (i,)) for i in tags.implicit])
    after = [last_at(prompt, tags.start)] if tags.start else []
    if parser == "qwen3":
        after += [last_at(prompt, (turn,)) for turn in tags.turns]
    return end > max(after, default=-1)


@dataclass(frozen=True)
class ReasoningSplit:
    parser: ReasoningParserName
    # vLLM's include_reasoning: false, the reasoning is split off the content but not sent
    # (the message's null, no delta of it)
    shown: bool = True

    def split(self, text: str) -> tuple[str, str | None]:
        """(reasoning, content) of a whole output: what a stream of it sends, as one."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        held, tail = stream.finish()
        return reasoning + held, (content + tail) or None

    def stream(self) -> "ReasoningStream | Qwen3Stream":
        return Qwen3Stream() if self.parser == "qwen3" else ReasoningStream()


class ReasoningStream:
    """A streamed output's text split as it comes (deepseek_r1's), in HeldContent's manner:
    each delta goes out at once as reasoning or content, except a tail that may grow into a
    tag, held to the next delta (a `</think>` split across deltas, or a `<think>` opening the
    output), so that a delta costs its own length and the deltas add up to the whole
    output's split."""

    def __init__(self) -> None:
        # until it is known whether the output opens with `<think>` (dropped, and the
        # whitespace before it) or starts inside the reasoning
        self.opening: Opening | None = Opening(THINK_OPEN)
        self.ended = False  # past the first `</think>`: the rest is content
        self.held = ""  # after the opening, a tail that may grow into `</think>`

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) of the delta that can go out now."""
        if self.ended:
            return "", delta
        if self.opening is None:
            text = self.held + delta
        elif (text := self.opened(delta)) is None:
            return "", ""
        end = text.find(THINK_CLOSE)
        if end >= 0:
            self.ended, self.held = True, ""
            return text[:end], text[end + len(THINK_CLOSE):]
        keep = held_prefix(text, THINK_CLOSE)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def opened(self, delta: str) -> str | None:
        """The text after the output's opening, once it is known (its `<think>` dropped, with
        the whitespace before it); None while whitespace, or a `<think>` begun, may still
        open the output."""
        start = self.opening.feed(delta)
        if start is None:
            return None
        space, self.opening = self.opening.space(), None
        if start.startswith(THINK_OPEN):  # the output opens the block itself: dropped
            return start[len(THINK_OPEN):]
        return space + start

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held at the end of the output (a tag's beginning that never
        came whole is text): the reasoning's alone."""
        rest = self.opening.held() if self.opening is not None else self.held
        self.held = ""
        return rest, ""


class Qwen3Stream:
    """vLLM 0.32's `qwen3` split as the output streams (its parser engine's grammar, as
    reasoning.split reads it whole): inside the reasoning every `<think>` is dropped (its
    transition REASONING -> REASONING emits nothing) and the first `</think>` or
    `<tool_call>` ends it (the `<tool_call>` kept, the content's); in the content every
    `</think>` is dropped (CONTENT -> CONTENT, nothing emitted: a duplicate end absorbed), a
    call's text included, as vLLM's tool parser reads the content without it. A tail that
    may grow into a tag is held to the next delta. (vLLM's own
    stream stops feeding its parser once the reasoning ended, so it drops a later delta's
    `</think>` only in its whole answer: here the stream adds up to the whole answer.)"""

    REASONING_TAGS = (THINK_OPEN, THINK_CLOSE, *IMPLICIT_ENDS["qwen3"])

    def __init__(self) -> None:
        self.ended = False  # past the reasoning's end: the rest is content
        self.held = ""  # a tail that may grow into a tag (the text not yet read)

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) of the delta that can go out now."""
        text, self.held = self.held + delta, ""
        if self.ended:
            return "", self.content(text)
        ends = [(at, tag) for tag in self.REASONING_TAGS[1:] if (at := text.find(tag)) >= 0]
        if ends:
            end, tag = min(ends)
            self.ended = True
            after = end + len(tag) if tag == THINK_CLOSE else end  # an implicit end's kept
            return text[:end].replace(THINK_OPEN, ""), self.content(text[after:])
        keep = max(held_prefix(text, tag) for tag in self.REASONING_TAGS)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep].replace(THINK_OPEN, ""), ""

    def content(self, text: str) -> str:
        """The content of `text` (read from where the last delta's left off) that can go
        out now: its `</think>`s dropped, a tail that may grow into one held."""
        keep = held_prefix(text, THINK_CLOSE)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep].replace(THINK_CLOSE, "")

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held at the end of the output: a tag's beginning that never
        came whole is text."""
        held, self.held = self.held, ""
        return ("", held) if self.ended else (held, "")


@dataclass(frozen=True)
class ThinkTokens:
    """The tags' token ids, which count an output's reasoning tokens (usage's
    `completion_tokens_details.reasoning_tokens`, as vLLM 0.32's parsers count them)."""
    start: tuple[int, ...]
    end: tuple[int, ...]
    # Qwen3's turn boundaries' ids, those in the vocabulary (prompt_ids_ended)
    turns: tuple[int, ...] = ()
    # the ids that end the reasoning implicitly, each its own token the content's: qwen3's
    # `<tool_call>` where the vocabulary holds it whole (vLLM 0.32 finds it by its one id)
    implicit: tuple[int, ...] = ()
    # qwen3's: every `<think>` inside the reasoning is dropped, its ids not counted (vLLM
    # 0.32's engine counts the reasoning's text events alone); else the count is
    # deepseek_r1's depth count (nested)
    inner_starts: bool = False
    # qwen3's `</tool_call>` where the vocabulary holds it whole: inside the reasoning its
    # text is reasoning but vLLM 0.32 counts no token for it (a tag found by its id that
    # has no transition there goes out as text without its token)
    uncounted: tuple[int, ...] = ()

    @classmethod
    def of(cls, tokenizer, parser: ReasoningParserName | None = None) -> "ThinkTokens":
        def ids(tag: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(tag, add_special_tokens=False))

        vocab = tokenizer.get_vocab()
        turns = tuple(vocab[turn] for turn in TURN_BOUNDARIES if turn in vocab)
        implicit = tuple(vocab[tag] for tag in IMPLICIT_ENDS.get(parser, ()) if tag in vocab)
        qwen3 = parser == "qwen3"
        uncounted = (vocab[CALL_CLOSE],) if qwen3 and CALL_CLOSE in vocab else ()
        return cls(ids(THINK_OPEN), ids(THINK_CLOSE), turns, implicit, qwen3, uncounted)

    @property
    def nested(self) -> bool:
        """Whether the count is deepseek_r1's (every parser's but qwen3's): vLLM 0.32's depth
        count of the output's ids alone, whether or not the output is split."""
        return not self.inner_starts

    def count(self, token_ids: Sequence[int]) -> int:
        """The output's reasoning tokens, read by ids as vLLM does (a tag the model spelt in
        other tokens than the tokenizer's is not found). deepseek_r1's (nested_count): the
        tokens inside `<think>...</think>` spans, 0 for an output without `<think>` (one
        whose prompt opened the block too). qwen3's (inner_starts): those before the first
        `</think>` or implicit end (all without one), less every `<think>`'s and uncounted
        id's among them: the tags themselves are not reasoning."""
        ids = list(token_ids)
        if self.nested:
            return nested_count(ids, self.start, self.end)
        start = len(self.start) if self.start and ids[:len(self.start)] == list(self.start) \
            else 0
        end = min([found(ids, self.end, start)] + [found(ids, (i,), start)
                                                    for i in self.implicit])
        head = ids[:end]  # (each found at C speed: a usage per streamed chunk)
        start = len(self.start) * occurrences(head, self.start) if self.start else 0
        start += sum(head.count(i) for i in self.uncounted)
        return max(0, end - start)


# vLLM's refusal of a thinking_token_budget without a reasoning parser (its ids)
NO_REASONING_CONFIG = ("thinking_token_budget is set but reasoning_config is not configured. "
                       "Please set --reasoning-parser and/or --reasoning-config to use "
                       "thinking_token_budget.")


def thinking_budget(budget: int | None, think_tokens: ThinkTokens,
                    constrained: bool) -> ThinkingBudget | None:
    """A request's thinking_token_budget with the parser's ids (speculative.thinking); None
    under a grammar that holds from the output's first token (constrained: no grammar_gate),
    which leaves no thinking section. Under a grammar after the reasoning, the forced
    `</think>` ends the reasoning as the model's own would, and the grammar starts after
    it (every id is allowed before it, so the forced ones are too). As vLLM 0.32's budget
    (its ThinkingBudgetStateHolder reads the `</think>` ids alone), an implicit end (qwen3's
    `<tool_call>`) does not end a section: its tokens count on."""
    if budget is None or constrained:
        return None
    return ThinkingBudget(budget, think_tokens.start, think_tokens.end)


def nested_count(ids: list[int], start: tuple[int, ...], end: tuple[int, ...]) -> int:
    """vLLM 0.32's count_reasoning_tokens (its thinking parsers' base, deepseek_r1's): a
    depth counter read left to right, a `<think>` one deeper, a `</think>` one shallower
    (never below 0), the tags not counted, every other id counted at a depth above 0. Each
    tag is found at C speed (a usage per streamed chunk), the ids between counted at once;
    a tag of several ids (vLLM takes only one) is read where it stands whole, a `<think>`
    before a `</think>` that starts at the same id."""
    tags = sorted([(at, 0, len(start)) for at in positions(ids, start)]
                  + [(at, 1, len(end)) for at in positions(ids, end)])
    count = depth = after = 0
    for at, closes, width in tags:
        if at < after:  # inside a tag read before it
            continue
        count += at - after if depth else 0
        depth, after = (max(depth - 1, 0) if closes else depth + 1), at + width
    return count + (len(ids) - after if depth else 0)


def positions(ids: list[int], part: tuple[int, ...]) -> list[int]:
    """Every place `part` stands in ids, overlapping ones too (none for an empty part)."""
    places, at = [], found(ids, part, 0)
    while at < len(ids):
        places.append(at)
        at = found(ids, part, at + 1)
    return places


def occurrences(ids: list[int], part: tuple[int, ...]) -> int:
    """How many times `part` (not empty) stands in ids, each after the last (as its text's
    find reads it)."""
    count, at = 0, found(ids, part, 0)
    while at < len(ids):
        count, at = count + 1, found(ids, part, at + len(part))
    return count


def found(ids: list[int], part: tuple[int, ...], start: int) -> int:
    """Where `part` first occurs in ids at or after start; len(ids) where it does not (or
    where part is empty)."""
    at = find_ids(ids, part, start) if part else -1
    return len(ids) if at < 0 else at

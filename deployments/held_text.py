"""Streamed text held back while it may still turn into a tag (a reasoning parser's, a tool
call parser's), each delta costing its own length: a tail that may grow into a tag
(held_prefix), and an output's opening, until it is known whether it opens with one
(Opening); what of a held content was sent (SentContent); a streamed choice's text as
it can go out now (StreamedText)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (each imports this module)
    from deployments.reasoning import ReasoningSplit
    from deployments.tools import ToolUse


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (short of the whole tag)."""
    return max(n for n in range(len(tag)) if text.endswith(tag[:n]))


class Opening:
    """An output's opening as it streams, until it is known whether it opens (after
    whitespace) with `tag`: its leading whitespace, kept in its deltas' pieces (an output of
    newlines, grown and stripped at each delta, cost its square), then a beginning of the
    tag."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.spaces: list[str] = []
        self.begun = ""  # after the whitespace: a beginning of the tag

    def feed(self, delta: str) -> str | None:
        """The text after the opening whitespace, once it is more than a beginning of the
        tag; None while it may still be whitespace or a beginning of the tag."""
        if not self.begun:  # whitespace alone so far: only the delta's own is stripped
            body = delta.lstrip()
            if len(body) < len(delta):  # (an empty delta keeps nothing)
                self.spaces.append(delta[:len(delta) - len(body)])
            delta = body
        text, self.begun = self.begun + delta, ""
        if len(text) < len(self.tag) and self.tag.startswith(text):  # "" too
            self.begun = text
            return None
        return text

    def space(self) -> str:
        """The opening whitespace held, given up."""
        space, self.spaces = "".join(self.spaces), []
        return space

    def held(self) -> str:
        """All it holds (the whitespace and a beginning of the tag), given up."""
        held, self.begun = self.space() + self.begun, ""
        return held


class SentContent:
    """A tool call parser's held content (deployments.tool_parsers, pythonic_calls): how much
    of the output went out as content, so that the rest goes at the end."""

    sent = 0  # the characters of content sent so far

    def rest(self, content: str | None) -> str:
        """What remains to send of the final content (read_calls' content)."""
        return (content or "")[self.sent:]


class StreamedText:
    """A streamed choice's text as it can go out now, each delta's (reasoning, content): the
    reasoning split off (deployments.reasoning), the content held from where a call may
    begin (deployments.tool_parsers.held_content); without either, the delta as content."""

    def __init__(self, reasoning: "ReasoningSplit | None", tools: "ToolUse | None") -> None:
        self.thinking = reasoning.stream() if reasoning is not None else None
        self.shown = reasoning is not None and reasoning.shown  # its reasoning sent
        self.held = tools.held_content() if tools is not None else None

    @property
    def parses(self) -> bool:
        """Whether a parser reads the text (else each delta goes out whole, as it comes)."""
        return self.thinking is not None or self.held is not None

    def feed(self, delta: str) -> tuple[str, str] | None:
        """(reasoning, content) to send now; None when a parser holds all of it."""
        if not self.parses:
            return "", delta
        reasoning = ""
        if self.thinking is not None:
            reasoning, delta = self.thinking.feed(delta)
            reasoning = reasoning if self.shown else ""
        if self.held is not None:
            delta = self.held.feed(delta)
        return (reasoning, delta) if reasoning or delta else None

    def rest(self, content: str | None) -> tuple[str, str] | None:
        """(reasoning, content) held to the end and still to send, given the final content
        (Choices.read_output's); None when nothing is, except an empty content under tools,
        whose "" goes out (the role's chunk carried none)."""
        reasoning, tail = self.thinking.finish() if self.thinking is not None else ("", "")
        reasoning = reasoning if self.shown else ""
        # the content's held tail (a `</think>` begun: qwen3's) is in the final content, whose
        # rest a held content sends
        rest = self.held.rest(content) if self.held is not None else tail
        if reasoning or rest or (self.held is not None and content == ""):
            return reasoning, rest
        return None


class StreamInterval:
    """vLLM's stream_interval: a choice's deltas held until `interval` tokens came since
    its last chunk; its first chunk and its last go at once (as vLLM's output processor
    sends them), each carrying the text held before it, so the chunks still concatenate
    to the whole text. Rounds commit several tokens at once, as vLLM's speculative steps
    do: a chunk then carries all of a round's."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.sent_tokens = 0  # the output's tokens when the last chunk went (0: none yet)
        self.held: list[str] = []

    def take(self, delta: str, num_tokens: int, finished: bool) -> str | None:
        """The delta to send now (with what was held), or None to hold it."""
        if self.interval > 1 and not finished and self.sent_tokens and \
                num_tokens - self.sent_tokens < self.interval:
            self.held.append(delta)
            return None
        self.sent_tokens = num_tokens
        return self.rest() + delta

    def rest(self) -> str:
        """What is held (sent with the choice's end), released."""
        held, self.held = "".join(self.held), []
        return held

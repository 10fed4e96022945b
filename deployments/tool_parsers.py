"""Tool calls read back out of an "auto" output, in the format the model was taught (vLLM's
`--tool-call-parser`), and the part of a streamed output held back while it may be calls.

- `hermes` (the default; Hermes', Qwen's and the demo template's):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after the message's content.
- `llama3_json` (Llama 3.1 / 3.2 / 4's JSON tool calling): the whole output is one or more
  `{"name": ..., "parameters": {...}}` objects (or "arguments"), separated by `;` or
  whitespace, optionally after `<|python_tag|>`; an output that does not open (after
  whitespace) with `{` or the tag is content, as vLLM's parser streams it.
- `mistral`: content, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments":
  {...}}` objects (Mistral's tokenizers before v11), or `[TOOL_CALLS]name[ARGS]{...}`, once
  per call (v11 and after; `[ARGS]` may be skipped as a special token).
- `pythonic` (Llama 3.2's with vLLM's pythonic template, Llama 4's): the whole output is a
  Python list of calls with keyword arguments of literal values,
  `[get_weather(city="Paris")]`, read with `ast` (deployments.pythonic_calls).

Under each, an output is calls only when every call it begins names an offered function
with an object of arguments; else it is all content. A reader returns (content, [(name,
arguments as the model wrote them; pythonic's re-encoded as JSON)]), or None when the output
is content. A forced call's grammar writes Hermes' format whatever the parser
(deployments.tools.call_grammar).
"""

import json
import re
from typing import Literal

from deployments.held_text import Opening, SentContent, held_prefix
from deployments.pythonic_calls import HeldPythonic, read_pythonic

ToolCallParserName = Literal["hermes", "llama3_json", "mistral", "pythonic"]
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
# the special tokens whose text a parser reads: kept in the decoded output of a request with
# tools in effect (every other special token skipped); Hermes' tags under every parser, as
# a forced call's grammar writes them
KEPT_TEXTS = {"hermes": (CALL_OPEN, CALL_CLOSE),
              "llama3_json": (CALL_OPEN, CALL_CLOSE, PYTHON_TAG),
              "mistral": (CALL_OPEN, CALL_CLOSE, TOOL_CALLS, ARGS),
              "pythonic": (CALL_OPEN, CALL_CLOSE)}

Calls = tuple[str | None, list[tuple[str, str]]]


def strict_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


# JSON as the standard has it: no NaN or Infinity (Python's json takes them by default)
DECODER = json.JSONDecoder(parse_constant=strict_json)
KEYS = {key: re.compile(rf'"{key}"\s*:\s*') for key in ("arguments", "parameters")}
SPACE = re.compile(r"\s*")
# a v11 Mistral call's head: the function's name (OpenAI's pattern), then `[ARGS]`
MISTRAL_NAME = re.compile(r"\s*([a-zA-Z0-9_-]{1,64})\s*(?:\[ARGS\]\s*)?")


def read_calls(parser: ToolCallParserName, text: str, names: set[str]) -> Calls | None:
    """The calls of an output under the parser, or None when it is content."""
    return {"hermes": read_hermes, "llama3_json": read_llama,
            "mistral": read_mistral, "pythonic": read_pythonic}[parser](text, names)


def read_hermes(text: str, names: set[str]) -> Calls | None:
    """The calls when every `<tool_call>` in the text holds a call of an offered function
    with an object of arguments, and the text before them as content (None when empty)."""
    def one_call(text: str, at: int):
        read = read_call(text, at)
        return None if read is None else ([read[0]], read[1])

    return read_tagged(text, names, CALL_OPEN, one_call)


def read_tagged(text: str, names: set[str], tag: str, read_at) -> Calls | None:
    """The calls when every `tag` in the text opens calls (read_at(text, at): the calls
    read from `at` and where they end, or None) of offered functions, and the text before
    the first as content (None when empty); None when it is content. Text after a call
    that is no further `tag` is dropped."""
    start = text.find(tag)
    if start < 0:
        return None
    calls, at = [], start
    while at >= 0:
        read = read_at(text, at + len(tag))
        if read is None or any(name not in names for name, _ in read[0]):
            return None
        calls += read[0]
        at = text.find(tag, read[1])
    return text[:start] or None, calls


def read_call(text: str, at: int) -> tuple[tuple[str, str], int] | None:
    """((name, arguments as the model wrote them), the end of `</tool_call>`) of the call
    whose JSON object starts at `at` (after whitespace) and is followed by `</tool_call>`, or
    by nothing but whitespace to the end of the text; None when it is no such call. The object
    is decoded, not matched up to the first `</tool_call>`, so an argument may hold that
    text."""
    read = read_object(text, at, ("arguments",))
    if read is None:
        return None
    call, end = read
    close = SPACE.match(text, end).end()
    # the output's last call may end without `</tool_call>` (a stop string, or the model's
    # end token, right after its object), as vLLM's Hermes parser reads it
    closed = text.startswith(CALL_CLOSE, close)
    if not (closed or close == len(text)):
        return None
    return call, close + len(CALL_CLOSE) if closed else close


def read_object(text: str, at: int, keys: tuple[str, ...]
                ) -> tuple[tuple[str, str], int] | None:
    """((name, arguments as the model wrote them), its end) of the JSON object at `at` (after
    whitespace) when it has a string "name" and an object under the first of `keys` that it
    has; None when it is no such object."""
    try:
        begin = SPACE.match(text, at).end()
        call, end = DECODER.raw_decode(text, begin)
    except (ValueError, RecursionError):
        return None
    key = next((key for key in keys if isinstance(call, dict) and key in call), None)
    if key is None or not isinstance(call.get("name"), str) or not isinstance(call[key], dict):
        return None
    arguments = arguments_text(text[begin:end], call[key], key)
    return None if arguments is None else ((call["name"], arguments), end)


def arguments_text(call_text: str, arguments: dict, key: str = "arguments") -> str | None:
    """The arguments object as the model wrote it in the call (OpenAI returns the model's
    own text: numbers keep their digits), or re-encoded where its span cannot be found."""
    found_key = KEYS[key].search(call_text)
    if found_key is not None:
        try:
            found, end = DECODER.raw_decode(call_text, found_key.end())
            if json.dumps(found) == json.dumps(arguments):  # the same text (True is no 1)
                return call_text[found_key.end():end]
        except (ValueError, RecursionError):
            pass
    try:
        return json.dumps(arguments, allow_nan=False)
    except ValueError:  # a number past float's range: no call
        return None


def read_llama(text: str, names: set[str]) -> Calls | None:
    """Llama's JSON calls: the output (after whitespace, and `<|python_tag|>` if it opens
    with it) one or more call objects, each separated from the next by `;` or whitespace
    (text after the last one is dropped, as vLLM's parser drops it); no content."""
    at = len(text) - len(text.lstrip())
    if text.startswith(PYTHON_TAG, at):
        at += len(PYTHON_TAG)
    elif not text.startswith("{", at):
        return None
    calls = []
    while True:  # as vLLM's: "arguments" when the object has them, else "parameters"
        read = read_object(text, at, ("arguments", "parameters"))
        if read is None or read[0][0] not in names:
            return None
        calls.append(read[0])
        at = SPACE.match(text, read[1]).end()
        if text.startswith(";", at):
            at = SPACE.match(text, at + 1).end()
        if not text.startswith("{", at):
            return None, calls


def read_mistral(text: str, names: set[str]) -> Calls | None:
    """Mistral's calls: the text before the first `[TOOL_CALLS]` the content (None when
    empty), each `[TOOL_CALLS]` followed by an array of calls or by one v11 call; text
    after a call that is no `[TOOL_CALLS]` is dropped, as Hermes' text after its calls."""
    return read_tagged(text, names, TOOL_CALLS, read_mistral_calls)


def read_mistral_calls(text: str, at: int) -> tuple[list[tuple[str, str]], int] | None:
    """(calls, their end) after a `[TOOL_CALLS]` at `at`: a JSON array of call objects
    (decoded one by one, so each keeps its own text), or a v11 call, `name[ARGS]{...}`."""
    at = SPACE.match(text, at).end()
    if not text.startswith("[", at):
        head = MISTRAL_NAME.match(text, at)
        if head is None or not text.startswith("{", head.end()):
            return None
        try:
            arguments, end = DECODER.raw_decode(text, head.end())
        except (ValueError, RecursionError):
            return None
        if not isinstance(arguments, dict):
            return None
        return [(head.group(1), text[head.end():end])], end
    calls, at = [], at + 1
    while True:
        read = read_object(text, at, ("arguments",))
        if read is None:
            return None
        calls.append(read[0])
        at = SPACE.match(text, read[1]).end()
        if text.startswith("]", at):
            return calls, at + 1
        if not text.startswith(",", at):
            return None
        at += 1


def held_content(parser: ToolCallParserName) -> "HeldContent | HeldOpening | HeldPythonic":
    """What holds back a streamed output's content while it may be calls, under the
    parser."""
    if parser == "llama3_json":
        return HeldOpening()
    if parser == "pythonic":
        return HeldPythonic()
    return HeldContent(TOOL_CALLS if parser == "mistral" else CALL_OPEN)


class HeldContent(SentContent):
    """A streamed choice's content when tools are in use: text goes out as it comes, except
    from where a call's opening (`<tool_call>`, `[TOOL_CALLS]`) may begin, which waits for
    the end of the output (it is a call, or content after all)."""

    def __init__(self, opening: str = CALL_OPEN) -> None:
        self.opening = opening
        # only the text not yet sent is kept (a tail that may grow into the opening), so a
        # delta costs its own length: the whole text grown and searched at each delta took
        # 0.9 s of the event loop over a 32k-token output, 14 s over 128k
        self.held, self.sent, self.holding = "", 0, False

    def feed(self, delta: str) -> str:
        """The part of the output so far that can go out now."""
        if self.holding:  # from the opening on, everything waits for the end
            return ""
        text, opening = self.held + delta, self.opening
        start = text.find(opening)
        self.holding = start >= 0
        if not self.holding:  # hold a tail that may grow into the opening
            start = len(text) - held_prefix(text, opening)
        self.held, self.sent = text[start:], self.sent + start
        return text[:start]


class HeldOpening(SentContent):
    """llama3_json's: an output that opens (after whitespace) with `{` or `<|python_tag|>`
    waits for its end (calls, or content after all); any other goes out as it comes, from
    its first other character on. Its opening (held_text.Opening) waits for what follows
    it, each delta costing its own length."""

    def __init__(self) -> None:
        self.opening = Opening(PYTHON_TAG)
        self.holding: bool | None = None  # None: not known yet

    def feed(self, delta: str) -> str:
        """The part of the output so far that can go out now."""
        if self.holding is not None:
            sent = "" if self.holding else delta
            self.sent += len(sent)
            return sent
        if (body := self.opening.feed(delta)) is None:
            return ""
        self.holding = body.startswith(("{", PYTHON_TAG))
        if self.holding:
            return ""
        sent = self.opening.space() + body
        self.sent = len(sent)
        return sent

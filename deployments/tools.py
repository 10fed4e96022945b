"""OpenAI function calling: the tools a chat request offers, the grammar that makes its output
one call of them, and the calls read back out of the output.

A forced call is written in Hermes' format (the demo pair's template's, and Qwen's):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. tool_choice "required" or a named
function constrains the output to one call whose arguments follow the function's JSON
schema, through the structured-output machinery (so it is exact under speculation, like any
grammar); "auto" generates freely and reads the calls out of the text in the format of the
router's tool_call_parser (deployments.tool_parsers: Hermes' by default, Llama's JSON,
Mistral's `[TOOL_CALLS]`, the pythonic `[f(x=1)]`); "none" offers no tools (the prompt does
not list them).
"""

import json
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from deployments.pythonic_calls import HeldPythonic
from deployments.tool_parsers import (
    CALL_CLOSE,
    CALL_OPEN,
    HeldContent,
    HeldOpening,
    ToolCallParserName,
    held_content,
    read_call,
    read_calls,
    read_object,
)
from speculative.grammar import JSON_LAYOUT, GrammarError, compile_spec

MAX_TOOLS = 128  # as OpenAI
# a function without parameters takes none (OpenAI): its arguments are {}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class FieldError(ValueError):
    """A request's field refused; `param` names it (OpenAI's style), also where the check
    is the body's own (deployments.ingress.parse reads it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class ToolError(FieldError):
    """A request's tools or tool_choice (or another field of its constraint) refused."""


class ToolFunction(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (an object)
    strict: bool | None = None  # the arguments always follow the schema when constrained


class Tool(BaseModel):
    type: Literal["function"]
    function: ToolFunction


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    """A call in an assistant message sent back with the conversation."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """The call as chat templates take it: arguments as a mapping when they are a JSON
        object (transformers' convention, and vLLM's), else the text as sent."""
        try:
            arguments = json.loads(self.function.arguments)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's limit
            arguments = None
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


def arguments_schema(function: ToolFunction) -> dict:
    """The function's schema as the grammar uses it: an object, laid out as JSON_LAYOUT,
    without its annotations (a tool set's descriptions constrain nothing, yet counted against
    the grammar's size: 40 tools of 1.7 KB each could not be forced)."""
    try:
        schema = without_annotations(function.parameters or NO_PARAMETERS)
    except RecursionError:  # nested past Python's limit: compiling it says so
        schema = dict(function.parameters)
    schema.setdefault("type", "object")
    schema.setdefault("x-guidance", JSON_LAYOUT)
    return schema


# JSON Schema's keywords that only annotate: a schema constrains the same without them
ANNOTATIONS = frozenset({"title", "description", "examples", "$comment", "deprecated",
                         "readOnly", "writeOnly"})
# keywords whose value is a schema, a list of schemas, or names mapped to schemas
SUBSCHEMA = frozenset({"additionalProperties", "additionalItems", "items", "contains", "not",
                       "if", "then", "else", "propertyNames", "unevaluatedProperties",
                       "unevaluatedItems"})
SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                            "dependentSchemas"})


def without_annotations(schema):
    """The schema without ANNOTATIONS at any of its levels; a property's name stays whatever
    it is ("description" included), and so do the values of enum, const and the like."""
    if not isinstance(schema, dict):
        return schema
    kept = {}
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key in SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {name: without_annotations(sub) for name, sub in value.items()}
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            value = [without_annotations(sub) for sub in value]
        elif key in SUBSCHEMA:
            value = without_annotations(value)
        kept[key] = value
    return kept


def check_tools(tools: list[Tool] | None) -> None:
    """ToolError naming the field when a tool's name repeats, its parameters do not describe
    an object, or its text is not valid Unicode. (A schema is compiled only where a call is
    forced: `check_forced`.)"""
    seen = set()
    for i, tool in enumerate(tools or ()):
        function = tool.function
        if function.name in seen:
            raise ToolError(f"tools[{i}].function.name", f"{function.name!r} is offered twice")
        seen.add(function.name)
        try:
            json.dumps(tool.model_dump(), ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ToolError(f"tools[{i}]", "contains text that is not valid Unicode (a lone "
                                           "surrogate?)") from None
        if (function.parameters or {}).get("type", "object") != "object":
            raise ToolError(f"tools[{i}].function.parameters",
                            "must describe an object (the call's arguments)")


def check_forced(tools: list[Tool], forced: tuple["ToolFunction", ...]) -> None:
    """ToolError naming the field when a function whose call is forced has a schema the
    grammar cannot follow (under "auto" or "none" no grammar is built: any schema passes,
    as OpenAI and vLLM take it). The functions compile together, as the grammar of their
    call: one by one, 128 schemas of 1.2 KB that llguidance expands took 74 s of the
    tokenizing thread. When that fails, the function at fault is the first whose addition
    fails, found by halving (8 compiles for 128); if it compiles alone, the set is at fault
    (its grammar's size)."""
    problem = call_problem(forced) if forced else None
    if problem is None:
        return
    good, bad = 0, len(forced)  # the first `good` compile together, the first `bad` do not
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if call_problem(forced[:middle]) is None else (good, middle)
    try:
        compile_spec("json", arguments_schema(forced[bad - 1]), None)
    except GrammarError as error:
        index = next(i for i, tool in enumerate(tools) if tool.function is forced[bad - 1])
        raise ToolError(f"tools[{index}].function.parameters",
                        f"not a JSON schema llguidance can follow: "
                        f"{str(error).removeprefix('json: ')}") from None
    raise ToolError("tool_choice", f"the forced functions together: {problem}")


def call_problem(functions: tuple["ToolFunction", ...]) -> str | None:
    """Why the grammar of a call of one of the functions cannot compile, or None."""
    try:
        compile_spec("grammar", call_grammar(functions), None)
    except GrammarError as error:
        return str(error).removeprefix("grammar: ")
    return None


def tool_use(tools: list[Tool] | None, tool_choice: ToolChoice | None,
             parallel_tool_calls: bool) -> "ToolUse | None":
    """What the request asks of its tools; None when it offers none in effect (no tools, or
    tool_choice "none"). ToolError when tool_choice asks for a tool that is not offered."""
    choice = tool_choice or ("auto" if tools else "none")
    if choice != "none" and choice != "auto" and not tools:
        raise ToolError("tool_choice", "needs tools: none are offered")
    if choice == "none" or not tools:
        return None
    functions = tuple(tool.function for tool in tools)
    if isinstance(choice, NamedToolChoice):
        forced = tuple(f for f in functions if f.name == choice.function.name)
        if not forced:
            raise ToolError("tool_choice", f"names {choice.function.name!r}, which tools "
                                           "does not offer")
    else:
        forced = functions if choice == "required" else ()
    return ToolUse(functions, forced, parallel_tool_calls,
                   named=isinstance(choice, NamedToolChoice))


@dataclass(frozen=True)
class ToolUse:
    functions: tuple[ToolFunction, ...]  # offered: listed in the prompt, callable
    forced: tuple[ToolFunction, ...]  # the output is one call of one of these; () for auto
    parallel: bool  # an auto output may carry several calls
    named: bool = False  # tool_choice named the function
    # the length of the ids written for calls, where the chat template takes no other
    call_id_length: int | None = None
    # the format an "auto" output's calls are read in (the router's tool_call_parser:
    # deployments.tool_parsers); a forced call's is always Hermes', its grammar's
    parser: ToolCallParserName = "hermes"

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (transformers' `tools`: OpenAI's shape)."""
        return [{"type": "function", "function": f.model_dump(exclude_none=True)}
                for f in self.functions]

    def constraint(self) -> tuple[str, str, str] | None:
        """(field, kind, spec) of the grammar of one forced call, as SamplingFields'."""
        return ("tool_choice", "grammar", call_grammar(self.forced)) if self.forced else None

    @property
    def format(self) -> ToolCallParserName:
        """The format the output's calls are read in: Hermes' for a forced call."""
        return "hermes" if self.forced else self.parser

    def read_calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of an output: the calls when every call it holds (in
        `format`) names an offered function with an object of arguments, and the content
        beside them (None when empty); else the whole text and no calls."""
        read = read_calls(self.format, text, {f.name for f in self.functions})
        if read is None:
            return text, []
        content, calls = read
        bodies = [call_body(name, arguments, self.call_id_length) for name, arguments in calls]
        return content, bodies if self.parallel else bodies[:1]

    def held_content(self) -> HeldContent | HeldOpening | HeldPythonic:
        """What holds back a streamed output's content while it may be calls."""
        return held_content(self.format)

    def read(self, text: str, finish_reason: str | None
             ) -> tuple[str | None, list[dict], str | None]:
        """(content, tool_calls, finish_reason) of an output that ended for finish_reason:
        read_calls', and OpenAI's (and vLLM's) reason: "tool_calls" when the output called
        tools, but the output's own for a call tool_choice named (the model did not choose
        it: "stop") and for a forced call cut short ("length": cut_call's)."""
        if self.forced and (cut := self.cut_call(text)):
            return None, cut, finish_reason
        content, calls = self.read_calls(text)
        return content, calls, "tool_calls" if calls and not self.named else finish_reason

    def cut_call(self, text: str) -> list[dict]:
        """A forced call the output ended inside (max_tokens, or a stop string): the function
        and its arguments as far as they came, as OpenAI and vLLM return a cut call; [] for
        a whole call, or where the text does not tell which function it began."""
        begun = []
        for function in self.forced:
            head = CALL_OPEN + call_head(function.name)
            if text.startswith(head) or head.startswith(text):
                begun.append((function.name, text[len(head):]))
        if len(begun) != 1 or read_call(text, len(CALL_OPEN)) is not None:
            return []
        name, arguments = begun[0]
        # cut within its `</tool_call>`: the arguments came whole, the markup after is none
        whole = read_object(text, len(CALL_OPEN), ("arguments",))
        if whole is not None and CALL_CLOSE.startswith(text[whole[1]:].lstrip()):
            arguments = whole[0][1]
        return [call_body(name, arguments, self.call_id_length)]


def call_grammar(functions: tuple[ToolFunction, ...]) -> str:
    """A Lark grammar (llguidance's dialect) of one call of one of the functions, its
    arguments following the function's schema (%json), laid out as the template writes it."""
    lines = [f"start: {json.dumps(CALL_OPEN)} call {json.dumps(CALL_CLOSE)}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        lines.append(f'call_{i}: {json.dumps(call_head(function.name))} arguments_{i} "}}"')
        lines.append(f"arguments_{i}: %json {json.dumps(arguments_schema(function))}")
    return "\n".join(lines) + "\n"


def call_head(name: str) -> str:
    """A forced call's text before its arguments, as the grammar writes it."""
    return f'{{"name": {json.dumps(name)}, "arguments": '


def call_body(name: str, arguments: str, id_length: int | None = None) -> dict:
    """A call in a response message (OpenAI's shape: the arguments as JSON text); its id
    OpenAI's, or id_length letters and digits where the chat template takes no other."""
    call_id = uuid.uuid4().hex[:id_length] if id_length else f"call_{uuid.uuid4().hex[:24]}"
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def call_deltas(calls: list[dict]) -> list[dict]:
    """The calls as one stream delta carries them whole (each with its index)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]

"""Function calling's edges that the main tests left open (found by mutation): streamed
calls keep their own index, annotations go from every kind of subschema, a forced call's
arguments stay an object where the schema omits "type", a call's arguments are its own
(not a same-named key nested before them), and a v11 Mistral call may space its `[ARGS]`."""

import pytest

from deployments.openai_api import ChatCompletionRequest
from deployments.tool_parsers import read_hermes, read_mistral
from deployments.tools import ToolFunction, arguments_schema, call_body, call_deltas, call_grammar
from speculative.grammar import compile_spec, ll_tokenizer
from tests.unit.test_tools import follows, tokenizer  # noqa: F401 (a fixture)

NAMES = {"get_weather", "now"}


def test_streamed_calls_each_keep_their_own_index():
    """A client merges a stream's call deltas by index: two calls under one index read as
    one call whose name and arguments are the two run together."""
    calls = [call_body("get_weather", '{"city": "Paris"}'), call_body("now", "{}")]
    deltas = call_deltas(calls)
    assert [delta["index"] for delta in deltas] == [0, 1]
    assert [{k: v for k, v in delta.items() if k != "index"} for delta in deltas] == calls


def test_annotations_go_from_every_kind_of_subschema():
    """A forced tool set's descriptions count against its grammar's size wherever they sit:
    under items, additionalProperties, not, if/then/else as well as under properties."""
    note = {"description": "x" * 50, "title": "t", "examples": ["e"]}
    parameters = {"type": "object", "description": "top",
                  "properties": {"tags": {"type": "array",
                                          "items": {"type": "string", **note}}},
                  "additionalProperties": {"type": "integer", **note},
                  "not": {"required": ["forbidden"], **note},
                  "if": {"required": ["a"], **note}, "then": {"required": ["b"], **note}}
    schema = arguments_schema(ToolFunction(name="f", parameters=parameters))
    assert "description" not in str(schema) and "examples" not in str(schema)
    assert schema["properties"]["tags"]["items"] == {"type": "string"}
    assert schema["additionalProperties"] == {"type": "integer"}
    assert schema["not"] == {"required": ["forbidden"]}


def test_a_forced_call_of_a_schema_without_type_takes_only_an_object(tokenizer):  # noqa: F811
    """OpenAI's arguments are an object: a schema that lists properties but omits "type"
    still forces one, else the model could write `"arguments": 3`, which no reader takes as
    a call (the client would get markup as content under tool_choice "required")."""
    parameters = {"properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "n?"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]})
    ll = ll_tokenizer(tokenizer, 4096)
    grammar = compile_spec("grammar", call_grammar(body.tool_use().forced), ll)
    assert follows(ll, grammar, tokenizer, '<tool_call>{"name": "f", "arguments": {"n": 3}}'
                                           '</tool_call>')
    for wrong in ("3", '"three"', "[3]"):
        text = '<tool_call>{"name": "f", "arguments": ' + wrong + "}</tool_call>"
        assert not follows(ll, grammar, tokenizer, text), wrong


@pytest.mark.parametrize("call", [
    '{"name": "get_weather", "meta": {"arguments": {"x": 1}}, "arguments": {"city": "Paris"}}',
    '{"name": "get_weather", "arguments": {"x": 1}, "arguments": {"city": "Paris"}}'])
def test_the_arguments_returned_are_the_calls_own(call):
    """The arguments' own text is returned where it is the object the call decodes to; a key
    "arguments" met first elsewhere (nested, or repeated: JSON's last one counts) is not."""
    content, calls = read_hermes(f"<tool_call>{call}</tool_call>", NAMES)
    assert content is None and calls == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS]get_weather[ARGS] {"city": "Paris"}',
    '[TOOL_CALLS] get_weather [ARGS]\n{"city": "Paris"}',
    '[TOOL_CALLS]get_weather {"city": "Paris"}'])  # [ARGS] skipped as a special token
def test_a_v11_mistral_call_may_space_its_arguments(text):
    assert read_mistral(text, NAMES) == (None, [("get_weather", '{"city": "Paris"}')])

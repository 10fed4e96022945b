"""Function calling without Ray: tools and tool_choice refused with the field named; the
grammar of a forced call accepts what the chat template writes and what read_calls reads
back; messages carry calls and results, and the demo template renders tools, calls and tool
results. Calls read out of an output, whole and streamed: test_tools_reading."""

import json

import jsonschema
import pytest
from pydantic import ValidationError

from deployments import tools as tools_module
from deployments.openai_api import ChatCompletionRequest, ChatMessage
from deployments.tools import (
    CALL_OPEN,
    ToolError,
    call_grammar,
    call_head,
    check_forced,
    check_tools,
)
from engine.models import DEMO_TARGET, load_tokenizer
from speculative.grammar import compile_spec, ll_tokenizer
from speculative.token_masks import TokenMasks

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": ' \
       '"celsius"}}</tool_call>'


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_TARGET)


@pytest.mark.parametrize("parameters, field", [
    ({"type": "nonsense"}, "tools[0].function.parameters"),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "tools[0].function.parameters"),
    ({"type": "string"}, "tools[0].function.parameters"),
])
def test_bad_parameter_schemas_name_their_field(parameters, field):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(ToolError) as refused:
        body = request(tools=tools, tool_choice="required")
        check_tools(body.tools)
        check_forced(body.tools, body.tool_use().forced)
    assert refused.value.param == field


@pytest.mark.parametrize("choice", ["auto", "none", "named"])
def test_a_schema_the_grammar_cannot_follow_is_taken_where_no_call_is_forced(choice):
    """OpenAI and vLLM take any schema under auto (uniqueItems, not, ...): only a forced call
    compiles one."""
    free = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True},
                                             "x": {"not": {"type": "null"}}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": free}}, TOOLS[1]]
    body = request(tools=tools, tool_choice={"type": "function", "function": {"name": "now"}}
                   if choice == "named" else choice)
    check_tools(body.tools)
    use = body.tool_use()
    check_forced(body.tools, use.forced if use else ())
    with pytest.raises(ToolError) as refused:
        check_forced(body.tools, tuple(tool.function for tool in body.tools))
    assert refused.value.param == "tools[0].function.parameters"


def test_forced_functions_compile_once_and_the_one_at_fault_is_named(monkeypatch):
    """Each of 128 forced functions compiled alone took 74 s of the tokenizing thread for
    one request (a kilobyte of schema that llguidance expands costs 0.5 s): they compile
    once, as the grammar of their call; when that fails, halving finds the function at
    fault in 9 compiles more at most (its own compile among them)."""
    compiled, real = [], tools_module.compile_spec
    monkeypatch.setattr(tools_module, "compile_spec",
                        lambda kind, *rest: compiled.append(kind) or real(kind, *rest))
    fine = {"type": "object", "properties": {"a": {"type": "string"}}}
    offered = [{"type": "function", "function": {"name": f"f{i}", "parameters": fine}}
               for i in range(128)]
    body = request(tools=offered, tool_choice="required")
    check_forced(body.tools, body.tool_use().forced)
    assert compiled == ["grammar"]
    offered[77] = {"type": "function", "function": {"name": "f77", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}
    for choice in ("required", {"type": "function", "function": {"name": "f77"}}):
        body = request(tools=offered, tool_choice=choice)
        compiled.clear()
        with pytest.raises(ToolError, match="strin") as refused:
            check_forced(body.tools, body.tool_use().forced)
        assert refused.value.param == "tools[77].function.parameters"
        assert len(compiled) <= 10 and compiled[-1] == "json"
    long = {"type": "object", "properties": {f"p{i}": {"enum": ["x" * 20]} for i in range(60)}}
    body = request(tools=[{"type": "function", "function": {"name": f"f{i}", "parameters": long}}
                          for i in range(40)], tool_choice="required")
    with pytest.raises(ToolError, match="together") as refused:  # each compiles alone
        check_forced(body.tools, body.tool_use().forced)
    assert refused.value.param == "tool_choice"


def test_a_repeated_name_and_a_bad_name_are_refused():
    with pytest.raises(ToolError) as refused:
        check_tools(request(tools=[TOOLS[0], TOOLS[0]]).tools)
    assert refused.value.param == "tools[1].function.name"
    with pytest.raises(ValidationError):
        request(tools=[{"type": "function", "function": {"name": "has space"}}])
    check_tools(request(tools=TOOLS).tools)


@pytest.mark.parametrize("fields", [
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}},
])
def test_a_tool_choice_that_asks_for_what_is_not_offered_is_refused(fields):
    with pytest.raises(ToolError) as refused:
        request(**fields).tool_use()
    assert refused.value.param == "tool_choice"


def test_tool_choice_decides_what_is_in_effect():
    assert request().tool_use() is None
    assert request(tools=TOOLS, tool_choice="none").tool_use() is None
    assert request(tool_choice="auto").tool_use() is None
    auto = request(tools=TOOLS).tool_use()
    assert auto.forced == () and auto.constraint() is None
    assert [f.name for f in request(tools=TOOLS, tool_choice="required").tool_use().forced] \
        == ["get_weather", "now"]
    named = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert [f.name for f in named.tool_use().forced] == ["now"]
    # OpenAI's finish_reason: "tool_calls" when the model called, "stop" for a named call
    call = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    assert named.tool_use().read(call, "stop")[2] == "stop"
    assert request(tools=TOOLS, tool_choice="required").tool_use().read(call, "stop")[2] \
        == auto.read(call, "stop")[2] == auto.read(call, "length")[2] == "tool_calls"
    assert auto.read("no call", "length")[2] == "length"
    assert named.constraint()[:2] == ("tool_choice", "grammar")
    with pytest.raises(ToolError, match="not both") as refused:
        request(tools=TOOLS, tool_choice="required",
                response_format={"type": "json_object"}).constraint()
    assert refused.value.param == "tool_choice"


def follows(ll, grammar: str, tokenizer, text: str) -> bool:
    """Whether the grammar takes all of text's tokens and is then done."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    masks = TokenMasks(ll, grammar)
    return masks.advance(ids) == len(ids) and masks.matcher.is_accepting()


def test_the_forced_grammar_takes_a_valid_call_and_read_calls_reads_it_back(tokenizer):
    ll = ll_tokenizer(tokenizer, 4096)
    use = request(tools=TOOLS, tool_choice="required").tool_use()
    grammar = compile_spec("grammar", call_grammar(use.forced), ll)
    assert follows(ll, grammar, tokenizer, CALL)
    assert follows(ll, grammar, tokenizer, '<tool_call>{"name": "now", "arguments": {}}'
                                           '</tool_call>')
    for wrong in [CALL.replace("celsius", "kelvin"), CALL.replace('": "', '":"'),
                  CALL.replace("get_weather", "get_wether"), "Sure. " + CALL]:
        assert not follows(ll, grammar, tokenizer, wrong), wrong
    content, calls = use.read_calls(CALL)
    assert content is None and len(calls) == 1
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER)
    assert CALL == '<tool_call>{"name": "get_weather", "arguments": ' \
        f'{calls[0]["function"]["arguments"]}}}</tool_call>'


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice, text, arguments", [
    (NAMED, CALL[:-20], '{"city": "Paris", "unit": "ce'),  # max_tokens within the arguments
    # within its `</tool_call>`, or before the call's closing brace: the arguments whole,
    # without the markup after them
    ("required", CALL[:-3], CALL[CALL.index('{"city"'):-len("}</tool_call>")]),
    (NAMED, CALL[:-5], '{"city": "Paris", "unit": "celsius"}'),
    ("required", CALL[:-13], '{"city": "Paris", "unit": "celsius"}'),
    ("required", CALL_OPEN + call_head("get_weather"), ""),  # the head, no arguments yet
    (NAMED, CALL_OPEN + '{"na', ""),  # within the head: the named function's
    ("required", CALL_OPEN + '{"name": "', None)])  # which function, the text does not say
def test_a_forced_call_cut_short_is_a_call_with_its_arguments_so_far(choice, text, arguments):
    """OpenAI (and vLLM, for a named call) return a forced call max_tokens cut short as a
    call whose arguments end where the output did, with finish_reason "length"; its
    markup went out as content."""
    use = request(tools=TOOLS, tool_choice=choice).tool_use()
    content, calls, finish_reason = use.read(text, "length")
    assert finish_reason == "length"
    if arguments is None:
        assert (content, calls) == (text, [])
    else:
        assert content is None and [call["function"] for call in calls] == \
            [{"name": "get_weather", "arguments": arguments}]


def test_a_large_tool_set_is_forced_without_its_annotations(tokenizer):
    """Forty tools with long descriptions (an agent's) hold 68 KB of schema: their grammar
    leaves out what only annotates (descriptions, titles, examples), so a forced call
    compiles under the grammar's size bound and follows the same calls; a property named
    "description" is still a property."""
    described = {"type": "object", "description": "x" * 1500, "title": "Arguments",
                 "properties": {"description": {"type": "string", "maxLength": 8,
                                                "description": "y" * 200},
                                "unit": {"enum": ["celsius", "fahrenheit"],
                                         "examples": ["celsius"]}},
                 "required": ["description", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": described}}
             for i in range(40)]
    assert len(json.dumps(tools)) > 64 * 1024
    body = request(tools=tools, tool_choice="required")
    check_forced(body.tools, body.tool_use().forced)
    ll = ll_tokenizer(tokenizer, 4096)
    grammar = compile_spec("grammar", call_grammar(body.tool_use().forced), ll)
    call = '<tool_call>{"name": "f7", "arguments": {"description": "short", ' \
           '"unit": "celsius"}}</tool_call>'
    assert follows(ll, grammar, tokenizer, call)
    for wrong in [call.replace("celsius", "kelvin"), call.replace("short", "far too long"),
                  call.replace('"description": "short", ', "")]:
        assert not follows(ll, grammar, tokenizer, wrong), wrong


def test_messages_carry_calls_and_results():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    message = ChatMessage.model_validate({"role": "assistant", "content": None,
                                          "tool_calls": [call]})
    assert message.for_template()["tool_calls"][0]["function"]["arguments"] == \
        {"city": "Paris"}
    for bad in [{"role": "assistant", "content": None}, {"role": "tool", "content": "12"},
                {"role": "user", "content": "x", "tool_calls": [call]}]:
        with pytest.raises(ValidationError):
            ChatMessage.model_validate(bad)


def test_the_demo_template_renders_tools_calls_and_results(tokenizer):
    use = request(tools=TOOLS).tool_use()
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]
    messages = [ChatMessage.model_validate(m).for_template() for m in messages]
    text = tokenizer.apply_chat_template(messages, tools=use.template_tools(), tokenize=False,
                                         add_generation_prompt=True)
    functions = [json.dumps(tool["function"]) for tool in TOOLS]
    assert text == (
        '# tools: call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>\n'
        f"# {functions[0]}\n# {functions[1]}\n"
        "# user: Weather in Paris?\n"
        f"# assistant: {CALL}\n"
        "# tool: 12 C\n"
        "# assistant:\n")
    assert tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True) == \
        "# user: Weather in Paris?\n# assistant:\n"

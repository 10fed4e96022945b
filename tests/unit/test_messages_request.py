"""A Messages request read into the chat it asks for, as vLLM translates it (system and
text blocks joined, tool_use and tool_result blocks as the chat's calls and tool messages,
thinking blocks dropped, tool_choice's kinds), and what is refused: a 400 in Anthropic's
shape naming the Messages' field, whatever the body holds. Answered: test_messages_api."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.ingress import BadRequest, parse
from deployments.messages_api import CountTokensRequest, MessagesRequest, renamed
from deployments.openai_api import ChatCompletionRequest
from deployments.prompts import PromptReader
from tests.unit.test_chat_prompts import qwen_like_reader
from tests.unit.test_messages_api import HI, TOOLS, created, messages_router, posted_to
from tests.unit.test_responses_api import CALL
from tests.unit.test_router_parts import posted


def chat_of(body: dict) -> ChatCompletionRequest:
    asked = asyncio.run(parse(posted({"model": "m", "max_tokens": 9, **body}),
                              MessagesRequest, 1 << 16))
    return asked.chat_request()[0]


def test_a_request_becomes_the_chat_vllm_translates_it_to():
    """System blocks joined (Claude Code's billing header dropped), text blocks joined by
    newlines, a user's tool results first, thinking blocks dropped, the fields renamed."""
    chat = chat_of({
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                   {"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "toolu_1", "name": "now", "input": {"tz": "UTC"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "noon"}]},
                {"type": "text", "text": "and so?"}]}],
        "stop_sequences": ["\n\n"], "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "u"}, "seed": 3, "num_speculative_tokens": 2})
    messages = [m.for_template() for m in chat.messages]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[0]["content"] == "be brief" and messages[1]["content"] == "a\nb"
    assert messages[2]["content"] == "let me look"
    assert messages[2]["tool_calls"] == [{"id": "toolu_1", "type": "function", "function": {
        "name": "now", "arguments": {"tz": "UTC"}}}]
    assert (messages[3]["tool_call_id"], messages[3]["content"]) == ("toolu_1", "noon")
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k) == (
        9, ["\n\n"], 0.5, 0.9, 5)
    assert chat.tools[0].function.parameters == TOOLS[0]["input_schema"]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert (chat.seed, chat.num_speculative_tokens) == (3, 2)
    named = chat_of({"messages": HI, "tools": TOOLS,
                     "tool_choice": {"type": "tool", "name": "now"}})
    assert named.tool_choice.function.name == "now" and named.parallel_tool_calls is True
    assert chat_of({"messages": HI, "tools": TOOLS, "tool_choice": {"type": "none"}}
                   ).tool_choice == "none"


TOOL_TEMPLATE = (  # writes calls and results, as a tool-calling family's template does
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}{{- '<tool_call>' + call.function.name + ' '"
    " + call.function.arguments | tojson + ' ' + call.id + '</tool_call>' }}{%- endfor %}"
    "{%- if message.role == 'tool' %}{{- ' for ' + message.tool_call_id }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_tool_result_sent_back_renders_after_its_call():
    """An answer's tool_use block and the client's tool_result for it, sent back: rendered
    as the chat's call and tool message, its id kept."""
    reader = qwen_like_reader()
    reader.tokenizer.chat_template = TOOL_TEMPLATE
    answer = created(messages_router("sure" + CALL), tools=TOOLS)
    call = answer.content[1]
    chat = chat_of({"tools": TOOLS, "messages": [
        *HI, {"role": "assistant", "content": [block.model_dump() for block in answer.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "noon"}]}]})
    text = reader.tokenizer.decode(reader.token_ids(chat, chat=True))
    assert (f"<|im_start|>assistant\nsure<tool_call>now {{\"tz\": \"UTC\"}} {call.id}"
            f"</tool_call><|im_end|>\n<|im_start|>tool\nnoon for {call.id}<|im_end|>\n"
            "<|im_start|>assistant\n") in text


@pytest.mark.parametrize("body, named", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image"}]}]}]},
     "messages[0].content[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role"),
    ({"system": [{"type": "image"}]}, "system[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "later"}}, "tool_choice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "now"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools"),
    ({"stop_sequences": "\n"}, "stop_sequences"),
    ({"temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}]},
     "messages[1]"),
    # an empty block list, as vLLM refuses it (it named `messages` whole, or went unseen)
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [*HI, {"role": "assistant", "content": []}]}, "messages[1].content"),
    # a boolean, not a text whose truth Python reads ("false" disabled parallel calls)
    ({"tools": TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": "false"}},
     "tool_choice.disable_parallel_tool_use"),
])
def test_a_refusal_is_a_400_in_anthropics_shape_naming_the_field(body, named):
    status, answer = posted_to(messages_router(), {k: v for k, v in {
        "model": "m", "max_tokens": 10, "messages": HI, **body}.items() if v is not None})
    assert status == 400 and answer["type"] == "error"
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"].startswith(named)


@pytest.mark.parametrize("other", [{"tools": TOOLS, "tool_choice": {"type": "any"}},
                                   {"structured_outputs": {"regex": "a+"}}])
def test_a_refusal_of_two_constraints_names_output_config_not_response_format(other):
    """The chat's refusal of two constraints (the router's, from the prompt's reading)
    named response_format in its text, which a Messages request has not: it is
    output_config.format."""
    asked = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 10, "messages": HI, **other,
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    chat, places = asked.chat_request()
    with pytest.raises(BadRequest) as refused:
        PromptReader.constraint(None, chat)
    message = str(renamed(refused.value, places))
    assert "output_config.format" in message and "response_format" not in message


def test_a_count_tokens_body_needs_no_max_tokens():
    asked = asyncio.run(parse(posted({"model": "m", "messages": HI}), CountTokensRequest,
                              1 << 16))
    assert [m.for_template() for m in asked.chat_request()[0].messages] == HI
    with pytest.raises(BadRequest):
        asyncio.run(parse(posted({"model": "m", "messages": HI}), MessagesRequest, 1 << 16))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) |
                    st.dictionaries(st.sampled_from(["type", "text", "id", "name", "input",
                                                     "content", "tool_use_id", "role"]),
                                    inner, max_size=4), max_leaves=12)
BLOCK = st.fixed_dictionaries({"type": st.sampled_from(
    ["text", "tool_use", "tool_result", "thinking", "image"])}, optional={
    "text": JSON, "id": JSON, "name": JSON, "input": JSON, "content": JSON,
    "tool_use_id": JSON})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system",
                                                                 "x"]),
                                       "content": st.one_of(st.text(max_size=5),
                                                            st.lists(BLOCK, max_size=3),
                                                            JSON)}), max_size=3),
       st.one_of(st.none(), JSON), st.one_of(st.none(), JSON), st.one_of(st.none(), JSON))
def test_any_body_is_a_chat_request_or_a_refusal(messages, system, tools, tool_choice):
    """Whatever its messages, system, tools and tool_choice hold: a chat request, or a
    BadRequest (never another error: the fuzzer's 500)."""
    body = {"model": "m", "max_tokens": 5, "messages": messages, "system": system,
            "tools": tools, "tool_choice": tool_choice}
    try:
        asked = asyncio.run(parse(posted(body), MessagesRequest, 1 << 16))
        assert isinstance(asked.chat_request()[0], ChatCompletionRequest)
    except BadRequest as error:
        assert error.status == 400

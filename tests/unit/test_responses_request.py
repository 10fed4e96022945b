"""OpenAI's Responses API (`POST /v1/responses`): a request read into the chat it asks for
(each input form, instructions, tools, text.format, the fields refused with their names, the
chat's own names in a refusal renamed to the Responses API's)."""

import asyncio

import pytest

from deployments.ingress import BadRequest, parse
from deployments.responses_api import ResponsesRequest, renamed
from deployments.responses_events import answer_shape
from tests.unit.test_responses_api import TOOLS
from tests.unit.test_router_parts import posted


def chat_of(body: dict):
    """The chat request a Responses body asks for (BadRequest as the router answers)."""
    asked = asyncio.run(parse(posted(body), ResponsesRequest, 1 << 16))
    return answer_shape(asked, "m").body


def refusal(body: dict) -> BadRequest:
    with pytest.raises(BadRequest) as refused:
        chat_of(body)
    return refused.value


def test_a_text_input_is_one_user_message_after_the_instructions():
    chat = chat_of({"model": "m", "input": "hi", "instructions": "be brief",
                    "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9})
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (chat.max_tokens, chat.temperature, chat.top_p) == (7, 0.5, 0.9)


def test_items_become_messages_calls_and_tool_results():
    """Messages of each role (text parts joined), an answer's function_call items as the
    assistant's tool_calls (with the message before them), function_call_output as a tool
    message; reasoning items dropped."""
    chat = chat_of({"input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "now", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "noon"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "midnight"}]}]})
    messages = [m.for_template() for m in chat.messages]
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "a\nb" and messages[2]["content"] == "let me look"
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "now", "arguments": {}}
    assert [(m["tool_call_id"], m["content"]) for m in messages[3:]] == [
        ("c1", "noon"), ("c2", "midnight")]


def test_tools_choice_format_and_extensions_become_the_chats():
    chat = chat_of({"input": "hi", "tools": TOOLS, "parallel_tool_calls": False,
                    "tool_choice": {"type": "function", "name": "now"}, "seed": 3,
                    "top_k": 5, "num_speculative_tokens": 2, "store": True,
                    "metadata": {"k": "v"}, "user": "u", "some_new_field": 1,
                    "include": ["message.output_text.logprobs"], "top_logprobs": 2})
    function = chat.tools[0].function
    assert (function.name, function.description) == ("now", "the time")
    assert function.parameters == TOOLS[0]["parameters"]
    assert chat.tool_choice.function.name == "now" and chat.parallel_tool_calls is False
    assert (chat.seed, chat.top_k, chat.num_speculative_tokens) == (3, 5, 2)
    assert chat_of({"input": "hi", "prompt_cache_key": "conv-1"}).prompt_cache_key == "conv-1"
    masked = chat_of({"input": "hi", "bad_words": ["Paris"], "allowed_token_ids": [5, 6],
                      "return_tokens_as_token_ids": True})  # vLLM's, as the chat takes them
    assert (masked.bad_words, masked.allowed_token_ids) == (["Paris"], [5, 6])
    assert masked.return_tokens_as_token_ids is True
    assert chat.top_logprobs_asked() == 2
    assert chat_of({"input": "hi", "prompt_logprobs": None, "return_token_ids": False}
                   ).prompt_logprobs is None  # their defaults ask for nothing
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formed = chat_of({"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "a", "schema": schema, "strict": True}}})
    assert formed.response_format.json_schema.schema_ == schema
    assert formed.constraint() == ("response_format.json_schema", "json", schema)
    assert chat_of({"input": "hi", "text": {"format": {"type": "json_object"}}}
                   ).constraint()[1] == "json"
    assert chat_of({"input": "hi", "text": {"format": {"type": "text"}}}).constraint() is None


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"conversation": {"name": "conv_1"}}, "conversation.id"),  # (served: its id)
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "middle"}, "truncation"),  # (auto is served: test_truncation)
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "a"}]}]},
     "input[0].content[0]"),  # a type that is no string: not a 500 (unhashable)
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "now"}]}, "input[0].call_id"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": 5}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": 5, "schema": {}}}}, "text.format.name"),
    ({"top_logprobs": 50}, "top_logprobs"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
    ({"input": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}]},
     "input[1]"),
    ({"input": "hi", "instructions": "\ud800"}, "instructions"),
    ({"metadata": {"a": "\ud800"}}, "metadata"),  # echoed: its answer's JSON (was a 500)
    ({"metadata": {"\ud800": "a"}}, "metadata"),
    ({"user": "\udfff"}, "user"),
    # the rest of what the Response echoes (text.format's texts, tool_choice's): was a 500
    # (a stream: dropped), since the Response's JSON could not be encoded
    ({"text": {"format": {"type": "json_schema", "name": "\ud800", "schema": {}}}},
     "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "description": "\ud800",
                          "schema": {}}}}, "text.format.description"),
    ({"text": {"format": {"type": "json_object", "x": ["\ud800"]}}}, "text.format.x[0]"),
    ({"text": {"format": {"type": "text", "\ud800": 1}}}, "text.format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "now", "x": "\ud800"}},
     "tool_choice.x"),
    # ... and the NaN and Infinity Python's JSON reads (JSON has neither): a 500 too
    ({"text": {"format": {"type": "json_object", "x": float("nan")}}}, "text.format.x"),
    ({"tools": [{**TOOLS[0], "x": [float("inf")]}]}, "tools[0].x[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "now",
                                      "x": float("-inf")}}, "tool_choice.x"),
    # vLLM's, which the chat serves: a Response has no field for them (they were dropped)
    ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"return_token_ids": True}, "return_token_ids"),
])
def test_a_refused_field_is_named_as_the_responses_api_names_it(body, param):
    refused = refusal({"input": "hi", **body})
    assert refused.status == 400 and refused.param == param
    assert "max_tokens" not in str(refused) and "messages" not in str(refused)


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "\ud800"}, "previous_response_id"),
    ({"conversation": "\udfff"}, "conversation"),
    ({"conversation": {"id": "\ud800"}}, "conversation.id"),
])
def test_an_unencodable_id_to_look_up_is_refused_as_it_is_read(body, param):
    """An id the store's 404 would name (and the Response echo): its refusal as the body
    is read, before any store (its 404's text could not be encoded: a 500 in no error
    shape, as the error's own log line failed)."""
    with pytest.raises(BadRequest) as refused:
        asyncio.run(parse(posted({"input": "hi", **body}), ResponsesRequest, 1 << 16))
    assert refused.value.status == 400 and refused.value.param == param


def test_no_input_is_refused_naming_it():
    assert refusal({"model": "m"}).param == "input"


def test_the_chats_own_names_in_a_refusal_are_renamed():
    error = BadRequest("tools[0].function.parameters: must describe an object",
                       param="tools[0].function.parameters")
    assert (str(renamed(error)), renamed(error).param) == (
        "tools[0].parameters: must describe an object", "tools[0].parameters")
    cut = renamed(BadRequest("the prompt (9 tokens) plus max_tokens (9) exceed the context "
                             "limit of 16", param="max_tokens"))
    assert cut.param == "max_output_tokens" and "plus max_output_tokens (9)" in str(cut)
    both = renamed(BadRequest("give one constraint: response_format or one field of "
                              "structured_outputs"))
    assert "text.format or one field of structured_outputs" in str(both)

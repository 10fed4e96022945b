"""Edges of Anthropic's Messages API: a request's blocks as the chat's messages (a tool
result's text blocks, an assistant's empty text blocks, a tool's strict flag), and what the
official client reads of the answers: the usage with tokens read from the prefix cache, the
stop reason of a stop token id, refusals' messages (the field named, the API key's help)."""

import json

from fastapi.responses import JSONResponse

from deployments.messages_events import (
    AsMessage,
    MessageStream,
    anthropic_error,
    message_usage,
    stop_of,
)
from tests.unit.test_messages_api import HI, TOOLS
from tests.unit.test_messages_request import chat_of


def test_prompt_tokens_read_from_the_cache_are_cache_reads_not_input_tokens():
    usage = message_usage({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                           "prompt_tokens_details": {"cached_tokens": 4}})
    assert usage == {"input_tokens": 6, "output_tokens": 3,
                     "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4}
    assert message_usage(None)["input_tokens"] == 0


def test_a_stop_token_id_is_no_stop_sequence_and_the_limit_wins_over_a_call():
    """vLLM's stop_reason is the stop token id (an int) or the stop string: only a string is
    Anthropic's stop_sequence."""
    assert stop_of("stop", 0, called=False) == ("end_turn", None)
    assert stop_of("stop", None, called=False) == ("end_turn", None)
    assert stop_of("stop", "\n\n", called=False) == ("stop_sequence", "\n\n")
    assert stop_of("stop", 0, called=True) == ("tool_use", None)
    assert stop_of("length", None, called=True) == ("max_tokens", None)  # the limit first


def refused(message: str, status: int, param: str | None = None) -> tuple[int, dict]:
    answer = anthropic_error(JSONResponse({"error": {
        "message": message, "type": "invalid_request_error", "param": param, "code": None}},
        status, headers={"retry-after": "1"}))
    return answer.status_code, json.loads(answer.body)


def test_a_refusal_names_its_field_in_the_message_anthropic_has_no_param_for():
    status, body = refused("must be at least 1", 400, "max_tokens")
    assert status == 400 and body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: must be at least 1"}}
    named = refused("max_tokens: must be at least 1", 400, "max_tokens")[1]
    assert named["error"]["message"] == "max_tokens: must be at least 1"  # not twice


def test_a_401_says_how_to_send_the_api_key():
    status, body = refused("invalid or missing API key", 401)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert "x-api-key" in body["error"]["message"]


def test_tool_result_texts_are_joined_by_newlines_and_empty_assistant_text_is_dropped():
    chat = chat_of({"messages": [*HI, {"role": "assistant", "content": [
        {"type": "text", "text": ""}, {"type": "text", "text": "let me look"},
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "toolu_1", "name": "now", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "noon"},
                                                  {"type": "text", "text": "UTC"}]}]}]})
    messages = [m.for_template() for m in chat.messages]
    assert messages[1]["content"] == "let me look"
    assert (messages[2]["role"], messages[2]["content"]) == ("tool", "noon\nUTC")
    calls_only = chat_of({"messages": [*HI, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "now", "input": {}}]}]})
    assert calls_only.messages[1].content is None  # no text: no content, as vLLM's


def test_a_tools_strict_flag_reaches_the_chats_tool():
    """The template is given the tool as the chat's (strict included, as vLLM passes it)."""
    chat = chat_of({"messages": HI, "tools": [{**TOOLS[0], "strict": True}]})
    assert chat.tools[0].function.strict is True
    assert chat_of({"messages": HI, "tools": TOOLS}).tools[0].function.strict is None


def test_a_streamed_errors_type_is_anthropics():
    """The chat stream's error type (OpenAI's) as Anthropic's: admission full a
    rate_limit_error, a server error an api_error, else invalid_request_error."""
    stream = MessageStream(AsMessage(None, []))
    kinds = []
    for kind in ("requests", "server_error", "invalid_request_error"):
        [event] = stream.feed({"error": {"message": "no", "type": kind}})
        kinds.append(json.loads(event.split("\n")[1].removeprefix("data: "))["error"]["type"])
    assert kinds == ["rate_limit_error", "api_error", "invalid_request_error"]

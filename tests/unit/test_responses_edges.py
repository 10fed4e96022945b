"""Edges of OpenAI's Responses API: a request's fields the chat takes (a tool's strict
flag, a refusal part sent back), and what the official client reads of the answers: the
usage's details, the request's fields echoed on the Response, a function call's streamed
item and an error event's code. The main paths: test_responses_api, test_responses_request."""

import json

from openai.types.responses import Response

from deployments.responses_api import ResponsesRequest
from deployments.responses_events import AsResponse, ResponseStream, response_usage
from tests.unit.test_responses_api import CALL, EVENTS, TOOLS, answered, streamed
from tests.unit.test_responses_request import chat_of


def test_the_usage_carries_the_cached_and_reasoning_tokens_in_the_responses_names():
    usage = response_usage({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                            "prompt_tokens_details": {"cached_tokens": 4},
                            "completion_tokens_details": {"reasoning_tokens": 3}})
    assert usage == {"input_tokens": 10,
                     "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                     "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 3},
                     "total_tokens": 15}
    bare = response_usage({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    assert bare["input_tokens_details"]["cached_tokens"] == 0
    assert bare["output_tokens_details"]["reasoning_tokens"] == 0


def test_the_response_echoes_the_requests_fields_and_its_defaults():
    """tool_choice auto where none was given, parallel_tool_calls and user as asked, store
    false where no store keeps it; completed_at only once completed."""
    body = answered("Paris.", {"parallel_tool_calls": False, "user": "u-1", "store": True})
    response = Response.model_validate(body)
    assert (response.tool_choice, response.parallel_tool_calls, response.user) == (
        "auto", False, "u-1")
    assert body["store"] is False and body["completed_at"] >= body["created_at"]
    cut = answered("Paris is the capital.", {"max_output_tokens": 3})
    assert cut["status"] == "incomplete" and cut["completed_at"] is None
    forced = answered("Paris.", {"tools": TOOLS, "tool_choice": "required"})
    assert forced["tool_choice"] == "required"


def test_the_response_echoes_the_text_format_and_top_logprobs_asked_for():
    form = {"type": "json_schema", "name": "city", "schema": {"type": "object"}}
    asked = ResponsesRequest(input="hi", text={"format": form}, top_logprobs=2)
    response = AsResponse(None, asked, [], "m").response("completed", [])
    assert (response["text"], response["top_logprobs"]) == ({"format": form}, 2)
    Response.model_validate(response)
    plain = AsResponse(None, ResponsesRequest(input="hi"), [], "m").response("completed", [])
    assert (plain["text"], plain["top_logprobs"]) == ({"format": {"type": "text"}}, None)


def test_a_streamed_call_item_is_added_with_no_arguments_and_done_with_them():
    events = streamed("sure" + CALL, {"tools": TOOLS})
    added, done = ([e["item"] for e in events if e["type"] == f"response.output_item.{kind}"
                    and e["item"]["type"] == "function_call"] for kind in ("added", "done"))
    assert [item["arguments"] for item in added] == [""]
    assert [json.loads(item["arguments"]) for item in done] == [{"tz": "UTC"}]
    assert (added[0]["status"], done[0]["status"]) == ("in_progress", "completed")


def test_an_error_event_carries_the_errors_code_else_its_type():
    stream = ResponseStream(AsResponse(None, ResponsesRequest(input="hi"), [], "m"))
    events = stream.opening() + stream.feed({"error": {
        "message": "busy", "type": "requests", "param": None, "code": "rate_limit_exceeded"}})
    error = json.loads(events[-1].split("\n")[1].removeprefix("data: "))
    EVENTS.validate_python(error)
    assert (error["type"], error["code"], error["message"]) == (
        "error", "rate_limit_exceeded", "busy")
    other = ResponseStream(AsResponse(None, ResponsesRequest(input="hi"), [], "m")).feed(
        {"error": {"message": "down", "type": "server_error", "code": None}})
    assert json.loads(other[0].split("\n")[1].removeprefix("data: "))["code"] == "server_error"
    assert stream.closing() == []  # nothing after the error


def test_a_tools_strict_flag_reaches_the_chats_tool():
    chat = chat_of({"input": "hi", "tools": [{**TOOLS[0], "strict": True}]})
    assert chat.tools[0].function.strict is True


def test_an_assistants_refusal_part_sent_back_is_its_text():
    chat = chat_of({"input": [
        {"role": "user", "content": "how?"},
        {"type": "message", "role": "assistant", "content": [
            {"type": "refusal", "refusal": "I cannot help"}]},
        {"role": "user", "content": "why?"}]})
    assert [m.for_template()["content"] for m in chat.messages] == [
        "how?", "I cannot help", "why?"]

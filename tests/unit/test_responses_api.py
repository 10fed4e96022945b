"""OpenAI's Responses API (`POST /v1/responses`) without Ray or a model: a request read into
the chat it asks for (each input form, instructions, tools, text.format, the fields refused
with their names), and the router's answers built from scripted choices, whole and streamed,
checked against the openai package's own types and read by its client."""

import asyncio
import json
from types import MethodType, SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from deployments.admission import Admission
from deployments.background import BackgroundRuns
from deployments.ingress import BadRequest, parse
from deployments.responses_api import ResponsesRequest, renamed
from deployments.responses_events import AsResponse, ResponseStream, answer_shape
from deployments.router import Router
from deployments.router_args import RouterArgs
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from speculative.types import PoolUnavailable
from tests.tiny import Scripted
from tests.unit.test_router_parts import posted

EVENTS = TypeAdapter(ResponseStreamEvent)
CALL = '<tool_call>{"name": "now", "arguments": {"tz": "UTC"}}</tool_call>'
TOOLS = [{"type": "function", "name": "now", "description": "the time",
          "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}]


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
    # vLLM's, which the chat serves: a Response has no field for them (they were dropped)
    ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"return_token_ids": True}, "return_token_ids"),
])
def test_a_refused_field_is_named_as_the_responses_api_names_it(body, param):
    refused = refusal({"input": "hi", **body})
    assert refused.status == 400 and refused.param == param
    assert "max_tokens" not in str(refused) and "messages" not in str(refused)


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


def stand_in(text: str, parser: str | None = None, verifier=None,
             store=None) -> SimpleNamespace:
    """A Router's parts that Router.serve_request uses, without Ray or a model: each
    request's output is `text`, a character a token (token 10 + j is its j-th), ended by
    token 0 (a stop id), planned with the body's max_tokens."""
    tokens = list(range(10, 10 + len(text)))

    async def plan(body, chat):
        Router.check_model(router, body)
        sampling = SamplingParams(temperature=0.0, max_tokens=body.max_tokens or 256)
        return RequestFrontEnd().plan("chatcmpl-x", (2, 3), sampling, n=1,
                                      stop_token_ids=(0,))

    def decode(ids):
        return "".join(text[i - 10] for i in ids if i >= 10)

    router = SimpleNamespace(
        api_key=None, token_bytes=None, admission=Admission(2), think_tokens=None,
        responses_store=store, background=BackgroundRuns(store, 2),
        metrics=SimpleNamespace(record_choice=lambda *choice: None),
        args=RouterArgs(reasoning_parser=parser, served_model_name="m"),
        decode=decode, tool_decode=decode, special_decode=decode, rendering=None,
        prompts=SimpleNamespace(reported_stop_ids=lambda body: (),
                                chat_template=lambda body: SimpleNamespace(call_id_length=None)),
        pools=lambda kind=None: (Scripted(tokens, prompt_len=2),
                                 verifier or Scripted(tokens, prompt_len=2)), plan=plan)
    router.tool_use = MethodType(Router.tool_use, router)
    router.reasoning = MethodType(Router.reasoning, router)
    router.prompt_answer = MethodType(Router.prompt_answer, router)
    router.choices = MethodType(Router.choices, router)
    return router


def router_for(text: str, **options):
    """(serve(body): the stand-in router's answer, read; its admission)."""
    router = stand_in(text, **options)

    async def serve(body: dict):
        answer = await Router.serve_request(router, posted(body), ResponsesRequest)
        if not body.get("stream"):
            return json.loads(answer.body)
        return [event async for event in answer.body_iterator]

    return serve, router.admission


def answered(text: str, body: dict, **options):
    serve, admission = router_for(text, **options)
    answer = asyncio.run(serve({"model": "m", "input": "hi", **body}))
    assert admission.running == 0
    return answer


def streamed(text: str, body: dict, **options) -> list[dict]:
    """The stream's events, each checked: `event:` its type, a valid openai event."""
    events = []
    for raw in answered(text, {**body, "stream": True}, **options):
        head, data = raw.removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        EVENTS.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def without_ids(response: dict, *also: str) -> dict:
    """A Response's output and status, its items' ids (and `also`) left out."""
    return {"status": response["status"], "usage": response["usage"],
            "incomplete_details": response["incomplete_details"],
            "output": [{k: v for k, v in item.items() if k not in ("id", *also)}
                       for item in response["output"]]}


def test_a_whole_answer_is_an_openai_response_echoing_the_request():
    body = answered("Paris.", {"instructions": "brief", "temperature": 0.2,
                               "max_output_tokens": 50, "metadata": {"k": "v"}})
    response = Response.model_validate(body)
    assert response.output_text == "Paris." and response.status == "completed"
    assert body["id"].startswith("resp_") and body["output"][0]["id"].startswith("msg_")
    assert (response.instructions, response.temperature, response.max_output_tokens,
            response.metadata, response.model) == ("brief", 0.2, 50, {"k": "v"}, "m")
    usage = body["usage"]  # the output's 6 tokens and its stop token
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (2, 7, 9)
    assert body["speculative"]["rounds"] > 0


def test_an_answer_cut_at_max_output_tokens_is_incomplete():
    body = answered("Paris is the capital.", {"max_output_tokens": 5})
    response = Response.model_validate(body)
    assert response.status == "incomplete" and response.output_text == "Paris"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


def test_a_call_is_a_function_call_item_whole_and_streamed():
    whole = answered("sure" + CALL, {"tools": TOOLS})
    Response.model_validate(whole)
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["message", "function_call"]
    call = whole["output"][1]
    assert call["id"].startswith("fc_") and call["call_id"] and call["name"] == "now"
    assert json.loads(call["arguments"]) == {"tz": "UTC"} and call["status"] == "completed"
    events = streamed("sure" + CALL, {"tools": TOOLS})
    assert [e["type"] for e in events if "function_call" in e["type"]] == [
        "response.function_call_arguments.delta", "response.function_call_arguments.done"]
    assert without_ids(events[-1]["response"], "call_id") == without_ids(whole, "call_id")


MESSAGE_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done",
                  "response.output_item.done"]


@pytest.mark.parametrize("text, limit", [("Paris is the capital of France.", None),
                                         ("Paris is the capital of France.", 9)])
def test_a_streamed_answer_comes_in_openais_order_and_adds_up_to_the_whole(text, limit):
    body = {} if limit is None else {"max_output_tokens": limit}
    events = streamed(text, body)
    kinds = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1 and kinds[-1] == ("response.completed" if limit is None
                                             else "response.incomplete")
    assert list(dict.fromkeys(kinds[:-1])) == MESSAGE_EVENTS
    done = events[-1]["response"]
    Response.model_validate(done)
    assert "".join(deltas) == done["output"][0]["content"][0]["text"] == text[:limit]
    assert without_ids(done) == without_ids(answered(text, body))


@pytest.mark.parametrize("limit, reasoning, content", [
    (None, "capital", "Paris."), (25, "capital", "Par"), (12, "capit", None)])
def test_reasoning_is_a_reasoning_item_before_the_message_whole_and_streamed(
        limit, reasoning, content):
    """Whole and streamed alike, also cut at max_output_tokens in the content (the reasoning
    was completed) or in the reasoning (no message)."""
    text, body = "<think>capital</think>Paris.", {"max_output_tokens": limit}
    whole = answered(text, body, parser="deepseek_r1")
    Response.model_validate(whole)
    kinds = ["reasoning", "message"][:1 + (content is not None)]
    assert [item["type"] for item in whole["output"]] == kinds
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": reasoning}]
    assert Response.model_validate(whole).output_text == (content or "")
    events = streamed(text, body, parser="deepseek_r1")
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.reasoning_text.delta") == reasoning
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"
            ] == list(range(len(kinds)))
    assert without_ids(events[-1]["response"]) == without_ids(whole)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "Paris", " is", "\n", CALL, "é"]),
                max_size=6), st.one_of(st.none(), st.integers(1, 40)), st.booleans(),
       st.booleans())
def test_every_streamed_response_is_its_whole_one(pieces, limit, parser, tools):
    """Any output (reasoning, content, calls, cut anywhere): the stream's last Response is
    the whole answer's, its text deltas adding up to the message's text."""
    text, body = "".join(pieces) or "x", {"max_output_tokens": limit, "tools": TOOLS if tools
                                          else None}
    options = {"parser": "deepseek_r1" if parser else None}
    whole = answered(text, body, **options)
    events = streamed(text, body, **options)
    done = events[-1]["response"]
    assert without_ids(done) == without_ids(whole)
    Response.model_validate(done)
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta"
                   ) == Response.model_validate(whole).output_text


class FailsAfterARound(Scripted):
    """A verifier's pool that answers `text`'s first round (one token an id from 10 on, the
    prompt 2 ids), then fails."""

    def __init__(self, text: str) -> None:
        super().__init__(list(range(10, 10 + len(text))), prompt_len=2)

    async def score(self, call):
        if call.sync.committed_len > 2:
            raise PoolUnavailable("verifier: UNAVAILABLE")
        return await super().score(call)


UNFINISHED = "a long answer that the verifier never finishes"


def test_an_error_mid_stream_is_openais_error_event_and_the_slot_goes_back():
    serve, admission = router_for(UNFINISHED, verifier=FailsAfterARound(UNFINISHED))
    raw = asyncio.run(serve({"input": "hi", "stream": True}))
    events = [json.loads(r.split("\n")[1].removeprefix("data: ")) for r in raw]
    for event in events:
        EVENTS.validate_python(event)
    assert events[-1]["type"] == "error" and "verifier" in events[-1]["message"]
    assert "response.output_text.delta" in [e["type"] for e in events]
    assert not any(e["type"] == "response.completed" for e in events)
    assert admission.running == 0


def test_logprobs_ride_on_the_text_deltas_and_the_whole_text():
    """The chat's logprob entries are OpenAI's output_text ones: each chunk's go with its
    text delta (those of a chunk without text with the next), all of them with the text."""
    asked = ResponsesRequest.model_validate({"input": "hi", "top_logprobs": 1})
    stream = ResponseStream(AsResponse(None, asked, [], "m"))
    entry = {"token": "a", "logprob": -0.5, "bytes": [97],
             "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]}

    def chunk(content, finish_reason=None):
        return {"choices": [{"index": 0, "delta": {"content": content},
                             "finish_reason": finish_reason,
                             "logprobs": {"content": [entry]}}]}

    events = [json.loads(e.split("\n")[1][6:]) for e in stream.opening() +
              stream.feed(chunk("a")) + stream.feed(chunk(None)) + stream.feed(chunk("a")) +
              stream.feed(chunk(None, "stop")) + stream.closing()]
    for event in events:
        EVENTS.validate_python(event)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [len(d["logprobs"]) for d in deltas] == [1, 2]
    response = Response.model_validate(events[-1]["response"])
    assert len(response.output[0].content[0].logprobs) == 4


def test_the_official_client_reads_the_answer_and_iterates_the_stream():
    """openai's AsyncOpenAI over an in-process ASGI transport to the router's request path:
    responses.create whole, and with stream=True its typed events."""
    import httpx2
    from fastapi import FastAPI, Request
    from openai import AsyncOpenAI

    app = FastAPI()
    text = "Paris is the capital."

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await Router.serve_request(stand_in(text), request, ResponsesRequest)

    async def main():
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
        client = AsyncOpenAI(api_key="k", base_url="http://router/v1", http_client=http)
        whole = await client.responses.create(model="m", input="hi")
        stream = await client.responses.create(model="m", input="hi", stream=True)
        return whole, [event async for event in stream]

    whole, events = asyncio.run(main())
    assert whole.output_text == text and whole.status == "completed"
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text


def test_the_api_key_the_model_and_admission_are_checked_as_a_chats():
    router = stand_in("Paris.")

    def status(body: dict, headers=()) -> tuple[int, str | None]:
        request = posted({"input": "hi", **body})
        request.scope["headers"] = [*request.scope["headers"], *headers]
        answer = asyncio.run(Router.serve_request(router, request, ResponsesRequest))
        return answer.status_code, (json.loads(answer.body)["error"] or {}).get("param")

    router.api_key = "k"
    assert status({})[0] == 401
    assert status({}, [(b"authorization", b"Bearer k")]) == (200, None)
    router.api_key = None
    assert status({"model": "other"}) == (404, "model")
    held = router.admission.admit(2)
    assert status({})[0] == 429
    held.release()
    # vLLM's Responses take `priority` (it was dropped: 0 under the priority policy, and
    # under FCFS none refused): one other than 0 under FCFS is the chat's 400
    assert status({"priority": 3}) == (400, "priority")
    router.admission.by_priority = True
    assert status({"priority": 3}) == (200, None)
    router.admission.by_priority = False
    assert status({"tools": TOOLS, "tool_choice": {"type": "function", "name": "later"}}
                  ) == (400, "tool_choice")

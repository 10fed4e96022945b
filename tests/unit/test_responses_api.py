"""OpenAI's Responses API (`POST /v1/responses`) without Ray or a model: the router's answers
built from scripted choices, whole and streamed, checked against the openai package's own
types and read by its client. A request read into the chat it asks for:
test_responses_request."""

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
from deployments.responses_api import ResponsesRequest
from deployments.responses_events import AsResponse, ResponseStream
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
        prompts=SimpleNamespace(reported_stop_ids=lambda body: (), system_first=False,
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


def test_max_tool_calls_and_service_tier_are_echoed_as_vllm_echoes_them():
    """OpenAI's max_tool_calls bounds built-in tools (none served here), service_tier picks
    a tier (one here): read and echoed, as vLLM's Response echoes them; null and "auto"
    where not given; a tier OpenAI does not name is a 400."""
    echoed = Response.model_validate(answered("Paris.", {"max_tool_calls": 2,
                                                         "service_tier": "flex"}))
    assert (echoed.max_tool_calls, echoed.service_tier) == (2, "flex")
    plain = answered("Paris.", {})
    assert (plain["max_tool_calls"], plain["service_tier"]) == (None, "auto")
    assert answered("Paris.", {"service_tier": "gold"})["error"]["param"] == "service_tier"


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

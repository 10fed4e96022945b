"""Router parts that need no Ray: n > 1 choices fail together; error bodies; admission;
the fan-out of a request's choices into a whole answer, read and encoded off the event loop;
the request path (Router.serve_request) over stand-in pools. Streamed: test_router_streams."""

import asyncio
import gc
import json
import threading
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments import responses
from deployments.admission import Admission
from deployments.choices import Choices, all_or_none
from deployments.ingress import BadRequest
from deployments.openai_api import CompletionRequest
from deployments.responses import WHOLE, error_body, json_text
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from tests.tiny import Agreeing


def test_one_failing_choice_cancels_its_siblings():
    cancelled = []

    async def sibling(i):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def failing():
        await asyncio.sleep(0.01)
        raise RuntimeError("verifier: UNAVAILABLE")

    async def main():
        with pytest.raises(RuntimeError):
            await all_or_none([sibling(0), failing(), sibling(2)])

    asyncio.run(main())
    assert sorted(cancelled) == [0, 2]


def test_error_bodies_have_openais_types():
    assert error_body("slow down", 429)["error"]["code"] == "rate_limit_exceeded"
    assert error_body("who", 401)["error"]["code"] == "invalid_api_key"
    assert error_body("down", 503)["error"]["type"] == "server_error"
    assert error_body("no such model", 404)["error"] == {  # a model's (a path's has no code)
        "message": "no such model", "type": "invalid_request_error", "param": None,
        "code": "model_not_found"}


def test_admission_refuses_beyond_its_running_choices_and_a_ticket_returns_once():
    admission = Admission(4)
    ticket = admission.admit(3)
    with pytest.raises(BadRequest) as refused:
        admission.admit(2)
    assert refused.value.status == 429 and "Retry-After" in refused.value.headers
    ticket.release()
    ticket.release()
    assert admission.running == 0
    with pytest.raises(BadRequest) as never:  # more than it ever runs: retrying never helps
        admission.admit(5)
    assert never.value.status == 400 and never.value.param == "n"
    admission.admit(4)


class Recorded:
    def __init__(self):
        self.states, self.choices = [], []

    def record_choice(self, state, prompt_tokens, first_text_s, seconds):
        self.states.append(state)
        self.choices.append((prompt_tokens, first_text_s, seconds, state.finish_reason))


def fan_out(chat: bool, include_usage: bool = False, continuous_usage: bool = False):
    admission = Admission(8)
    plan = RequestFrontEnd().plan("cmpl-x", (2, 3), SamplingParams(temperature=0.0,
                                                                    max_tokens=4), n=2)
    engine, metrics = Agreeing(), Recorded()
    choices = Choices(plan, (engine, engine), lambda ids: "a" * len(ids), metrics,
                      admission.admit(2), model="m", chat=chat, return_token_ids=True,
                      include_usage=include_usage, continuous_usage=continuous_usage)
    return choices, admission, metrics


def test_a_completion_has_every_choice_and_the_merged_usage():
    choices, _, metrics = fan_out(chat=False)
    body = asyncio.run(choices.complete())
    assert [c["text"] for c in body["choices"]] == ["aaaa", "aaaa"]
    assert [c["token_ids"] for c in body["choices"]] == [[1] * 4] * 2
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["id"] == "cmpl-x" and len(metrics.states) == 2


def test_each_choice_records_its_prompt_once_its_first_text_and_its_end():
    """vLLM's request metrics per choice: the prompt counted with the first of its n
    choices (as usage counts it), the time to the first text within the choice's time."""
    choices, admission, metrics = fan_out(chat=False)
    asyncio.run(choices.complete())
    assert [prompt for prompt, *_ in metrics.choices] == [2, 0]
    for _, first_text, seconds, finish_reason in metrics.choices:
        assert 0 <= first_text <= seconds and finish_reason == "length"


def test_the_running_gauge_follows_admission():
    seen = []
    admission = Admission(8, on_change=seen.append)
    first, second = admission.admit(3), admission.admit(2)
    first.release()
    first.release()  # given back once
    second.release()
    assert seen == [3, 5, 2, 0] and admission.running == 0


class FailingAfter(Agreeing):
    """Agrees with every draft for its first `calls` score calls, then is unavailable."""

    def __init__(self, calls: int) -> None:
        self.left = calls

    async def score(self, call):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("verifier: UNAVAILABLE")
        return await super().score(call)


def test_a_failed_request_still_counts_its_rounds_in_the_metrics():
    """The metrics show incidents: a request that ends in a pool error records the rounds
    it ran (and with them its busy retries and draft fallbacks), as a finished one does."""
    plan = RequestFrontEnd().plan("cmpl-x", (2, 3), SamplingParams(temperature=0.0,
                                                                    max_tokens=64), n=1)
    metrics = Recorded()
    choices = Choices(plan, (Agreeing(), FailingAfter(3)), lambda ids: "a" * len(ids),
                      metrics, Admission(8).admit(1), model="m", chat=False,
                      return_token_ids=False)
    with pytest.raises(RuntimeError):
        asyncio.run(choices.complete())
    assert len(metrics.states) == 1 and metrics.states[0].stats.rounds >= 3
    assert metrics.choices[0][3] is None  # not finished: no success, no e2e latency


def router_of(max_running: int, verifier=None):
    """The Router's request path (Router.serve_request) without Ray or a model: stand-ins
    for its prompt reading and planning plan each prompt of a body as two tokens, over
    agreeing pools (or this verifier). Returns (serve(request, schema, chat), its
    admission)."""
    from types import SimpleNamespace

    from deployments.router import Router
    from speculative.frontend import joined

    async def plan(body, chat):
        plans = [RequestFrontEnd().plan(f"cmpl-x-{i}", (2, 3), SamplingParams(
            temperature=0.0, max_tokens=4), n=body.n) for i, _ in enumerate(body.prompts())]
        return plans[0] if len(plans) == 1 else joined("cmpl-x", plans)

    router = SimpleNamespace(  # not a Router: Serve's ingress wrapper wants its event loop
        api_key=None, token_bytes=None, admission=Admission(max_running), metrics=Recorded(),
        args=SimpleNamespace(max_prompt_bytes=1 << 16, served_model_name="m",
                             reasoning_parser=None),
        decode=lambda ids: "a" * len(ids), tool_decode=lambda ids: "a" * len(ids),
        special_decode=lambda ids: "s" * len(ids),  # skip_special_tokens: false
        prompts=SimpleNamespace(reported_stop_ids=lambda body: ()), rendering=None,
        responses_store=None,
        pools=lambda kind=None: (Agreeing(), verifier or Agreeing()), plan=plan)
    router.prompt_answer = lambda body, plan, chat: Router.prompt_answer(router, body, plan, chat)
    router.choices = lambda *args: Router.choices(router, *args)

    def serve(request, schema, chat=None):  # (the body says which)
        return Router.serve_request(router, request, schema)

    serve.router = router
    return serve, router.admission


# a JSON body's header (the router refuses a body of another type or none: 415)
JSON_TYPE = (b"content-type", b"application/json")


def posted(body: dict):
    from starlette.requests import Request

    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    headers = [JSON_TYPE, (b"content-length", str(len(raw)).encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "query_string": b"", "headers": headers}, receive)


def test_skip_special_tokens_false_decodes_with_every_tokens_text():
    serve, _ = router_of(max_running=1)

    async def main():
        answers = [await serve(posted({"prompt": "hi", "max_tokens": 4, **fields}),
                               CompletionRequest, chat=False)
                   for fields in ({}, {"skip_special_tokens": False})]
        return [json.loads(answer.body)["choices"][0]["text"] for answer in answers]

    assert asyncio.run(main()) == ["aaaa", "ssss"]


def test_a_whole_answer_gives_its_admission_back_so_the_next_request_runs():
    """A server that runs one choice at a time answers requests one after another (a slot
    kept by a finished request would refuse every later one with 429)."""
    serve, admission = router_of(max_running=1)

    async def main():
        return [await serve(posted({"prompt": "hi", "max_tokens": 4}), CompletionRequest,
                            chat=False) for _ in range(3)]

    answers = [json.loads(answer.body) for answer in asyncio.run(main())]
    assert all(a["choices"][0]["text"] == "aaaa" for a in answers)
    assert admission.running == 0


def test_a_whole_answer_is_read_and_encoded_off_the_event_loop(monkeypatch):
    """A finished answer's reading (its calls, its logprobs' texts: Python over every token)
    and its encoding (FastAPI's encoder walked the returned dict) ran on the event loop: 1 s
    of it for a chat's 2,048 tokens with their top 20, every other stream held meanwhile."""
    from deployments import ingress

    threads, read, encode = [], Choices.whole_choice, ingress.json_text

    def reading(self, *args):
        threads.append(("read", threading.current_thread()))
        return read(self, *args)

    def encoding(body, **options):
        threads.append(("encode", threading.current_thread()))
        return encode(body, **options)

    monkeypatch.setattr(Choices, "whole_choice", reading)
    monkeypatch.setattr(ingress, "json_text", encoding)  # the router's json_answer's
    serve, _ = router_of(max_running=2)
    answer = asyncio.run(serve(posted({"prompt": "hi", "max_tokens": 4, "n": 2}),
                               CompletionRequest, chat=False))
    assert [c["text"] for c in json.loads(answer.body)["choices"]] == ["aaaa", "aaaa"]
    assert answer.media_type == "application/json"
    assert [kind for kind, _ in threads] == ["read", "read", "encode"]
    assert all(thread is not threading.main_thread() for _, thread in threads)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=3) |
                    st.floats(allow_nan=False, allow_infinity=False),
                    lambda inner: st.lists(inner, max_size=6) |
                    st.dictionaries(st.text(max_size=3), inner, max_size=4), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_an_answer_encoded_a_piece_at_a_time_is_json_dumps_text(value):
    """json_text with slices of 2 items (a response's are 256): the text of json.dumps, as
    a whole answer (JSONResponse's options) and as a stream's chunk (json.dumps' own)."""
    with mock.patch.object(responses, "PIECE_ITEMS", 2):
        assert json_text(value, **WHOLE) == json.dumps(value, **WHOLE)
        assert json_text(value) == json.dumps(value)


def test_a_routers_start_up_objects_are_kept_out_of_full_collections():
    """A full collection walked all that start-up built (some 400k objects: 0.22 s of the
    event loop), and a request's objects set one off (a 2 MiB body, the logprobs of an
    answer, even read on another thread): the router freezes them once it has started."""
    from deployments.router import Router
    from deployments.router_args import RouterArgs

    own = Router.__bases__[0]  # the class Serve's ingress wraps
    gc.unfreeze()
    try:
        own.__init__(object.__new__(own), RouterArgs())
        assert gc.get_freeze_count() > 100_000
    finally:
        gc.freeze()  # as the tests' conftest leaves it


def test_a_completions_batch_is_admitted_as_its_prompts_times_n():
    """Two prompts with n = 2 are four choices: beyond a bound of 3 they never run (400)."""
    serve, admission = router_of(max_running=3)
    refused = asyncio.run(serve(posted({"prompt": ["hi", "ho"], "n": 2, "max_tokens": 4}),
                                CompletionRequest, chat=False))
    assert refused.status_code == 400 and json.loads(refused.body)["error"]["param"] == "n"
    assert admission.running == 0

"""Router parts that need no Ray: n > 1 choices fail together; error bodies; admission;
the fan-out of a request's choices, whole and streamed, read and encoded off the event loop."""

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
from deployments.ingress import BadRequest, ReleasingStream
from deployments.openai_api import CompletionRequest
from deployments.responses import WHOLE, DeltaChunks, chunk_body, error_body, json_text
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


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_stream_sends_each_choices_chunks_then_usage_and_gives_its_admission_back(
        include_usage):
    """The usage chunk (no choices) only when stream_options.include_usage asks for it, as
    OpenAI: clients read chunk.choices[0] from every other chunk."""
    choices, admission, _ = fan_out(chat=True, include_usage=include_usage)

    async def collect():
        return [event async for event in choices.events()]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n" and admission.running == 0
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all("created" in c for c in chunks)
    if include_usage:
        usage = chunks.pop()
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
        assert usage["speculative"]["rounds"] > 0 and "usage" not in chunks[-1]
    assert all(c["choices"] for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == "aaaa"
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["token_ids"] == [1] * 4


class SlowFirstScore(Agreeing):
    """An agreeing verifier whose first score (the prefill) waits for `prefilled`."""

    def __init__(self) -> None:
        self.prefilled, self.scored = asyncio.Event(), 0

    async def score(self, call):
        self.scored += 1
        await self.prefilled.wait()
        return await super().score(call)


@pytest.mark.parametrize("chat", [False, True])
def test_no_chunk_with_a_choice_comes_before_the_first_token(chat):
    """vllm bench serve (openai-chat, as openai) times the first token at the first chunk
    with a choice: a chat's role went out before the prefill, a TTFT of nothing and a
    first ITL of the whole prefill. Sent with the first text, as vLLM sends it with the
    engine's first output; whole, it has the role and the prompt's ids as before."""
    verifier = SlowFirstScore()
    plan = RequestFrontEnd().plan("cmpl-x", (2, 3), SamplingParams(temperature=0.0,
                                                                    max_tokens=4), n=1)
    choices = Choices(plan, (Agreeing(), verifier), lambda ids: "a" * len(ids), Recorded(),
                      Admission(1).admit(1), model="m", chat=chat, return_token_ids=True)

    async def collect():
        events = choices.events()
        first = asyncio.ensure_future(anext(events))
        while not verifier.scored:
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert not first.done()  # the prefill has not ended: nothing to send
        verifier.prefilled.set()
        return [await first] + [event async for event in events]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(collect())[:-1]]
    if chat:
        opening = chunks[0]
        assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert opening["prompt_token_ids"] == [2, 3]
    assert "".join(c["choices"][0]["delta"].get("content") or "" if chat else
                   c["choices"][0]["text"] for c in chunks) == "aaaa"


@pytest.mark.parametrize("chat", [False, True])
def test_a_choices_last_text_comes_on_its_finishing_chunk(chat):
    """As vLLM's: the round that ends a choice sends its text with the finish_reason. An
    empty finishing chunk after it was one chunk with a choice more to vllm bench serve (an
    inter-token latency of nothing on every request); the ids and the usage of the whole
    choice stay on it (its logprobs: test_logprobs' streams)."""
    plan = RequestFrontEnd().plan("cmpl-x", (2, 3), SamplingParams(temperature=0.0,
                                                                    max_tokens=4), n=1)
    choices = Choices(plan, (Agreeing(), Agreeing()), lambda ids: "a" * len(ids), Recorded(),
                      Admission(1).admit(1), model="m", chat=chat, return_token_ids=True,
                      include_usage=True, continuous_usage=True)

    async def collect():
        return [event async for event in choices.events()]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(collect())[:-1]][:-1]
    texts = [c["choices"][0]["delta"].get("content") if chat else c["choices"][0]["text"]
             for c in chunks]
    assert all(texts[1 if chat else 0:]) and "".join(texts) == "aaaa"
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["choices"][0]["token_ids"] == [1] * 4
    assert final["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("chat", [False, True])
def test_every_chunk_names_its_finish_reason_logprobs_and_stop_reason(chat):
    """As OpenAI's and vLLM's chunks: each choice carries finish_reason, logprobs and
    stop_reason, null where none (logprobs and stop_reason were left out: a KeyError for a
    client reading choice["logprobs"])."""
    choices, _, _ = fan_out(chat=chat)

    async def collect():
        return [event async for event in choices.events()]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(collect())[:-1]]
    for choice in (c["choices"][0] for c in chunks):
        assert choice["logprobs"] is None
        finished = choice["finish_reason"] is not None
        assert "stop_reason" in choice and (finished or choice["stop_reason"] is None)


@pytest.mark.parametrize("chat", [False, True])
def test_return_token_ids_brings_the_prompts_ids_where_vllm_puts_them(chat):
    """vLLM's return_token_ids: the prompt's ids beside the output's (chat: on the body;
    completions: on each choice); streamed once per choice, a chat's on its first chunk (as
    vLLM), a completion's on its last, beside its token_ids (its first chunk is its first
    text, which a client times)."""
    choices, _, _ = fan_out(chat=chat)
    body = asyncio.run(choices.complete())
    carriers = [body] if chat else body["choices"]
    assert [c.get("prompt_token_ids") for c in carriers] == [[2, 3]] * len(carriers)
    choices, _, _ = fan_out(chat=chat)

    async def collect():
        return [event async for event in choices.events()]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(collect())[:-1]]
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        sent = [(c if chat else c["choices"][0]).get("prompt_token_ids") for c in mine]
        assert sent.count(None) == len(sent) - 1 and sent[0 if chat else -1] == [2, 3]
        assert chat or mine[0]["choices"][0]["text"]  # no empty chunk before the first text
        assert "".join(c["choices"][0]["delta"].get("content") or "" if chat else
                       c["choices"][0]["text"] for c in mine) == "aaaa"


@pytest.mark.parametrize("chat", [False, True])
def test_every_chunk_of_a_stream_has_the_requests_created(chat, monkeypatch):
    """OpenAI's `created`: when the completion was created, the same on each chunk of its
    stream (the role, delta, final and usage chunks were stamped as each was built)."""
    import time

    clock = iter(range(1000, 2000))
    monkeypatch.setattr(time, "time", lambda: next(clock))  # a second per reading
    choices, _, _ = fan_out(chat=chat, include_usage=True)

    async def collect():
        return [event async for event in choices.events()]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(collect())[:-1]]
    assert len(chunks) > 4 and {c["created"] for c in chunks} == {1000}
    whole, _, _ = fan_out(chat=chat)
    later = next(clock)
    assert asyncio.run(whole.complete())["created"] < later  # when it began, not ended


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_puts_each_choices_usage_so_far_on_its_chunks(chat):
    """stream_options.continuous_usage_stats (vLLM's, with include_usage): every chunk of a
    choice carries its usage so far, growing to its whole; the last chunk the request's."""
    choices, _, _ = fan_out(chat=chat, include_usage=True, continuous_usage=True)

    async def collect():
        return [event async for event in choices.events()]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(collect())[:-1]]
    assert chunks.pop()["usage"]["completion_tokens"] == 8
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        used = [c["usage"]["completion_tokens"] for c in mine]
        assert used == sorted(used) and used[-1] == 4 and used[0] == (0 if chat else used[0])
        assert all(c["usage"]["prompt_tokens"] == 2 and c["usage"]["total_tokens"] ==
                   2 + c["usage"]["completion_tokens"] for c in mine)
        text = "".join(c["choices"][0]["delta"].get("content") or "" if chat else
                       c["choices"][0]["text"] for c in mine)
        assert text == "aaaa"


def test_continuous_usage_counts_a_choices_tokens_without_copying_them(monkeypatch):
    """Each chunk's usage so far read the choice's output ids, a copy of them all: a stream
    quadratic in its length (4 s of the event loop over 128k tokens). Counted: the copies
    do not grow with the chunks."""
    from speculative.state import RequestState

    copies, output_ids = [], RequestState.output_token_ids
    monkeypatch.setattr(RequestState, "output_token_ids",
                        property(lambda state: copies.append(state) or output_ids.fget(state)))

    def copied(max_tokens: int) -> tuple[int, int]:
        """(copies of the output ids, chunks) of a stream of max_tokens, two a round."""
        plan = RequestFrontEnd().plan("cmpl-x", (2, 3), SamplingParams(
            temperature=0.0, max_tokens=max_tokens), n=1, num_speculative_tokens=1)
        choices = Choices(plan, (Agreeing(), Agreeing()), lambda ids: "a" * len(ids),
                          Recorded(), Admission(1).admit(1), model="m", chat=True,
                          return_token_ids=True, include_usage=True, continuous_usage=True)

        async def collect():
            return [event async for event in choices.events()]

        copies.clear()
        chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(collect())[:-1]]
        assert chunks[-2]["usage"]["completion_tokens"] == max_tokens
        return len(copies), len(chunks)

    (few, short), (many, long) = copied(4), copied(40)
    assert long > short + 10 and many == few


def test_continuous_usage_is_asked_with_include_usage():
    streamed = {"prompt": "x", "stream": True}
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert CompletionRequest(**streamed, stream_options=both).continuous_usage
    assert not CompletionRequest(**streamed, stream_options={
        "continuous_usage_stats": True}).continuous_usage  # as vLLM: with include_usage only


@pytest.mark.parametrize("chat", [False, True])
def test_a_delta_chunk_built_once_is_the_chunk_body_of_its_text(chat):
    chunks = DeltaChunks("cmpl-7", "specserve-demo", 3, chat)
    for text in ["plain", "", 'quotes " and \\ and\nlines', "é ✓ \x00"]:
        built, body = json.loads(chunks(text)), chunk_body("cmpl-7", "specserve-demo", 3, text,
                                                          None, chat)
        assert built.pop("created") <= body.pop("created")
        assert built == body


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_stream_whose_client_is_gone_before_its_first_chunk_gives_its_admission_back(spec):
    """Starlette skips a background task when the send fails, and the events' generator,
    never started, runs no finally."""
    admission = Admission(4)
    ticket = admission.admit(3)

    async def events():
        yield "data: x\n\n"

    async def gone(message):
        raise OSError("the client has gone")

    async def disconnect():
        return {"type": "http.disconnect"}

    async def main():
        response = ReleasingStream(events(), ticket)
        with pytest.raises(Exception):
            await response({"type": "http", "asgi": {"spec_version": spec}}, disconnect, gone)

    asyncio.run(main())
    assert admission.running == 0


def test_a_stream_whose_client_goes_mid_stream_ends_its_events_before_its_admission():
    """The events' generator, paused at a chunk the send failed on, runs its finally (where
    Choices.events cancels its choices) before the slot is given back."""
    admission = Admission(4)
    ticket, order = admission.admit(2), []

    async def events():
        try:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
        finally:
            order.append(("events ended", admission.running))

    async def send(message):
        if message["type"] == "http.response.body":
            raise OSError("the client has gone")

    async def receive():
        await asyncio.sleep(10)

    async def main():
        with pytest.raises(Exception):
            await ReleasingStream(events(), ticket)(
                {"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    asyncio.run(main())
    assert order == [("events ended", 2)] and admission.running == 0


def test_a_client_gone_as_serves_cancellation_ends_the_stream_quietly():
    """Serve's receive raises TaskCancelledError when the proxy cancels the request (its
    client gone): the stream ends as for a disconnect, events closed and the slot given
    back, and nothing is raised into Serve's call (which logged it as never retrieved).
    Serve's scope is below ASGI 2.4, so Starlette listens for the disconnect."""
    from ray.exceptions import TaskCancelledError

    admission = Admission(4)
    ticket, sent, order = admission.admit(1), [], []

    async def events():
        try:
            while True:
                yield "data: x\n\n"
                await asyncio.sleep(0)
        finally:
            order.append("events ended")

    async def send(message):
        sent.append(message["type"])

    async def receive():
        await asyncio.sleep(0.01)
        raise TaskCancelledError()

    async def main():
        await ReleasingStream(events(), ticket)(
            {"type": "http", "path": "/v1/completions", "asgi": {"spec_version": "2.3"}},
            receive, send)

    asyncio.run(main())
    assert sent[0] == "http.response.start" and order == ["events ended"]
    assert admission.running == 0


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
        args=SimpleNamespace(max_prompt_bytes=1 << 16, served_model_name="m"),
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


def posted(body: dict):
    from starlette.requests import Request

    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "query_string": b"", "headers": [(b"content-length", str(len(raw)).encode())]},
                   receive)


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


def test_a_streams_usage_chunk_is_built_off_the_event_loop(monkeypatch):
    """The usage chunk merges the choices' statistics and takes medians over every round's
    timings (128 choices of 8,000 rounds: 1.3 s) while the event loop held every other
    stream; a whole answer's body was already built off it."""
    from speculative.frontend import RequestPlan

    threads, merged = [], RequestPlan.merged_stats

    def merging(self, done):
        threads.append(threading.current_thread())
        return merged(self, done)

    monkeypatch.setattr(RequestPlan, "merged_stats", merging)
    choices, _, _ = fan_out(chat=False, include_usage=True)

    async def collect():
        return [event async for event in choices.events()]

    events = asyncio.run(collect())
    usage = json.loads(events[-2][len("data: "):])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert len(threads) == 1 and threads[0] is not threading.main_thread()


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

"""The fan-out of a request's choices streamed, without Ray: each choice's chunks and when they
are sent, what every chunk carries (finish_reason, ids, created, continuous usage), the usage
chunk built off the event loop, and a client gone before or during the stream."""

import asyncio
import json
import threading

import pytest

from deployments.admission import Admission
from deployments.choices import Choices
from deployments.ingress import ReleasingStream
from deployments.openai_api import CompletionRequest
from deployments.responses import DeltaChunks, chunk_body
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from tests.tiny import Agreeing
from tests.unit.test_router_parts import Recorded, fan_out


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
    choice stay on it (its logprobs: test_logprobs_api's streams)."""
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


@pytest.mark.parametrize("chat", [False, True])
def test_a_delta_chunk_is_built_around_its_text_whatever_the_request_id_holds(chat):
    """A client's request_id whose JSON holds the text's hole, quoted, before the text: the
    chunk is still its text's (the stream broke with an internal error)."""
    request_id = 'cmpl-a"' + DeltaChunks.HOLE
    chunks = DeltaChunks(request_id, "specserve-demo", 0, chat)
    built, body = json.loads(chunks("x")), chunk_body(request_id, "specserve-demo", 0, "x",
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

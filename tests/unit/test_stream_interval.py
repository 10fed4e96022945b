"""vLLM's stream_interval: a streamed choice's chunks wait for that many tokens, its first
and last sent at once, the chunks still the whole answer's text at any K."""

import asyncio
import json

import pytest

from deployments.admission import Admission
from deployments.choices import Choices
from deployments.held_text import StreamInterval
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from tests.tiny import Scripted
from tests.unit.test_router_parts import Recorded

OUTPUT = [i % 3 for i in range(23)]


def choices(k, interval: int, chat: bool, stop=()):
    params = SamplingParams(temperature=0, max_tokens=len(OUTPUT), stop=stop)
    plan = RequestFrontEnd().plan("cmpl-x", (0,), params, num_speculative_tokens=k)
    engine = Scripted(OUTPUT, 3, 1)
    return Choices(plan, (engine, engine), lambda ids: "".join("abc"[i] for i in ids),
                   Recorded(), Admission(4).admit(1), model="m", chat=chat,
                   return_token_ids=False, include_usage=True, continuous_usage=True,
                   stream_interval=interval)


def streamed(k, interval, chat, stop=()) -> list[dict]:
    async def collect():
        return [e async for e in choices(k, interval, chat, stop).events()]

    events = asyncio.run(collect())[:-2]  # the usage chunk and [DONE]
    chunks = [json.loads(e[len("data: "):]) for e in events]
    return [{**c["choices"][0], "usage": c["usage"]} for c in chunks]


def text_of(chunk, chat: bool) -> str:
    return (chunk["delta"].get("content") or "") if chat else chunk["text"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("k", [0, 4, "auto"])
@pytest.mark.parametrize("interval", [1, 3, 5])
def test_chunks_wait_for_the_interval_and_join_into_the_whole_text(k, interval, chat):
    """Each chunk between the first and the last comes `interval` tokens or more after the
    one before (exactly that with K = 0, a token a round), and the chunks' texts are the
    non-streamed choice's, at K = 0, 4 and auto alike."""
    whole = asyncio.run(choices(k, interval, chat).complete())["choices"][0]
    chunks = streamed(k, interval, chat)
    text = "".join(text_of(c, chat) for c in chunks)
    assert text == (whole["message"]["content"] if chat else whole["text"])
    assert text == "".join("abc"[i] for i in OUTPUT)
    counts = [c["usage"]["completion_tokens"] for c in chunks if text_of(c, chat)]
    assert chunks[-1]["finish_reason"] == "length"
    steps = [b - a for a, b in zip(counts, counts[1:-1])]  # the last goes at once
    assert all(step >= interval for step in steps)
    if k == 0:
        assert counts[0] == 1 and set(steps) <= {interval}
        assert len(counts) == 2 + (len(OUTPUT) - 2) // interval


@pytest.mark.parametrize("chat", [False, True])
def test_a_stop_string_cut_still_joins_into_the_whole_text(chat):
    """Held text (a tail that may begin the stop string) and held chunks both go out with
    the end; the text is the non-streamed one's, cut at the stop string."""
    whole = asyncio.run(choices(0, 4, chat, stop=("cab",)).complete())["choices"][0]
    chunks = streamed(0, 4, chat, stop=("cab",))
    assert "".join(text_of(c, chat) for c in chunks) == \
        (whole["message"]["content"] if chat else whole["text"]) == "ab"
    assert chunks[-1]["finish_reason"] == "stop"


def test_the_first_delta_goes_at_once_then_held_ones_with_the_next_due():
    interval = StreamInterval(3)
    assert interval.take("a", 1, False) == "a"  # the first
    assert interval.take("b", 2, False) is None and interval.take("c", 3, False) is None
    assert interval.take("d", 4, False) == "bcd"  # 3 tokens since the first chunk
    assert interval.take("e", 5, False) is None
    assert interval.take("f", 6, True) == "ef"  # the last, at once
    assert interval.take("g", 7, False) is None and interval.rest() == "g"
    assert interval.rest() == ""
    assert StreamInterval(1).take("x", 2, False) == "x"


def test_stream_interval_is_a_positive_count_read_with_a_stream_alone():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        CompletionRequest(prompt="x", stream=True, stream_interval=0)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 stream_interval=4)  # no stream: unread, as vLLM's
    assert chat.stream_interval == 4 and not chat.stream

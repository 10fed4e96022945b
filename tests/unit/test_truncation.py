"""A Responses request's `truncation: "auto"` (deployments.truncation) without Ray or a
model: a conversation past a small context fitted by dropping its oldest turns (its
instructions and last turn kept, a call with its result), rendered on the prompt reader as
every prompt is; "disabled" (the default) still refused; the Response echoing it and
counting the tokens sent."""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai.types.responses import Response

from deployments.ingress import BadRequest, parse
from deployments.openai_api import ChatCompletionRequest
from deployments.responses_api import ResponsesChat, ResponsesRequest
from deployments.responses_events import answer_shape
from deployments.router import Router
from deployments.truncation import fitted
from speculative.frontend import RequestFrontEnd
from tests.tiny import Scripted
from tests.unit.test_chat_prompts import qwen_like_reader
from tests.unit.test_response_store import Served
from tests.unit.test_responses_api import stand_in
from tests.unit.test_router_parts import posted

# each message on its line: its role, its text, its calls; a tool result names its call
PLAIN = ("{%- for m in messages %}{{ m.role }}: {{ m.content or '' }}"
         "{%- for c in m.tool_calls or [] %} call {{ c.id }}{% endfor %}"
         "{%- if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
         "{%- if add_generation_prompt %}assistant:{% endif %}")
LONG = "hello world, answer in French "  # 7 tokens


@pytest.fixture(scope="module")
def reader():
    """A prompt reader of a small context (80 tokens) that renders PLAIN."""
    reader = qwen_like_reader()
    reader.tokenizer.chat_template = PLAIN
    reader.context_limit, reader.max_prompt_bytes, reader.end_ids = 80, 1 << 16, ()
    reader.default_max_tokens = 16
    reader.tokenizing, reader.grammar_tokenizer = ThreadPoolExecutor(1), None
    return reader


def chat_of(body: dict):
    asked = asyncio.run(parse(posted(body), ResponsesRequest, 1 << 16))
    return answer_shape(asked, "m").body


def prompt_of(reader, body: dict) -> tuple[int, ...]:
    return asyncio.run(reader.read(chat_of(body), chat=True)).token_ids


def rendered(reader, messages: list[dict]) -> tuple[int, ...]:
    """The prompt of these chat messages, as given (nothing dropped, however long)."""
    return reader.tokenized(ChatCompletionRequest(messages=messages), chat=True)


def conversation(turns: int) -> list[dict]:
    """`turns` user turns, each answered, then a last question."""
    items = []
    for turn in range(turns):
        items += [{"role": "user", "content": f"q{turn} {LONG}"},
                  {"role": "assistant", "content": f"a{turn}"}]
    return items + [{"role": "user", "content": "last"}]


def test_a_long_conversation_is_fitted_by_dropping_its_oldest_turns(reader):
    """Its instructions and last turns kept: the prompt is theirs, whole turns dropped from
    the start, as few as fit the output's room (max_output_tokens)."""
    items = conversation(6)
    body = {"input": items, "instructions": "be brief", "truncation": "auto",
            "max_output_tokens": 8}
    ids = prompt_of(reader, body)
    assert len(ids) + 8 <= reader.context_limit
    system = [{"role": "system", "content": "be brief"}]
    kept = next(k for k in range(1, len(items) + 1, 2)  # the most turns that fit
                if len(rendered(reader, system + items[-k:])) + 8 > reader.context_limit) - 2
    assert 1 < kept < len(items)
    assert ids == rendered(reader, system + items[-kept:])
    text = reader.tokenizer.decode(ids)  # (this tokenizer has no newline)
    assert text.startswith("system: be brief") and text.endswith("user: lastassistant:")
    assert f"q{6 - kept // 2}" in text and f"q{5 - kept // 2}" not in text  # the last dropped


def test_a_conversation_past_the_context_is_still_refused_when_truncation_is_disabled(
        reader):
    for body in ({"input": conversation(6)},
                 {"input": conversation(6), "truncation": "disabled"}):
        with pytest.raises(BadRequest) as refused:
            prompt_of(reader, body)
        assert refused.value.status == 400 and "; the limit is 79" in str(refused.value)


def test_a_call_and_its_result_are_dropped_together(reader):
    """A turn goes whole: the call and its result, never one without the other."""
    items = [{"role": "user", "content": f"q0 {LONG}"},
             {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": LONG * 6},
             {"role": "assistant", "content": "a0"},
             {"role": "user", "content": "q1"},
             {"type": "function_call", "call_id": "c2", "name": "now", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c2", "output": "noon"},
             {"role": "user", "content": "last"}]
    text = reader.tokenizer.decode(prompt_of(reader, {"input": items, "truncation": "auto"}))
    assert "c1" not in text and "q0" not in text
    assert "call c2" in text and "for c2" in text and text.startswith("user: q1")


@pytest.mark.parametrize("items", [
    [{"role": "user", "content": LONG * 12}],  # one turn: nothing to drop
    conversation(1)[:2] + [{"role": "user", "content": LONG * 12}],  # the last, too long
])
def test_a_last_turn_that_does_not_fit_alone_is_refused(reader, items):
    with pytest.raises(BadRequest) as refused:
        prompt_of(reader, {"input": items, "instructions": "be brief", "truncation": "auto"})
    assert refused.value.status == 400 and "; the limit is 79" in str(refused.value)


def read_of(reader, body: dict):
    return asyncio.run(reader.read(chat_of(body), chat=True))


def test_an_output_room_out_of_reach_keeps_the_turns_that_fit_and_cuts_the_output(reader):
    """max_output_tokens past what even the last turn alone leaves: the prompt alone is
    fitted (whole where it fits, as a disabled truncation's) and the output cut to the room
    it leaves, not the whole conversation dropped for a room no dropping gives."""
    items = conversation(2)
    asked = {"input": items, "truncation": "auto", "max_output_tokens": 70}
    whole = rendered(reader, items)
    assert len(whole) < reader.context_limit  # (and the last turn + 70 does not fit)
    assert len(rendered(reader, items[-1:])) + 70 > reader.context_limit
    for body in (asked, {**asked, "truncation": "disabled"}):
        prompt = read_of(reader, body)
        assert prompt.token_ids == whole
        assert prompt.sampling.max_tokens == reader.context_limit - len(whole)
    longer = conversation(6)  # past the context itself: the fewest turns that let it fit
    prompt = read_of(reader, {**asked, "input": longer})
    kept = next(k for k in range(1, len(longer) + 1, 2)
                if len(rendered(reader, longer[-k:])) >= reader.context_limit) - 2
    assert prompt.token_ids == rendered(reader, longer[-kept:]) and kept > 1
    assert prompt.sampling.max_tokens == reader.context_limit - len(prompt.token_ids)


def test_the_fewest_turns_that_fit_are_dropped_in_a_few_renders():
    """A binary search over how many turns go: 64 turns rendered at most 2 + 6 times."""
    renders = []

    def ids_of(body):  # 10 tokens a message
        renders.append(len(body.messages))
        return (1,) * 10 * len(body.messages)

    messages = [{"role": "system", "content": "s"}] + conversation(64)
    body = ResponsesChat(messages=messages, max_tokens=20, truncation="auto")
    ids = fitted(body, ids_of, 500)  # 48 messages: the system one, the last, 23 turns
    assert len(ids) == 480 and len(renders) <= 8


def test_the_response_echoes_auto_and_counts_the_tokens_sent(reader):
    """Served through the router's path (its prompt read by the reader): the Response says
    truncation auto, and its input_tokens are the fitted prompt's."""
    body = {"model": "m", "input": conversation(6), "truncation": "auto", "temperature": 0}
    sent = prompt_of(reader, body)
    router = stand_in("Paris.")
    router.decode = router.tool_decode = router.special_decode = \
        lambda ids: "".join("Paris."[i - 10] for i in ids if 10 <= i < 16)
    tokens = list(range(10, 16))
    router.pools = lambda kind=None: (Scripted(tokens, prompt_len=len(sent)),
                                      Scripted(tokens, prompt_len=len(sent)))

    async def plan(chat, is_chat):
        prompt = await reader.read(chat, is_chat)
        return RequestFrontEnd().plan("chatcmpl-x", prompt.token_ids, prompt.sampling, n=1,
                                      stop_token_ids=(0,))

    router.plan = plan
    answer = asyncio.run(Router.serve_request(router, posted(body), ResponsesRequest))
    response = json.loads(answer.body)
    assert Response.model_validate(response).truncation == "auto"
    assert response["usage"]["input_tokens"] == len(sent) < len(rendered(
        reader, [m.for_template() for m in chat_of(body).messages]))
    assert response["output"][0]["content"][0]["text"] == "Paris."


def test_a_stored_response_keeps_the_whole_conversation(reader):
    """What a continuation reads is every message (each turn fitted again), as OpenAI's
    input items keep them: only the prompt sent is fitted."""
    served = Served("Paris.", reader)
    _, first = served.post({"input": conversation(6), "truncation": "auto"})
    _, second = served.post({"input": "and then?", "truncation": "auto",
                             "previous_response_id": first["id"]})
    assert second["status"] == "completed"
    given = served.messages[-1]  # the chat's messages: the whole stored conversation
    assert given == conversation(6) + [{"role": "assistant", "content": "Paris."},
                                       {"role": "user", "content": "and then?"}]
    sent = reader.tokenizer.decode(served.prompts[-1])
    assert "q0" not in sent and sent.endswith("user: and then?assistant:")

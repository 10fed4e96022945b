"""Edges of a request's choices as a client reads them (deployments.choices, deployments.beams,
deployments.chat_batch): each prompt's own ids on its choices, the usage chunk, a stop id's
last chunk, a reasoning delta, a failed stream; beam search's top logprobs, width and
prompts; what a batch of chats adds up, admits or refuses."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from deployments.admission import Admission
from deployments.beams import choices_kind, refuse_unsearched
from deployments.chat_batch import BatchChatRequest, added
from deployments.choices import Choices
from deployments.ingress import BadRequest
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from deployments.request_bounds import MAX_CHOICES
from deployments.tools import FieldError
from speculative.beams import MAX_BEAM_WIDTH
from speculative.frontend import RequestFrontEnd, joined
from speculative.sampling import SamplingParams
from speculative.types import PoolUnavailable
from tests.tiny import Agreeing, noisy_copy, tiny_llama
from tests.unit.test_beam_search import (
    CHAT,
    EOS,
    MAX_TOKENS,
    PROMPT,
    beam_choices,
    decode,
    fields,
    reference,
)
from tests.unit.test_chat_batch import CONVERSATIONS, batched, router_of
from tests.unit.test_reasoning import whole_and_streamed
from tests.unit.test_router_parts import Recorded
from verifier.engine import ModelVerifier

PROMPTS = [(2, 3), (7, 8, 9)]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(11)  # test_beam_search's


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(7)  # test_chat_batch's
    return target, noisy_copy(target, 0.05, seed=1)


def two_prompts(chat: bool = False, n: int = 1, **options) -> Choices:
    """A completions batch of PROMPTS (n choices each) over an agreeing pair: every output
    token is 1, decoded as "a"."""
    sampling = SamplingParams(temperature=0.0, max_tokens=3)
    plans = [RequestFrontEnd().plan(f"cmpl-x-{i}", ids, sampling, n=n)
             for i, ids in enumerate(PROMPTS)]
    engine = Agreeing()
    return Choices(joined("cmpl-x", plans), (engine, engine), lambda ids: "a" * len(ids),
                   Recorded(), Admission(8).admit(len(PROMPTS) * n), model="m", chat=chat,
                   return_token_ids=True, **options)


def events_of(choices: Choices) -> list[str]:
    """The stream's events as sent, [DONE] last."""
    async def collect():
        return [event async for event in choices.events()]

    return asyncio.run(collect())


def streamed(choices: Choices) -> list[dict]:
    return [json.loads(e[len("data: "):]) for e in events_of(choices)[:-1]]


def test_each_completion_choice_names_its_own_prompts_ids():
    """vLLM's return_token_ids on a completions batch: choice i's prompt_token_ids are its
    own prompt's (the first prompt's n choices, then the next's), not the first prompt's."""
    body = asyncio.run(two_prompts(n=2).complete())
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [tuple(c["prompt_token_ids"]) for c in body["choices"]] == \
        [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    assert body["usage"]["prompt_tokens"] == 5  # each prompt counted once


def test_each_streamed_completion_choice_ends_with_its_own_prompts_ids():
    chunks = streamed(two_prompts(n=2))
    last = {c["choices"][0]["index"]: c["choices"][0] for c in chunks
            if c["choices"][0]["finish_reason"] is not None}
    assert {i: tuple(c["prompt_token_ids"]) for i, c in last.items()} == \
        {0: PROMPTS[0], 1: PROMPTS[0], 2: PROMPTS[1], 3: PROMPTS[1]}
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks
               if c["choices"][0]["finish_reason"] is None)


@pytest.mark.parametrize("chat", [False, True])
def test_a_streams_usage_chunk_is_of_the_requests_object_with_no_choices(chat):
    """OpenAI's usage chunk: the stream's own object (chat.completion.chunk, or vLLM's
    text_completion), id and created, and an empty choices list."""
    chunks = streamed(two_prompts(chat=chat, include_usage=True))
    usage = chunks[-1]
    assert usage["object"] == ("chat.completion.chunk" if chat else "text_completion")
    assert usage["choices"] == [] and usage["id"] == chunks[0]["id"]
    assert usage["created"] == chunks[0]["created"]
    counts = {k: usage["usage"][k] for k in ("prompt_tokens", "completion_tokens",
                                             "total_tokens")}
    assert counts == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


def test_a_beam_searchs_top_logprobs_are_the_n_asked_for(target):
    """As vLLM's: each token's top_logprobs are the request's top_logprobs best of the 2 x
    width the search read, not all of them."""
    top_n, width = 2, 3
    body = ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=top_n,
                                 **fields(width, False, 1.0, False))
    answer = asyncio.run(beam_choices(target, body, True).complete())
    expected = reference(target, PROMPT, width, False, 1.0, False, EOS)
    for choice, (tokens, _, _, rows) in zip(answer["choices"], expected):
        content = choice["logprobs"]["content"]
        assert len(content) == len(tokens)
        for entry, row in zip(content, rows):
            assert [t["logprob"] for t in entry["top_logprobs"]] == \
                pytest.approx([logprob for _, logprob in row[:top_n]], abs=1e-4)


def test_a_batchs_usage_adds_up_the_conversations_details_field_by_field():
    """A detail one conversation's usage has and another's not (a prediction's counts, the
    reasoning tokens) is kept; one both have is added, not the last one's."""
    usages = [{"prompt_tokens": 3, "completion_tokens_details": {"reasoning_tokens": 2}},
              {"prompt_tokens": 4, "completion_tokens_details": {"reasoning_tokens": 5,
                                                                 "accepted_prediction_tokens": 1},
               "prompt_tokens_details": {"cached_tokens": 2}}]
    assert added(usages) == {
        "prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 7, "accepted_prediction_tokens": 1}}


def test_a_batch_takes_up_to_max_choices_conversations():
    conversation = [{"role": "user", "content": "hi"}]
    batch = BatchChatRequest.model_validate({"model": "m",
                                             "messages": [conversation] * MAX_CHOICES})
    assert len(batch.chats) == MAX_CHOICES
    with pytest.raises(BadRequest) as refused:
        BatchChatRequest.model_validate({"model": "m",
                                         "messages": [conversation] * (MAX_CHOICES + 1)})
    assert refused.value.param == "messages"


@pytest.mark.parametrize("chat", [False, True])
def test_a_streamed_choice_ended_by_a_stop_id_ends_on_an_empty_delta_naming_the_id(chat):
    """As OpenAI's and vLLM's: a round that ends at the request's stop id (its text not
    shown) and brings no text ends on an empty delta ({}, a completion's text ""), its
    stop_reason naming the id, as the whole answer's does."""
    sampling = SamplingParams(temperature=0.0, max_tokens=8)
    plan = RequestFrontEnd().plan("cmpl-s", (2, 3), sampling, n=1, stop_token_ids=(1,))
    engine = Agreeing()  # its first token is the stop id

    def choices():
        return Choices(plan, (engine, engine), lambda ids: "a" * len(ids), Recorded(),
                       Admission(1).admit(1), model="m", chat=chat, return_token_ids=False,
                       stop_token_ids=(1,))

    whole = asyncio.run(choices().complete())["choices"][0]
    assert (whole["finish_reason"], whole["stop_reason"]) == ("stop", 1)
    final = streamed(choices())[-1]["choices"][0]
    assert (final["finish_reason"], final["stop_reason"]) == ("stop", 1)
    assert (final["delta"] == {}) if chat else (final["text"] == "")


@pytest.mark.parametrize("chat", [False, True])
def test_a_beam_search_takes_the_widest_beam_and_top_k_disabled_as_minus_one(chat):
    """The width's bound is inclusive (2 x MAX_BEAM_WIDTH logprobs a step are served), and
    top_k -1 (vLLM's 'no top-k', as 0) asks the search for nothing it would ignore."""
    for extra in ({"n": MAX_BEAM_WIDTH}, {"n": 2, "top_k": -1}, {"n": 2, "top_k": 0}):
        given = {"use_beam_search": True, **extra}
        body = ChatCompletionRequest(messages=CHAT, **given) if chat else \
            CompletionRequest(prompt="x", **given)
        refuse_unsearched(body, chat)
    body = CompletionRequest(prompt="x", use_beam_search=True, n=MAX_BEAM_WIDTH + 1)
    with pytest.raises(FieldError):
        refuse_unsearched(body, False)


def test_a_completions_batchs_beam_search_answers_each_prompts_beams_in_turn(
        target):
    """As a completions batch's choices: the first prompt's n best beams, then the next's."""
    width, other = 2, [9, 3, 27]
    body = CompletionRequest(prompt="x", **fields(width, False, 1.0, False))
    sampling = body.sampling(MAX_TOKENS)
    plans = [RequestFrontEnd().plan(f"cmpl-b-{i}", ids, sampling, n=width)
             for i, ids in enumerate((PROMPT, other))]
    prompts = SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=EOS))
    choices = choices_kind(body, prompts)(
        joined("cmpl-b", plans), (None, ModelVerifier(target)), decode, Recorded(),
        Admission(16).admit(2 * width), model="m", chat=False, return_token_ids=True)
    answer = asyncio.run(choices.complete())
    expected = [tokens for prompt in (PROMPT, other)
                for tokens, *_ in reference(target, prompt, width, False, 1.0, False, EOS)]
    assert [tuple(c["token_ids"]) for c in answer["choices"]] == expected
    assert [tuple(c["prompt_token_ids"]) for c in answer["choices"]] == \
        [tuple(PROMPT)] * width + [tuple(other)] * width


def test_a_reasoning_delta_under_continuous_usage_has_no_empty_content():
    """As vLLM's DeltaMessage(reasoning=...): a chunk of reasoning alone has no content field
    (not content ""), when it is the fuller chunk continuous usage sends."""
    _, deltas = whole_and_streamed("<think>one two three four</think>the end",
                                   continuous_usage=True, miss=2)
    thoughts = [d["delta"] for d in deltas if d["delta"].get("reasoning")]
    assert thoughts and all("content" not in delta for delta in thoughts)
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "the end"


class FailingVerifier(Agreeing):
    async def score(self, call):
        raise PoolUnavailable("verifier: UNAVAILABLE")


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_whose_verifier_fails_ends_with_an_error_event_then_done(chat):
    """The status is sent already: the failure comes as an error chunk (the pool's 503),
    then [DONE], and the request's slots go back."""
    admission = Admission(2)
    plan = RequestFrontEnd().plan("cmpl-f", (2, 3), SamplingParams(temperature=0.0,
                                                                    max_tokens=4), n=2)
    choices = Choices(plan, (Agreeing(), FailingVerifier()), lambda ids: "a" * len(ids),
                      Recorded(), admission.admit(2), model="m", chat=chat,
                      return_token_ids=False, include_usage=True)
    events = events_of(choices)
    assert events[-1] == "data: [DONE]\n\n" and admission.running == 0
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["type"] == "server_error"
    assert all("usage" not in json.loads(e[len("data: "):]) for e in events[:-1])


def test_a_batch_holds_a_slot_per_conversation_while_it_runs(pair):
    """Admitted as a chat's n choices: the conversations' slots are taken before any runs
    (one slot for all let other requests run past max_running)."""
    router, running = router_of(pair), []
    choices = router.choices

    def counted(*args, **kwargs):
        running.append(router.admission.running)
        return choices(*args, **kwargs)

    router.choices = counted
    status, _ = batched(router, {"model": "m", "max_tokens": 2, "temperature": 0,
                                 "messages": CONVERSATIONS})
    assert status == 200 and running == [len(CONVERSATIONS)] * len(CONVERSATIONS)


def test_a_batch_refuses_prompt_logprobs_0_which_asks_for_the_prompts_own():
    """prompt_logprobs 0 asks for each prompt token's own logprob (vLLM's): refused, as any
    count; false and null ask for none."""
    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(BadRequest) as refused:
        BatchChatRequest.model_validate({"model": "m", "messages": [conversation],
                                         "prompt_logprobs": 0})
    assert refused.value.param == "prompt_logprobs"
    for none in (False, None):
        BatchChatRequest.model_validate({"model": "m", "messages": [conversation],
                                         "prompt_logprobs": none})

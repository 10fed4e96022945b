"""The request bodies' bounds at their edges, as OpenAI's and vLLM's servers draw them: the
last value in is accepted and the first beyond is refused naming its field (a bound off by
one either way changes what a client gets), and the cross-field checks hold for chat too."""

import asyncio
import json

import pytest
from pydantic import ValidationError

from deployments.ingress import BadRequest, parse
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from deployments.request_bounds import MAX_CHOICES, MAX_STOP_STRINGS
from speculative.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS
from tests.unit.test_request_fields import request_with

CHAT = [{"role": "user", "content": "hi"}]


def refused_param(schema, fields: dict) -> str:
    """The field a 400 names for the body (as a client reads it), via the ingress' parse."""
    with pytest.raises(BadRequest) as refused:
        asyncio.run(parse(request_with(json.dumps(fields).encode()), schema, 1 << 20))
    assert refused.value.status == 400
    return refused.value.param


def test_chat_n_is_bounded_by_the_choices_limit():
    """Chat has no prompts x n check of its own: n's field bound is all that refuses it."""
    assert ChatCompletionRequest(messages=CHAT, n=MAX_CHOICES).n == MAX_CHOICES
    assert refused_param(ChatCompletionRequest, {"messages": CHAT, "n": MAX_CHOICES + 1}) \
        == "n"


@pytest.mark.parametrize("bias", [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS])
def test_logit_bias_takes_its_closed_range(bias):
    assert CompletionRequest(prompt="x", logit_bias={"5": bias}).logit_bias == {5: bias}
    beyond = bias + (1 if bias > 0 else -1) * 0.5
    assert refused_param(CompletionRequest, {"prompt": "x", "logit_bias": {"5": beyond}}) \
        == "logit_bias.5"


def test_top_logprobs_and_logprobs_take_up_to_the_limit():
    chat = ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=MAX_LOGPROBS)
    assert chat.top_logprobs_asked() == MAX_LOGPROBS
    assert refused_param(ChatCompletionRequest, {"messages": CHAT, "logprobs": True,
                                                 "top_logprobs": MAX_LOGPROBS + 1}) \
        == "top_logprobs"
    completion = CompletionRequest(prompt="x", logprobs=MAX_LOGPROBS)
    assert completion.top_logprobs_asked() == MAX_LOGPROBS
    assert refused_param(CompletionRequest, {"prompt": "x", "logprobs": MAX_LOGPROBS + 1}) \
        == "logprobs"


def test_top_logprobs_zero_alone_asks_for_nothing():
    """vLLM's default, sent by clients that send every field: not a 400."""
    assert ChatCompletionRequest(messages=CHAT, top_logprobs=0).top_logprobs_asked() is None
    assert refused_param(ChatCompletionRequest, {"messages": CHAT, "top_logprobs": 1}) \
        == "top_logprobs"


def test_best_of_below_n_is_refused():
    assert refused_param(CompletionRequest, {"prompt": "x", "best_of": 1, "n": 2}) == "best_of"


def refusal(schema, fields: dict) -> str:
    """The message of the 400 a body gets."""
    with pytest.raises(BadRequest) as refused:
        asyncio.run(parse(request_with(json.dumps(fields).encode()), schema, 1 << 20))
    return str(refused.value)


@pytest.mark.parametrize("fields, said", [({"best_of": 1, "n": 2}, "at least n (2), got 1"),
                                          ({"best_of": 0}, "at least n (1), got 0"),
                                          ({"best_of": 3, "n": 2}, "not supported beyond n")])
def test_best_of_refusal_says_which_side_of_n_it_is(fields, said):
    """OpenAI's and vLLM's: best_of below n is a bound the client broke ("must be greater
    than or equal to n"), not a feature beyond n that the server lacks."""
    assert said in refusal(CompletionRequest, {"prompt": "x", **fields})
    assert said in refusal(ChatCompletionRequest, {"messages": CHAT, **fields})


def test_a_user_that_is_not_a_string_is_refused():
    """OpenAI's and vLLM's `user` is a string: 5 was dropped unread with the unknown fields."""
    assert refused_param(CompletionRequest, {"prompt": "x", "user": 5}) == "user"
    assert refused_param(ChatCompletionRequest, {"messages": CHAT, "user": [1]}) == "user"
    assert CompletionRequest(prompt="x", user="u-1").user == "u-1"


def test_truncate_prompt_tokens_zero_is_refused():
    for kept in (-1, 1):
        assert CompletionRequest(prompt="x", truncate_prompt_tokens=kept)
    assert refused_param(CompletionRequest, {"prompt": "x", "truncate_prompt_tokens": 0}) \
        == "truncate_prompt_tokens"


def test_chat_max_tokens_zero_is_refused_even_with_echo():
    """Only a completion's echo serves max_tokens 0 (the prompt alone)."""
    assert CompletionRequest(prompt="x", max_tokens=0, echo=True).max_tokens == 0
    assert refused_param(ChatCompletionRequest, {"messages": CHAT, "max_tokens": 0,
                                                 "echo": True}) == "max_tokens"
    assert refused_param(ChatCompletionRequest, {"messages": CHAT,
                                                 "max_completion_tokens": 0}) \
        == "max_completion_tokens"


def test_a_batch_at_the_choices_limit_is_accepted():
    assert len(CompletionRequest(prompt=["x"] * MAX_CHOICES).prompts()) == MAX_CHOICES
    assert len(CompletionRequest(prompt=["x"] * (MAX_CHOICES // 2), n=2).prompts()) \
        == MAX_CHOICES // 2
    with pytest.raises(ValidationError, match="choices; the limit"):
        CompletionRequest(prompt=["x"] * (MAX_CHOICES // 2 + 1), n=2)


def test_continue_final_message_needs_the_generation_prompt_off():
    reply = [*CHAT, {"role": "assistant", "content": "Hel"}]
    assert ChatCompletionRequest(messages=reply, continue_final_message=True,
                                 add_generation_prompt=False).continue_final_message
    with pytest.raises(ValidationError, match="needs add_generation_prompt: false"):
        ChatCompletionRequest(messages=reply, continue_final_message=True)


def test_stop_takes_up_to_its_count_of_non_empty_strings():
    stops = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert CompletionRequest(prompt="x", stop=stops).stop == stops
    for bad in (stops + ["t"], [""], ""):
        assert refused_param(CompletionRequest, {"prompt": "x", "stop": bad}) == "stop"


def test_top_p_zero_is_refused():
    assert refused_param(CompletionRequest, {"prompt": "x", "top_p": 0}) == "top_p"


def test_max_completion_tokens_wins_over_max_tokens():
    """OpenAI's newer field over its deprecated one, as vLLM."""
    both = CompletionRequest(prompt="x", max_tokens=5, max_completion_tokens=9)
    assert both.sampling(16).max_tokens == 9

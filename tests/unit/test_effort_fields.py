"""The reasoning effort the Responses and Messages translations ask of the chat, as vLLM 0.32
maps theirs: the Responses' reasoning.effort as the chat's reasoning_effort; Anthropic's
output_config.effort, and thinking disabled as "none" (its budget checked, and ignored).
A value vLLM refuses is a 400 naming the field. The chat's own: test_prompt_fields."""

import asyncio
import copy

import pytest
from openai.types.responses import Response

from deployments.ingress import BadRequest, parse
from deployments.messages_api import CountTokensRequest, MessagesRequest
from deployments.router import Router
from tests.unit.test_chat_template_kwargs import THINKING
from tests.unit.test_messages_api import (  # noqa: F401 (reader: a fixture)
    HI,
    messages_router,
    posted_to,
    reader,
)
from tests.unit.test_prompt_fields import EFFORT
from tests.unit.test_responses_api import answered
from tests.unit.test_responses_request import chat_of, refusal
from tests.unit.test_router_parts import posted


def message_chat(body: dict, schema=MessagesRequest):
    asked = asyncio.run(parse(posted({"model": "m", "max_tokens": 2000, "messages": HI,
                                      **body}), schema, 1 << 16))
    return asked.chat_request()[0]


def effort_reader(reader):
    """`reader` with a template that writes reasoning_effort and reads Qwen3's
    enable_thinking (an empty think block where it is false)."""
    written = copy.copy(reader)
    written.tokenizer = copy.deepcopy(reader.tokenizer)
    written.tokenizer.chat_template = EFFORT + THINKING
    return written


def rendered(reader, chat) -> str:
    """The chat's prompt under effort_reader's template."""
    written = effort_reader(reader)
    return written.tokenizer.decode(written.token_ids(chat, chat=True))


@pytest.mark.parametrize("reasoning, kwargs, effort, thinks", [
    ({"effort": "high", "summary": "auto"}, None, "high", True),
    ({"effort": "none"}, None, "none", False),
    ({"effort": "none"}, {"enable_thinking": True}, "none", True),  # the kwargs' own kept
    ({"effort": "low"}, {"reasoning_effort": "max"}, "low", True),  # the field's over theirs
    ({"summary": "concise"}, None, None, True), (None, None, None, True)])
def test_a_responses_effort_is_the_chats_reasoning_effort(reader, reasoning, kwargs,
                                                          effort, thinks):
    """reasoning.effort reaches the template as vLLM's Responses serving passes it (the
    chat's reasoning_effort: enable_thinking false for "none" where chat_template_kwargs
    sets none); a summary asks for nothing."""
    chat = chat_of({"input": "hi", "reasoning": reasoning, "chat_template_kwargs": kwargs})
    assert chat.reasoning_effort == effort
    text = rendered(reader, chat)
    assert text.startswith(f"effort={effort}\n" if effort else "<|im_start|>user")
    assert text.endswith("assistant\n") == thinks


@pytest.mark.parametrize("reasoning, param", [
    ({"effort": "extreme"}, "reasoning.effort"), ({"effort": 3}, "reasoning.effort"),
    ({"effort": "low", "summary": "long"}, "reasoning.summary"),
    ({"generate_summary": "brief"}, "reasoning.generate_summary"),
    ("high", "reasoning")])
def test_a_reasoning_value_vllm_refuses_is_a_400_naming_it(reasoning, param):
    refused = refusal({"input": "hi", "reasoning": reasoning})
    assert refused.status == 400 and refused.param == param


def test_the_response_echoes_the_reasoning_asked_for():
    body = answered("Paris.", {"reasoning": {"effort": "low", "generate_summary": "auto"}})
    assert Response.model_validate(body).reasoning.effort == "low"
    assert body["reasoning"] == {"effort": "low", "summary": "auto"}
    assert answered("Paris.", {})["reasoning"] is None


@pytest.mark.parametrize("fields, effort", [
    ({"output_config": {"effort": "xhigh"}}, "xhigh"),
    ({"thinking": {"type": "disabled"}}, "none"),
    ({"output_config": {"effort": "high"}, "thinking": {"type": "disabled"}}, "none"),
    ({"output_config": {"effort": "max"}, "thinking": {"type": "adaptive",
                                                       "display": "omitted"}}, "max"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, None),  # (no budget here)
    ({"output_config": {"effort": "low"},
      "thinking": {"type": "enabled", "budget_tokens": 1999}}, "low"), ({}, None)])
def test_anthropics_effort_and_thinking_are_the_chats_reasoning_effort(fields, effort):
    """As vLLM's anthropic serving maps them: output_config.effort, thinking disabled
    "none" over it, adaptive and enabled pinning nothing (count_tokens alike)."""
    assert message_chat(fields).reasoning_effort == effort
    assert message_chat(fields, CountTokensRequest).reasoning_effort == effort


def test_thinking_disabled_renders_and_counts_a_prompt_that_does_not_think(reader):
    """A Qwen3 template told enable_thinking false: its empty think block, in the message's
    prompt and in count_tokens' count."""
    assert rendered(reader, message_chat({"thinking": {"type": "disabled"}})).endswith(
        "effort=none\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    router = messages_router()
    router.prompts = effort_reader(reader)
    body = {"model": "m", "messages": HI}
    counts = [posted_to(router, {**body, **fields}, Router.count_tokens)[1]["input_tokens"]
              for fields in ({}, {"thinking": {"type": "disabled"}})]
    chat = message_chat({"thinking": {"type": "disabled"}}, CountTokensRequest)
    assert counts[1] == len(router.prompts.token_ids(chat, True)) > counts[0]


@pytest.mark.parametrize("fields, param", [
    ({"output_config": {"effort": "none"}}, "output_config.effort"),  # not Anthropic's
    ({"output_config": {"effort": "minimal"}}, "output_config.effort"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"thinking": {"budget_tokens": 2048}}, "thinking.type"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1023}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": "2048"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "adaptive", "display": "loud"}}, "thinking.display"),
    ({"thinking": "on"}, "thinking")])
def test_a_thinking_or_effort_vllm_refuses_is_a_400_naming_it(fields, param):
    """vLLM's refusals: an effort Anthropic does not name, a thinking of another type, an
    enabled one without a budget of at least 1024 below max_tokens (2000 here)."""
    with pytest.raises(BadRequest) as refused:
        message_chat(fields)
    assert refused.value.status == 400 and refused.value.param == param
    assert str(refused.value).startswith(param)

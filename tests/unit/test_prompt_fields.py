"""vLLM's fields that shape a prompt: truncation_side (with truncate_prompt_tokens) and
OpenAI's reasoning_effort, as vLLM passes it to the chat template."""

import copy
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from deployments.openai_api import ChatCompletionRequest
from tests.unit.test_chat_prompts import (  # noqa: F401 (reader: a fixture)
    prompt_ids,
    reader,
    reader_of,
    with_bos,
)
from tests.unit.test_chat_template_kwargs import THINKING


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_truncation_side_given_cuts_the_whole_ids_from_that_side(reader, side):
    """vLLM's truncation_side, given: the tokenizer does not truncate and the whole ids are
    cut, "left" keeping their last k (a BOS cut with the rest), "right" their first k; a
    text, ids and a chat alike. Unset, the tokenizer's left truncation (test_chat_prompts)."""
    from deployments.openai_api import CompletionRequest

    tokenizer, bos = with_bos(reader)
    reader, text = reader_of(tokenizer), "hello world, answer in French " * 3
    whole = tokenizer(text)["input_ids"]
    cut = tuple(whole[-4:] if side == "left" else whole[:4])
    for prompt in (text, whole):
        body = CompletionRequest(prompt=prompt, truncate_prompt_tokens=4, truncation_side=side)
        assert reader.token_ids(body, False) == cut
    messages = [{"role": "user", "content": text}]
    chat = ChatCompletionRequest(messages=messages, add_special_tokens=True)
    rendered = reader.token_ids(chat, True)
    kept = reader.token_ids(chat.model_copy(update={"truncate_prompt_tokens": 4,
                                                    "truncation_side": side}), True)
    assert kept == (rendered[-4:] if side == "left" else rendered[:4])
    assert (kept[0] == bos) == (side == "right")
    unset = CompletionRequest(prompt=text, truncate_prompt_tokens=4)
    assert reader.token_ids(unset, False)[0] == bos  # the tokenizer's own, from the left


def test_truncation_side_is_left_or_right():
    from pydantic import ValidationError

    from deployments.openai_api import CompletionRequest

    with pytest.raises(ValidationError, match="'left' or 'right'"):
        CompletionRequest(prompt="x", truncation_side="middle")
    assert CompletionRequest(prompt="x", truncation_side=None).truncation_side is None


EFFORT = "{%- if reasoning_effort is defined %}{{- 'effort=' + reasoning_effort + '\\n' }}" \
    "{%- endif %}"


@pytest.mark.parametrize("effort, kwargs, written, thinks", [
    ("low", {}, "effort=low", True), ("none", {}, "effort=none", False),
    ("none", {"enable_thinking": True}, "effort=none", True),  # the kwargs' own kept
    ("high", {"reasoning_effort": "low"}, "effort=high", True),  # the field's over theirs
    (None, {"reasoning_effort": "low"}, "effort=low", True), (None, {}, "", True)])
def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(reader, effort, kwargs,
                                                                  written, thinks):
    """OpenAI's reasoning_effort, as vLLM gives it to the chat template: as the variable
    reasoning_effort (over chat_template_kwargs'), and enable_thinking false for "none",
    true for another, where chat_template_kwargs gives none (Qwen3's, Gemma 4's); a
    template that reads neither renders as without it. The Qwen3 parser splits no
    reasoning off where the template was told not to think."""
    from deployments.reasoning import request_split

    tokenizer = copy.deepcopy(reader.tokenizer)
    tokenizer.chat_template = EFFORT + THINKING
    thinking = reader_of(tokenizer)
    hello = [{"role": "user", "content": "hello"}]
    body = ChatCompletionRequest(messages=hello, reasoning_effort=effort,
                                 chat_template_kwargs=kwargs)
    text = tokenizer.decode(thinking.token_ids(body, chat=True))
    assert text.startswith(written + "\n" if written else "<|im_start|>user")
    assert text.endswith("assistant\n") == thinks
    plan = SimpleNamespace(choices=[])
    assert (request_split("qwen3", body, plan) is not None) == thinks
    assert prompt_ids(reader, hello, reasoning_effort="none") == prompt_ids(reader, hello)
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=hello, reasoning_effort="extreme")

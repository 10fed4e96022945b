"""What a request's accepted fields ask of its prompt and its sampling, as vLLM reads them:
special tokens added, stop ids, logprobs (chat's and a completion's), max_completion_tokens,
stop strings to their bounds, seeds, cache_salt, top logprobs within the vocabulary, prompt
logprobs and echo."""

import pytest
from pydantic import ValidationError

from deployments.ingress import BadRequest
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from deployments.prompts import PromptReader
from tests.unit.test_request_fields import CHAT


class MarksSpecials:
    """A tokenizer that puts a BOS (id 1) first when asked for special tokens, as Llama's."""

    def __call__(self, text: str, add_special_tokens: bool) -> dict:
        return {"input_ids": [1] * add_special_tokens + [2 + len(word) for word in text.split()]}

    chat_template = "the messages' contents, spaced"

    def apply_chat_template(self, messages, **options) -> str:
        return " ".join(message["content"] for message in messages)


@pytest.mark.parametrize("body, chat, first", [
    ({"prompt": "one two"}, False, 1),  # vLLM's defaults: a completions prompt gets BOS
    ({"prompt": "one two", "add_special_tokens": False}, False, 5),
    ({"messages": [{"role": "user", "content": "one two"}]}, True, 5),  # the template's own
    ({"messages": [{"role": "user", "content": "one"}], "add_special_tokens": True}, True, 1),
])
def test_special_tokens_are_added_as_vllm_adds_them(body, chat, first):
    reader = PromptReader.__new__(PromptReader)  # its tokenizing alone
    reader.tokenizer, reader.vocab_size, reader.context_limit = MarksSpecials(), 100, 1000
    parsed = (ChatCompletionRequest if chat else CompletionRequest)(model="m", **body)
    assert reader.token_ids(parsed, chat)[0] == first


def test_an_end_token_asked_as_a_stop_id_is_named_only_under_ignore_eos():
    """As vLLM: the model's end token ends the output first, with no stop_reason."""
    reader = PromptReader.__new__(PromptReader)  # its stop ids alone
    reader.end_ids = (2,)
    for ignore_eos, reported in ((False, (7,)), (True, (2, 7))):
        body = CompletionRequest(prompt="x", stop_token_ids=[2, 7], ignore_eos=ignore_eos)
        assert reader.reported_stop_ids(body) == reported


def test_chat_logprobs_alone_ask_for_each_tokens_own_logprob():
    """logprobs: true without top_logprobs (OpenAI's commonest form) returns each token's
    logprob with an empty top list: 0 top entries, not no logprobs at all."""
    assert ChatCompletionRequest(messages=CHAT, logprobs=True).sampling(16).logprobs == 0
    assert ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=3) \
        .sampling(16).logprobs == 3
    assert ChatCompletionRequest(messages=CHAT).sampling(16).logprobs is None


def test_a_top_logprobs_of_zero_without_logprobs_asks_for_nothing():
    """vLLM's default (top_logprobs 0, logprobs false, as a client that sends every field
    sends them) asks for no logprobs and is taken, as vLLM takes it; a top n is not."""
    for logprobs in (False, None):
        chat = ChatCompletionRequest(messages=CHAT, logprobs=logprobs, top_logprobs=0)
        assert chat.sampling(16).logprobs is None
    with pytest.raises(ValidationError, match="needs logprobs"):
        ChatCompletionRequest(messages=CHAT, top_logprobs=1)


def test_completions_logprobs_false_asks_for_none():
    """A completion's logprobs is a count, but a client may send chat's boolean: false is off
    (JSON's false read as the count 0 returned every token's logprob, and ran each round
    without a draft one step at a time)."""
    assert CompletionRequest(prompt="x", logprobs=False).sampling(16).logprobs is None
    assert CompletionRequest(prompt="x", logprobs=0).sampling(16).logprobs == 0


def test_max_completion_tokens_is_read_before_max_tokens():
    """OpenAI's newer field (vLLM reads it first); the older one, else the default."""
    def max_tokens(**fields):
        return ChatCompletionRequest(messages=CHAT, **fields).sampling(16).max_tokens

    assert max_tokens(max_completion_tokens=5) == 5
    assert max_tokens(max_tokens=9, max_completion_tokens=5) == 5
    assert max_tokens(max_tokens=9) == 9 and max_tokens() == 16


def test_stop_takes_up_to_its_bounds_exactly():
    """Up to MAX_STOP_STRINGS stop strings (lm-evaluation-harness sends humaneval's five and
    the end text), each up to MAX_STOP_CHARS, MAX_STOP_TOTAL_CHARS in all, are taken; one
    more string or character is not."""
    from deployments.request_bounds import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOTAL_CHARS

    longest = [chr(ord("a") + i) * MAX_STOP_CHARS
               for i in range(MAX_STOP_TOTAL_CHARS // MAX_STOP_CHARS)]
    most = [f"{i:02d}" for i in range(MAX_STOP_STRINGS)]
    for stops in (longest, most):
        assert CompletionRequest(prompt="x", stop=stops).sampling(16).stop == tuple(stops)
    for bad in (longest + ["e"], most + ["e"], ["s" * (MAX_STOP_CHARS + 1)]):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="x", stop=bad)


def test_int64_seeds_of_opposite_signs_stay_apart():
    seeds = {CompletionRequest(prompt="x", seed=seed).sampling(16).seed for seed in (2, -2)}
    assert len(seeds) == 2 and None not in seeds


@pytest.mark.parametrize("schema, fields", [(CompletionRequest, {"prompt": "x"}),
                                            (ChatCompletionRequest, {"messages": CHAT})])
def test_a_seed_of_minus_one_is_no_seed_as_vllms(schema, fields):
    """vLLM's SamplingParams takes seed -1 as none: each request a new draw (it was the
    seed 2**64 - 1 here, so every such request repeated the same output)."""
    assert schema(**fields, seed=-1).sampling(16).seed is None
    assert schema(**fields, seed=-2).sampling(16).seed == 2**64 - 2


def test_a_cache_salt_is_bounded_as_vllms():
    """vLLM 0.32 takes a cache_salt of 1 to 1,024 characters."""
    assert CompletionRequest(prompt="x", cache_salt="s" * 1024).sampling(16).cache_salt
    for salt in ("", "s" * 1025):
        with pytest.raises(ValidationError, match="cache_salt"):
            CompletionRequest(prompt="x", cache_salt=salt)


@pytest.mark.parametrize("chat, fields, param", [
    (False, {"logprobs": 17}, "logprobs"),
    (True, {"logprobs": True, "top_logprobs": 17}, "top_logprobs")])
def test_more_top_logprobs_than_the_vocabulary_are_a_400_naming_the_field(chat, fields, param):
    """The pools refuse them (a 503: their INVALID_ARGUMENT is the router's fault); the
    router knows the vocabulary and refuses first, as it does top_k."""
    reader = PromptReader.__new__(PromptReader)  # its checks of sizes alone
    reader.vocab_size, reader.max_prompt_bytes = 16, 1 << 20
    schema = ChatCompletionRequest if chat else CompletionRequest
    prompt = {"messages": CHAT} if chat else {"prompt": "x"}
    with pytest.raises(BadRequest) as refused:
        reader.check_sizes(schema(**prompt, **fields), chat)
    assert refused.value.param == param and "vocabulary size (16)" in str(refused.value)
    at_most = {**fields, param: 16} if chat else {"logprobs": 16}
    reader.check_sizes(schema(**prompt, **at_most), chat)


@pytest.mark.parametrize("schema, fields", [(CompletionRequest, {"prompt": "x"}),
                                            (ChatCompletionRequest, {"messages": CHAT})])
def test_prompt_logprobs_are_asked_as_vllm_asks_them(schema, fields):
    """A top n in [0, 20]; vLLM's -1 (the whole vocabulary) refused with what is served;
    not with a stream, unless 0 (as vLLM)."""
    assert schema(**fields, prompt_logprobs=3).prompt_logprobs == 3
    assert schema(**fields, prompt_logprobs=0, stream=True).prompt_logprobs == 0
    assert schema(**fields, prompt_logprobs=None).prompt_logprobs is None
    for value, message in ((-1, "not served"), (21, "in \\[0, 20\\]"), (-2, "in \\[0, 20\\]")):
        with pytest.raises(ValidationError, match=f"prompt_logprobs[\\s\\S]*{message}"):
            schema(**fields, prompt_logprobs=value)
    with pytest.raises(ValidationError, match="not available when `stream=True`"):
        schema(**fields, prompt_logprobs=1, stream=True)


def test_a_completions_echo_is_served():
    assert CompletionRequest(prompt="x", echo=True).echo

"""Edges of the router's vLLM routes and of a pool's limits and health, each at its exact
bound: the X-Request-Id header at the request_id bound, /tokenize's BOS, /detokenize's naming
of the ids it refuses, /tokenizer_info's lists and template, the served names' order and
tokenizer, a pool call's id, K, top n and q, and a dead engine's count of failures."""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from deployments import health, served_models
from deployments.health import FAILED_BATCHES
from deployments.ingress import BadRequest
from deployments.limits import (MAX_REQUEST_ID_CHARS, Limits, check_dists,
                                check_prompt_logprobs, check_request, in_messages)
from deployments.openai_api import CompletionRequest
from deployments.request_bounds import MAX_REQUEST_ID
from deployments.request_headers import header_request_id
from deployments.served_models import check_model, model_list, not_served, served_names
from deployments.tokenize_api import (TokenizeRequest, check_in_vocabulary, plain, tokenized,
                                      tokenizer_info)
from protos import specserve_pb2 as pb
from speculative.sampling import MAX_LOGPROBS
from tests.unit.test_chat_prompts import qwen_like_reader, reader_of, with_bos

LIMITS = Limits(vocab_size=16, context=64, max_speculative_tokens=3)


def with_header(request_id: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "query_string": b"", "headers": [(b"x-request-id", request_id.encode())]})


def test_a_header_of_the_request_id_bound_names_the_answer():
    sent = "a" * MAX_REQUEST_ID
    body = header_request_id(with_header(sent), CompletionRequest(prompt="x"))
    assert body.request_id == sent


@pytest.mark.parametrize("bad, named", [
    ([16, 17, 18], r"tokens\[0\] = 16, tokens\[1\] = 17, tokens\[2\] = 18$"),
    ([-1, 16, 17, 18], r"tokens\[2\] = 17 and 1 more$")])
def test_detokenize_names_three_ids_outside_the_vocabulary_and_counts_the_rest(bad, named):
    with pytest.raises(BadRequest, match=named) as refused:
        check_in_vocabulary(bad, 16)
    assert refused.value.param == "tokens"
    check_in_vocabulary([0, 15], 16)


def test_tokenizer_info_writes_a_tuple_of_special_tokens_as_a_json_list():
    token = type("Added", (), {"content": "<s>"})()
    assert plain({"pair": (token, 1)}) == {"pair": ["<s>", 1]}
    assert json.loads(json.dumps(plain((token, (2, 3))))) == ["<s>", [2, 3]]


def test_served_names_keep_their_order_the_first_answered_and_listed_first():
    names = served_names(["zeta", "alpha"])
    assert names == ("zeta", "alpha")
    assert [card["id"] for card in model_list(names, "t", 8)["data"]] == ["zeta", "alpha"]
    assert "serves 'zeta', 'alpha'" in str(not_served("x", names))
    check_model("", names)
    with pytest.raises(BadRequest) as refused:
        check_model("alph", names)
    assert (refused.value.status, refused.value.param) == (404, "model")


def test_a_pool_call_takes_an_id_of_its_bound_and_refuses_a_longer_one():
    sync = pb.PrefixSync(new_token_ids=[1])
    check_request("r" * MAX_REQUEST_ID_CHARS, sync, (), 0, LIMITS)
    for request_id in ("", "r" * (MAX_REQUEST_ID_CHARS + 1)):
        with pytest.raises(ValueError, match="request_id"):
            check_request(request_id, sync, (), 0, LIMITS)


def test_a_pool_call_with_a_negative_k_is_refused():
    with pytest.raises(ValueError, match="speculative tokens"):
        check_request("r", pb.PrefixSync(new_token_ids=[1]), (), -1, LIMITS)


def test_prompt_logprobs_take_the_largest_top_n_and_refuse_one_more():
    call = pb.PromptLogprobsRequest(request_id="r", token_ids=[1, 2], top_n=MAX_LOGPROBS)
    check_prompt_logprobs(call, LIMITS)
    call.top_n = MAX_LOGPROBS + 1
    with pytest.raises(ValueError, match="top n"):
        check_prompt_logprobs(call, LIMITS)


def test_a_sparse_q_wider_than_the_vocabulary_is_refused():
    def sparse(width: int) -> pb.Distributions:
        shape = [2, width]
        return pb.Distributions(vocab_size=16, ids=pb.Tensor(shape=shape, dtype="int64"),
                                probs=pb.Tensor(shape=shape, dtype="float32"))

    check_dists(sparse(16), 2, 16)
    with pytest.raises(ValueError, match="draft_probs must be"):
        check_dists(sparse(17), 2, 16)


def test_calls_whose_sizes_add_up_to_the_budget_share_a_message():
    items = [pb.ReleaseRequest(request_id="x" * n) for n in (8, 8, 8)]
    assert [item.ByteSize() for item in items] == [10, 10, 10]
    assert in_messages(items, budget=20) == [items[:2], items[2:]]


def failing_batches(monkeypatch, times: list[float], answered_at: float | None = None):
    """A BatchHealth (stall 1 s) whose engine failed a batch at each of `times`, and
    answered one at answered_at."""
    now = [0.0]
    monkeypatch.setattr(health, "time", SimpleNamespace(monotonic=lambda: now[0]))
    batches = health.BatchHealth(1.0, (ValueError,))
    for at in sorted([*times, *([] if answered_at is None else [answered_at])]):
        now[0] = at
        if at == answered_at:
            with batches.batch([]):
                continue
        with pytest.raises(RuntimeError), batches.batch([]):
            raise RuntimeError("CUDA error")
    return batches


def test_the_engine_is_dead_after_exactly_failed_batches_over_the_stall(monkeypatch):
    spanning = [n / (FAILED_BATCHES - 1) for n in range(FAILED_BATCHES)]  # 0 s to 1 s
    with pytest.raises(RuntimeError, match=f"failed the last {FAILED_BATCHES} batches"):
        failing_batches(monkeypatch, spanning).check(0)
    failing_batches(monkeypatch, spanning[:-1] + [0.99]).check(0)  # short of the stall
    failing_batches(monkeypatch, [0.0] * (FAILED_BATCHES - 2) + [1.0]).check(0)  # one short


def test_a_prompt_is_tokenized_with_the_tokenizers_bos_unless_asked_without():
    """As a completions request's default (add_special_tokens true): the count a client
    reads is the prompt its completion is fed, BOS included."""
    tokenizer, bos = with_bos(qwen_like_reader())
    reader = reader_of(tokenizer)
    fed = reader.token_ids(CompletionRequest(prompt="hello world"), chat=False)
    with ThreadPoolExecutor(1) as reader.tokenizing:
        reader.max_prompt_bytes = 1 << 16
        for body, expected in [({}, list(fed)), ({"add_special_tokens": False}, list(fed[1:]))]:
            body = TokenizeRequest.model_validate({"prompt": "hello world", **body})
            assert asyncio.run(tokenized(reader, body))["tokens"] == expected
    assert fed[0] == bos


def test_tokenizer_info_gives_the_template_chats_are_rendered_with_not_the_loaded_one():
    """A template set on the tokenizer after loading (a chat_template.jinja beside the
    config, or the router's own) is the one chat requests use, and the one answered."""
    for loaded in ({"chat_template": "{{ old }}"}, {}):
        tokenizer = SimpleNamespace(init_kwargs=loaded, chat_template="{{ new }}")
        assert tokenizer_info(tokenizer)["chat_template"] == "{{ new }}"


def test_a_tokenizer_of_the_targets_size_that_maps_text_to_other_ids_is_refused(monkeypatch):
    """The same number of tokens is no proof: the pools see ids alone, so swapped ids would
    serve other tokens than the prompts' silently."""
    vocabularies = {"target": {"a": 0, "b": 1}, "swapped": {"a": 1, "b": 0},
                    "copy": {"b": 1, "a": 0}}
    monkeypatch.setattr(served_models, "load_tokenizer", lambda name: SimpleNamespace(
        name=name, get_vocab=lambda: vocabularies[name]))
    with pytest.raises(ValueError, match="tokenizer 'swapped' maps text to other ids"):
        served_models.served_tokenizer("target", "swapped")
    assert served_models.served_tokenizer("target", "copy").name == "copy"


def test_a_failure_streak_after_an_answered_batch_is_timed_from_its_own_first(monkeypatch):
    """FAILED_BATCHES failures in a row over 0.2 s after one answered batch: the streak of
    0.2 s, not one from the failure before the answer, is short of the stall."""
    streak = [5.0 + n / 10 for n in range(FAILED_BATCHES)]
    failing_batches(monkeypatch, [0.5, *streak], answered_at=1.0).check(0)


def test_an_idle_replica_is_healthy_and_calls_that_wait_past_the_stall_are_not(monkeypatch):
    batches = failing_batches(monkeypatch, [])  # its clock at 0: no batch since
    health.time.monotonic = lambda: 100.0
    batches.check(0)
    with pytest.raises(RuntimeError, match="1 calls wait"):
        batches.check(1)


@pytest.mark.parametrize("chat", [False, True])
def test_tokenize_takes_a_prompt_of_the_byte_bound_and_refuses_one_byte_more(chat):
    """/tokenize checks a prompt's bytes as its request would (a body past the bound was
    tokenized, however large, before any answer)."""
    reader = qwen_like_reader()
    reader.max_prompt_bytes, reader.tokenizing = 64, ThreadPoolExecutor(1)

    def body(size: int) -> dict:
        text = "é" + "a" * (size - 2)  # a character of two bytes counts as two
        return {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}

    assert asyncio.run(tokenized(reader, TokenizeRequest.model_validate(body(64))))["count"]
    with pytest.raises(BadRequest, match="the prompt has 65 bytes; the limit is 64") as no:
        asyncio.run(tokenized(reader, TokenizeRequest.model_validate(body(65))))
    assert no.value.param == ("messages" if chat else "prompt")


def test_tokenizer_info_leaves_out_every_files_path_not_only_vllms_two():
    kwargs = {"vocab_file": "/m/vocab.json", "tokenizer_file": "/m/tokenizer.json",
              "added_tokens_file": "/m/added.json", "model_max_length": 8}
    info = tokenizer_info(SimpleNamespace(init_kwargs=kwargs, chat_template=None))
    assert info == {"model_max_length": 8, "tokenizer_class": "SimpleNamespace"}

"""vLLM's logprob_token_ids: at each output position, the target's raw logprobs of the given
ids instead of the top n (the output token's own first, as vLLM's), exact under speculation
as the top n are, in both endpoints' shapes, whole and streamed; bad ids refused."""

import asyncio
import json

import pytest
import torch

from deployments import wire
from deployments.ingress import BadRequest, parse
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from drafter.model import ModelDrafter
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.sampling import MAX_LOGPROB_TOKEN_IDS, SamplingParams
from speculative.types import PrefixSync, ScoreCall
from tests.tiny import noisy_copy, run, tiny_llama
from tests.unit.test_request_fields import request_with
from verifier.engine import ModelVerifier

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [3, 9, 3]]
IDS = (2, 40, 17, 63)  # in the order asked: not the likeliest first
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(7)


@torch.no_grad()
def reference(model, prompt: list[int], output: list[int]) -> list[list[tuple[int, float]]]:
    """Each output position's (id, logprob) pairs as vLLM's dict holds them: the output
    token's own first, then the given ids' (log_softmax of the target's logits there)."""
    logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    logprobs = torch.log_softmax(logits.float(), -1)
    return [[(token, float(logprobs[i, token]))]
            + [(t, float(logprobs[i, t])) for t in IDS if t != token]
            for i, token in enumerate(output)]


def params(temperature: float = 0) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=20, seed=3, logprobs=0,
                          logprob_token_ids=IDS)


SHAPES = {"K0": (0, {}), "K3": (3, {}), "K2-pipelined": (2, {"pipelined": True}),
          "tree": (4, {"tree_width": 3, "tree_nodes": 8})}


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_given_ids_logprobs_are_the_targets_own_under_any_k(target, mode, shape):
    """Accepted drafted tokens (a tree's along its path too), recovered and bonus ones
    alike: each position's given ids' logprobs are log_softmax of the target's logits
    there; greedy, the same tokens and logprobs as K = 0's."""
    k, options = SHAPES[shape]
    drafter, verifier = ModelDrafter(noisy_copy(target, 0.01, seed=1)), ModelVerifier(target)
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        out, state = run(drafter, verifier, prompt, params(mode == "sampled"), k,
                         request_id=f"r{i}", **options)
        expected = reference(target, prompt, out)
        assert [entry.token_id for entry in state.logprobs] == out
        for entry, pairs in zip(state.logprobs, expected):
            assert entry.logprob == pytest.approx(pairs[0][1], abs=1e-4)
            assert [t for t, _ in entry.top] == [t for t, _ in pairs]
            assert [lp for _, lp in entry.top] == pytest.approx([lp for _, lp in pairs],
                                                               abs=1e-4)
        accepted += state.stats.num_accepted_tokens
        if mode == "greedy" and k:
            alone, alone_state = run(drafter, verifier, prompt, params(), 0, request_id=f"a{i}")
            assert alone == out
            assert [lp for e in alone_state.logprobs for _, lp in e.top] == pytest.approx(
                [lp for e in state.logprobs for _, lp in e.top], abs=1e-3)
    assert accepted > 0 or k == 0  # drafted tokens were committed, and their ids' checked


def choices_of(target, chat: bool):
    """A request through the router's fan-out (deployments.choices): one sampled choice
    with the given ids' logprobs, each token's text its id in angle brackets."""
    from deployments.admission import Admission
    from deployments.choices import Choices
    from speculative.frontend import RequestFrontEnd

    plan = RequestFrontEnd().plan("r", tuple(PROMPTS[1]), params(1.0), n=1,
                                  num_speculative_tokens=3)
    pools = (ModelDrafter(noisy_copy(target, 0.01, seed=1)), ModelVerifier(target))
    decode = lambda ids: "".join(f"<{t}>" for t in ids)  # noqa: E731
    return Choices(plan, pools, decode, type("M", (), {"record_choice": lambda s, *c: None})(),
                   Admission(4).admit(1), model="m", chat=chat, return_token_ids=False)


@pytest.mark.parametrize("chat", [True, False])
def test_both_shapes_carry_the_token_then_the_given_ids_whole_and_streamed(target, chat):
    """vLLM's rendering: a chat entry's top_logprobs the token, then each given id (the
    token's own not twice); a completion's top_logprobs {text: logprob} of the same; the
    stream's chunks together the whole choice's."""
    whole = asyncio.run(choices_of(target, chat).complete())["choices"][0]
    output = [int(t) for t in (whole["message"]["content"] if chat else whole["text"])
              .strip("<>").split("><")]
    expected = reference(target, PROMPTS[1], output)
    logprobs = whole["logprobs"]
    if chat:
        tops = [[(item["token"], item["logprob"]) for item in entry["top_logprobs"]]
                for entry in logprobs["content"]]
        assert [entry["token"] for entry in logprobs["content"]] == [f"<{t}>" for t in output]
    else:
        tops = [list(top.items()) for top in logprobs["top_logprobs"]]
    for top, pairs in zip(tops, expected, strict=True):
        assert [token for token, _ in top] == [f"<{t}>" for t, _ in pairs]
        assert [lp for _, lp in top] == pytest.approx([lp for _, lp in pairs], abs=1e-4)

    async def collect():
        return [e async for e in choices_of(target, chat).events()]

    chunks = [json.loads(e[len("data: "):])["choices"][0] for e in asyncio.run(collect())[:-1]]
    carried = [c["logprobs"] for c in chunks if c.get("logprobs")]
    assert len(carried) > 1
    for field in ("content",) if chat else ("tokens", "token_logprobs", "top_logprobs"):
        assert [e for c in carried for e in c[field]] == logprobs[field]


def test_the_request_asks_them_once_each_with_logprobs_zero_and_the_wire_carries_them():
    """vLLM's: the ids take the place of the top n a chat's top_logprobs or a completion's
    logprobs asks (a repeated id shows once, as vLLM's dict holds it)."""
    chat = ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=5,
                                 logprob_token_ids=[9, 4, 9]).sampling(16)
    completion = CompletionRequest(prompt="x", logprobs=3, logprob_token_ids=[9, 4]).sampling(16)
    assert chat == completion == SamplingParams(max_tokens=16, logprobs=0,
                                                logprob_token_ids=(9, 4))
    asked = SamplingParams(logprobs=0, logprob_token_ids=(9, 4))  # max_tokens: the router's
    assert wire.sampling_from_proto(wire.sampling_to_proto(asked)) == asked
    for bad in ({"logprobs": 2}, {"logprobs": None}, {"logprob_token_ids": (-1,)},
                {"logprob_token_ids": (1,) * (MAX_LOGPROB_TOKEN_IDS + 1)}):
        with pytest.raises(ValueError, match="logprob_token_ids"):
            SamplingParams(**{"logprobs": 0, "logprob_token_ids": (1,), **bad})


BAD = [{"logprob_token_ids": [5]},  # without logprobs
       {"logprobs": 1, "logprob_token_ids": []},
       {"logprobs": 1, "logprob_token_ids": [-1]},
       {"logprobs": 1, "logprob_token_ids": list(range(MAX_LOGPROB_TOKEN_IDS + 1))}]


@pytest.mark.parametrize("chat, fields", [
    *((chat, fields) for chat in (True, False) for fields in BAD),
    # no output token to score (a chat's max_tokens 0 is refused on its own)
    (False, {"logprobs": 1, "logprob_token_ids": [5], "echo": True, "max_tokens": 0})])
def test_bad_ids_are_a_400_naming_the_field(chat, fields):
    fields = {**fields, "logprobs": True} if chat and "logprobs" in fields else fields
    body = {"messages": CHAT} if chat else {"prompt": "x"}
    raw = json.dumps({**body, **fields}).encode()
    with pytest.raises(BadRequest) as refused:
        asyncio.run(parse(request_with(raw), ChatCompletionRequest if chat
                          else CompletionRequest, 1 << 20))
    assert refused.value.status == 400
    assert (refused.value.param or "").startswith("logprob_token_ids")
    assert "not supported" not in str(refused.value)


def test_max_completion_tokens_read_first_decodes_beside_a_max_tokens_of_0():
    """max_completion_tokens is read before max_tokens (vLLM's order): beside a max_tokens of
    0 it still asks for an output, so that neither a chat, nor logprob_token_ids, nor a beam
    search is refused as if it asked for none (each compared max_tokens alone)."""
    from deployments.beams import refuse_unsearched

    chat = ChatCompletionRequest(messages=CHAT, max_tokens=0, max_completion_tokens=5)
    assert chat.sampling(16).max_tokens == 5
    scored = CompletionRequest(prompt="x", echo=True, max_tokens=0, max_completion_tokens=3,
                               logprobs=1, logprob_token_ids=[3])
    assert scored.sampling(16).logprob_token_ids == (3,)
    refuse_unsearched(CompletionRequest(prompt="x", max_tokens=0, max_completion_tokens=3,
                                        echo=True, use_beam_search=True, n=2), chat=False)


@pytest.mark.parametrize("chat", [True, False])
def test_ids_past_the_vocabulary_are_a_400_naming_the_field(chat):
    from deployments.prompts import PromptReader

    reader = PromptReader.__new__(PromptReader)  # its checks of sizes alone
    reader.vocab_size, reader.max_prompt_bytes = 16, 1 << 20
    body = ChatCompletionRequest(messages=CHAT, logprobs=True, logprob_token_ids=[3, 16]) \
        if chat else CompletionRequest(prompt="x", logprobs=0, logprob_token_ids=[3, 16])
    with pytest.raises(BadRequest) as refused:
        reader.check_sizes(body, chat)
    assert refused.value.param == "logprob_token_ids" and "[0, 16)" in str(refused.value)
    reader.check_sizes(body.model_copy(update={"logprob_token_ids": [3, 15]}), chat)


def test_ids_past_the_vocabulary_refuse_their_call_not_its_batch():
    """A pool's own check (a router's call is checked before it): a gather past the
    vocabulary would fail every call of the batch."""
    verifier = ModelVerifier(tiny_llama(3, vocab_size=16))
    sync = PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3))
    good, bad = (ScoreCall(name, sync, (), SamplingParams(temperature=0, logprobs=0,
                                                          logprob_token_ids=ids))
                 for name, ids in (("good", (15, 0)), ("bad", (3, 16))))
    scores, refusal = verifier.score_batch([good, bad])
    assert [t for t, _ in scores.logprobs.top[0]] == [15, 0]
    assert isinstance(refusal, ValueError) and "logprob_token_ids" in str(refusal)

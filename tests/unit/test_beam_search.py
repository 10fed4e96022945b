"""vLLM's beam search (use_beam_search) through the router's choices (deployments.beams) over
a tiny target's verifier, against the same search written out over the model's own full
forwards; and what a beam search request may combine."""

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from deployments.admission import Admission
from deployments.beams import choices_kind, refuse_unsearched
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from deployments.tools import FieldError
from speculative.beams import BeamParams, BeamSearch, beam_score
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from tests.tiny import tiny_llama
from verifier.engine import ModelVerifier

PROMPT = [5, 17, 42, 8, 30]
# end tokens among this target's likeliest: 6 at the first position (a beam ends there),
# 52 on the best beams' path (ignored, it stays in them)
EOS, ON_PATH = 6, 52
MAX_TOKENS, TOP_N = 6, 2
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(11)


def decode(ids):
    return "".join(chr(97 + t % 26) for t in ids)


def reference(model, prompt, width, ignore_eos, length_penalty, include_stop, eos=EOS):
    """The beam search written out: every live beam's full forward, its top 2 x width raw
    logprobs, EOS candidates retired, the width best others kept; the width best of all by
    cumulative logprob / length ** length_penalty. (tokens, cum logprob, finish, rows)."""
    beams, finished = [((), 0.0, [])], []
    for _ in range(MAX_TOKENS):
        candidates = []
        for parent, (tokens, cum, rows) in enumerate(beams):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(tokens)])).logits[0, -1]
            values, ids = torch.log_softmax(logits.float(), -1).topk(2 * width)
            row = list(zip(ids.tolist(), values.tolist()))
            for token, logprob in row:
                if token == eos and not ignore_eos:
                    kept = (eos,) if include_stop else ()
                    finished.append((tokens + kept, cum + logprob, "stop", rows + [row]))
                else:
                    candidates.append((cum + logprob, parent, token, row))
        candidates.sort(key=lambda c: -c[0])
        beams = [(beams[p][0] + (t,), total, beams[p][2] + [row])
                 for total, p, t, row in candidates[:width]]
    everything = finished + [(t, c, "length", rows) for t, c, rows in beams]

    def score(entry):
        sequence = prompt + list(entry[0])
        return entry[1] / (len(sequence) - (sequence[-1] == eos)) ** length_penalty

    return sorted(everything, key=score, reverse=True)[:width]


def beam_choices(target, body, chat: bool, eos: int = EOS):
    """The body's choices as the router builds them (choices_kind) over the target's
    verifier, with the prompt PROMPT."""
    refuse_unsearched(body, chat)
    sampling = body.sampling(MAX_TOKENS)
    plan = RequestFrontEnd().plan("cmpl-b", PROMPT, sampling, n=body.n)
    metrics = type("M", (), {"record_choice": lambda s, *choice: None})()
    prompts = SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=eos))
    return choices_kind(body, prompts)(plan, (None, ModelVerifier(target)), decode, metrics,
                                   Admission(16).admit(body.n), model="m", chat=chat,
                                   return_token_ids=True)


def fields(width, ignore_eos, length_penalty, include_stop, stream=False):
    return {"use_beam_search": True, "n": width, "max_tokens": MAX_TOKENS, "stream": stream,
            "ignore_eos": ignore_eos, "length_penalty": length_penalty,
            "include_stop_str_in_output": include_stop, "temperature": 0.7}


# (beam width, the end token, ignore_eos, length_penalty, include_stop_str_in_output)
CASES = [(3, EOS, False, 1.0, False), (3, EOS, False, 0.5, True), (2, ON_PATH, True, 2.0, False),
         (4, EOS, False, 1.5, False), (3, ON_PATH, False, 1.0, True)]


@pytest.mark.parametrize("width, eos, ignore_eos, length_penalty, include_stop", CASES)
@pytest.mark.parametrize("chat", [False, True])
def test_a_beam_search_answers_the_reference_searchs_best_beams(
        target, chat, width, eos, ignore_eos, length_penalty, include_stop):
    """Each choice is the reference's beam of its rank: its token ids, its text (an EOS
    beam's without the EOS), finish_reason and stop_reason (vLLM's: the EOS id), each
    token's logprob; usage counts the returned ids; no beam's verifier session is left."""
    case = fields(width, ignore_eos, length_penalty, include_stop)
    body = ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=TOP_N, **case) \
        if chat else CompletionRequest(prompt="x", logprobs=TOP_N, **case)
    choices = beam_choices(target, body, chat, eos)
    answer = asyncio.run(choices.complete())
    assert len(choices.pools[1].sessions) == 0  # every beam's session released
    expected = reference(target, PROMPT, width, ignore_eos, length_penalty, include_stop, eos)
    assert len(answer["choices"]) == width
    if ignore_eos:  # the cases exercised: the end token inside a beam, or ending one
        assert any(eos in tokens for tokens, *_ in expected)
    elif width == 3:
        assert any(finish == "stop" for _, _, finish, _ in expected)
    for choice, (tokens, cum, finish, rows) in zip(answer["choices"], expected):
        assert choice["token_ids"] == list(tokens)
        assert choice["finish_reason"] == finish
        assert choice["stop_reason"] == (eos if finish == "stop" else None)
        shown = tokens[:-1] if finish == "stop" and include_stop else tokens
        text = choice["message"]["content"] if chat else choice["text"]
        assert text == decode(shown)
        logprobs = [e["logprob"] for e in choice["logprobs"]["content"]] if chat else \
            choice["logprobs"]["token_logprobs"]
        expected_logprobs = [dict(row)[t] for t, row in zip(tokens, rows)]
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
        assert sum(logprobs) == pytest.approx(cum - (0 if len(rows) == len(tokens) else
                                                     dict(rows[-1])[eos]), abs=1e-4)
    assert answer["usage"]["completion_tokens"] == sum(len(t) for t, *_ in expected)


@pytest.mark.parametrize("width, eos, ignore_eos, length_penalty, include_stop", CASES[1:3])
def test_a_streamed_chat_beam_search_sends_each_choice_whole_once_searched(
        target, width, eos, ignore_eos, length_penalty, include_stop):
    """As vLLM streams a chat's beam search: each choice's role, then its whole content with
    its finish_reason; the same choices as the whole answer's."""
    case = fields(width, ignore_eos, length_penalty, include_stop, stream=True)
    body = ChatCompletionRequest(messages=CHAT, **case)

    async def collect():
        return [e async for e in beam_choices(target, body, True, eos).events()]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: "):])["choices"][0] for e in events[:-1]]
    expected = reference(target, PROMPT, width, ignore_eos, length_penalty, include_stop, eos)
    for index, (tokens, _, finish, _) in enumerate(expected):
        own = [c for c in chunks if c["index"] == index]
        assert own[0]["delta"]["role"] == "assistant"
        assert [c["finish_reason"] for c in own] == [None] * (len(own) - 1) + [finish]
        shown = tokens[:-1] if finish == "stop" and include_stop else tokens
        assert "".join(c["delta"].get("content") or "" for c in own) == decode(shown)
        assert own[-1]["token_ids"] == list(tokens)


@pytest.mark.parametrize("chat", [False, True])
def test_top_logprobs_beyond_twice_the_width_are_answered_whole_the_search_unchanged(
        target, chat):
    """A width-1 search reads 2 logprobs a step: asked for 5, each position answered 2 (no
    refusal, as vLLM's). It answers the position's top 5, and the same beams as with 2."""
    wide, case = 5, fields(1, False, 1.0, False)
    body = ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=wide, **case) \
        if chat else CompletionRequest(prompt="x", logprobs=wide, **case)
    choice = asyncio.run(beam_choices(target, body, chat).complete())["choices"][0]
    tokens, _, finish, _ = reference(target, PROMPT, 1, False, 1.0, False)[0]
    assert (choice["token_ids"], choice["finish_reason"]) == (list(tokens), finish)
    tops = [e["top_logprobs"] for e in choice["logprobs"]["content"]] if chat else \
        choice["logprobs"]["top_logprobs"]
    for position, top in enumerate(tops):
        with torch.no_grad():
            logits = target(torch.tensor([PROMPT + list(tokens[:position])])).logits[0, -1]
        values = torch.log_softmax(logits.float(), -1).topk(wide).values.tolist()
        shown = [e["logprob"] for e in top] if chat else sorted(top.values(), reverse=True)
        assert shown == pytest.approx(values, abs=1e-4)


def test_the_score_is_vllms_over_the_whole_sequence_without_a_last_eos():
    assert beam_score([1, 2, 3, 6], -2.0, 6, 1.0) == pytest.approx(-2.0 / 3)
    assert beam_score([1, 2, 3, 4], -2.0, 6, 2.0) == pytest.approx(-2.0 / 16)
    assert BeamParams(2, 4, None).length_penalty == 1.0


def test_a_length_penalty_past_a_floats_range_ranks_by_the_scores_limit_not_a_500():
    """length ** length_penalty past a float (OverflowError) or below its least (a division
    by zero) failed the request after its whole search; the quotient's limits rank instead.
    NaN (Python's json reads it) or an infinity ranks nothing: a 400 naming the field."""
    long = list(range(100))
    assert beam_score(long, -2.0, None, 400.0) == 0.0  # -2 / inf
    assert beam_score(long, -2.0, None, -400.0) == float("-inf")
    assert beam_score(long, 0.0, None, -400.0) == 0.0
    assert beam_score([1], -2.0, None, 400.0) == -2.0  # 1 ** anything
    for bad in ("NaN", "Infinity"):
        with pytest.raises(ValueError, match="length_penalty"):
            CompletionRequest.model_validate_json(
                f'{{"prompt": "x", "use_beam_search": true, "length_penalty": {bad}}}')


@pytest.mark.parametrize("length_penalty", [400.0, -400.0])
def test_a_beam_search_with_an_extreme_length_penalty_answers(target, length_penalty):
    body = CompletionRequest(prompt="x", **fields(2, False, length_penalty, False))
    answer = asyncio.run(beam_choices(target, body, False).complete())
    assert len(answer["choices"]) == 2


class Held:
    """A verifier whose calls never answer, noting the sessions called and released."""

    def __init__(self) -> None:
        self.called, self.released = set(), set()

    async def score(self, call):
        self.called.add(call.request_id)
        await asyncio.Event().wait()

    async def release(self, request_id):
        self.released.add(request_id)


@pytest.mark.parametrize("turns", range(8))
def test_a_search_cancelled_again_as_it_releases_leaves_no_session(turns):
    """A client gone mid-search cancels it; a second cancel (a stream's end repeated) that
    came while its sessions' releases were tasks not yet started dropped them."""
    plan = RequestFrontEnd().plan("cmpl-b", PROMPT, SamplingParams(temperature=0.0,
                                                                   max_tokens=4), n=2)
    verifier = Held()

    async def main():
        search = asyncio.ensure_future(
            BeamSearch(plan.choices[0].request, BeamParams(2, 4, EOS)).run(verifier))
        for _ in range(3):
            await asyncio.sleep(0)
        search.cancel()
        for _ in range(turns):
            await asyncio.sleep(0)
        search.cancel()
        with pytest.raises(asyncio.CancelledError):
            await search
        for _ in range(5):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert verifier.called and verifier.called <= verifier.released


@pytest.mark.parametrize("extra, chat, param", [
    ({"stream": True}, False, "stream"), ({"n": 11}, False, "n"),
    ({"top_p": 0.9}, False, "top_p"), ({"stop": ["x"]}, True, "stop"),
    ({"presence_penalty": 0.5}, True, "presence_penalty"),
    ({"logit_bias": {"3": 1.0}}, False, "logit_bias"), ({"min_tokens": 2}, True, "min_tokens"),
    ({"response_format": {"type": "json_object"}}, True, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, True,
     "tools"),
    # the search's rows are the top 2 x width, not these ids' (it was answered without them)
    ({"logprobs": True, "logprob_token_ids": [3, 4]}, True, "logprob_token_ids"),
])
def test_what_a_beam_search_cannot_apply_is_refused_by_name(extra, chat, param):
    given = {"use_beam_search": True, "n": 2, **extra}
    body = ChatCompletionRequest(messages=CHAT, **given) if chat else \
        CompletionRequest(prompt="x", **given)
    with pytest.raises(FieldError) as refused:
        refuse_unsearched(body, chat)
    assert refused.value.param == param


def test_what_a_beam_search_ignores_as_vllms_passes():
    """temperature (the search reads raw logprobs), seed, a chat stream, top_p at its
    default: no refusal."""
    body = ChatCompletionRequest(messages=CHAT, use_beam_search=True, n=3, temperature=1.3,
                                 seed=4, top_p=1, stream=True, length_penalty=0.7)
    refuse_unsearched(body, True)
    assert body.length_penalty == 0.7

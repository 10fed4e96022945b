"""vLLM's allowed_token_ids and bad_words: masks of the logits, exact under speculation.

`shape_logits` follows the definitions row by row (every row keeps the allowed ids alone; a
bad word's last token is masked where the output so far, drafted tokens included, ends with
its other tokens), a request's committed tokens reach the mask whether its penalties count
them or not, greedy output under both equals a plain reference loop and the target alone,
the request fields are read and refused as vLLM's are, and the wire carries them.
"""

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from deployments import wire
from deployments.ingress import BadRequest
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.sampling import MAX_BAD_WORDS, SamplingParams
from speculative.shaping import (
    SeenTokens,
    Shaping,
    committed_history,
    shape_batch,
    shape_logits,
    unmasked_prefix,
)
from speculative.types import PrefixSync, ProposeCall
from tests.tiny import noisy_copy, run, tiny_llama
from verifier.engine import ModelVerifier

INF = float("-inf")


def test_every_row_keeps_the_allowed_ids_alone():
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    rows = shape_logits(logits, SamplingParams(allowed_token_ids=(5, 2, 5)), [1], [3], [4, 6])
    expected = torch.full((3, 8), INF)
    expected[:, [2, 5]] = logits[:, [2, 5]]
    assert torch.equal(rows, expected)


def test_a_one_token_word_is_banned_in_every_row():
    logits = torch.zeros(4, 8)
    rows = shape_logits(logits, SamplingParams(bad_words_ids=((6,), (3,))), [1], [], [2, 2, 2])
    assert rows[:, [3, 6]].eq(INF).all() and rows.isfinite().sum() == 4 * 6


def test_a_longer_word_bans_its_last_token_only_after_its_other_tokens():
    """Word (2, 3, 5): row r reads the output and drafted[:r]; its last token is masked in
    the rows after 2, 3 (the second one's 2 is committed output, the fourth's drafted), no
    other token anywhere, and no row after a 3 alone or a 2, 3 the prompt holds."""
    logits = torch.zeros(6, 8)
    params = SamplingParams(bad_words_ids=((2, 3, 5),))
    rows = shape_logits(logits, params, [2, 3], [7, 2], [3, 5, 2, 3, 3])
    assert [r for r in range(6) if rows[r, 5] == INF] == [1, 4]
    assert rows.isfinite().sum() == 6 * 8 - 2
    assert shape_logits(logits[:2], params, [2, 3], [], [1]).isfinite().all()  # the prompt's


def test_a_word_longer_than_the_output_waits_for_it():
    logits = torch.zeros(3, 4)
    rows = shape_logits(logits, SamplingParams(bad_words_ids=((1, 1, 2),)), [1], [1], [1, 0])
    assert rows[:, 2].tolist() == [0.0, INF, 0.0]  # the outputs 1; 1, 1; 1, 1, 0


def test_a_row_the_masks_would_empty_is_left_as_it_was():
    """As min_tokens yields to a grammar that allows only an end: allowed ids the grammar
    rules out all leave the grammar's row; a word that bans the one id left is not banned
    (a row of -inf has no law)."""
    grammar_row = torch.tensor([[0.5, INF, INF, 1.0]])
    allowed = SamplingParams(allowed_token_ids=(1, 2))
    assert torch.equal(shape_logits(grammar_row, allowed, [0], []), grammar_row)
    both = SamplingParams(allowed_token_ids=(3,), bad_words_ids=((3,),))
    assert torch.equal(shape_logits(grammar_row, both, [0], []),
                       torch.tensor([[INF, INF, INF, 1.0]]))


def test_ids_past_a_smaller_draft_vocabulary_mask_nothing_there():
    logits = torch.zeros(2, 4)
    rows = shape_logits(logits, SamplingParams(allowed_token_ids=(2, 4), bad_words_ids=(
        (3, 5), (4,))), [1], [3], [3])
    assert rows[:, 2].eq(0).all() and rows[:, [0, 1, 3]].eq(INF).all()


def test_a_batch_shapes_each_request_as_alone():
    generator = torch.Generator().manual_seed(3)
    requests = [(SamplingParams(allowed_token_ids=(1, 4, 9), logit_bias=((4, 1.0),)),
                 [1], [4, 9], (1, 4)),
                (SamplingParams(bad_words_ids=((9, 4), (2,)), presence_penalty=0.5),
                 [3], [9], (4, 9, 9)),
                (SamplingParams(temperature=0), [1], [], (5,)),
                (SamplingParams(bad_words_ids=((4, 4, 4),), min_tokens=3,
                                min_tokens_end_ids=(0,)), [2], [4], (4, 4))]
    logits = [torch.randn(len(drafted) + 1, 12, generator=generator)
              for *_, drafted in requests]
    starts = [0, 3, 7, 9]
    batch = shape_batch(torch.cat(logits), [
        Shaping(start, len(rows), params, prompt, output, drafted)
        for start, rows, (params, prompt, output, drafted) in zip(starts, logits, requests)])
    for start, rows, (params, prompt, output, drafted) in zip(starts, logits, requests):
        alone = shape_logits(rows, params, prompt, output, drafted)
        assert torch.equal(batch[start:start + len(rows)], alone)


def test_a_penalised_requests_committed_tokens_reach_the_bad_words():
    """A penalised request's committed output reaches shaping counted (seen), not as a
    list: its last tokens come as `recent`, so a word begun in the committed output is
    still banned after it (without them, the second row's 5 went through)."""
    params = SamplingParams(bad_words_ids=((7, 8, 5),), frequency_penalty=0.5)
    committed = [1, 2, 3, 9, 7]  # prompt 1, 2, 3; output 9, 7
    seen = SeenTokens(3, with_prompt=False)
    sequence = SimpleNamespace(committed=committed,
                               counted=lambda prompt_len, with_prompt: seen.of(committed))
    history = committed_history(params, 3, sequence)
    assert history["recent"] == [9, 7] and history["output"] == []
    logits = torch.zeros(3, 10)
    counted = shape_batch(logits, [Shaping(0, 3, params, drafted=[8, 5], **history)])
    listed = shape_logits(logits, params, committed[:3], committed[3:], [8, 5])
    assert torch.equal(counted, listed) and counted[1, 5] == INF
    assert committed_history(params, 5, sequence)["recent"] == []  # no output yet


@torch.no_grad()
def reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """The target alone, the whole sequence forwarded at every step, masked and penalised
    by hand."""
    output: list[int] = []
    for _ in range(params.max_tokens):
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, -1]
        if params.allowed_token_ids:
            allowed = torch.zeros_like(logits, dtype=torch.bool)
            allowed[list(params.allowed_token_ids)] = True
            logits = logits.masked_fill(~allowed, INF)
        for word in params.bad_words_ids:
            before = len(word) - 1
            if len(output) >= before and tuple(output[len(output) - before:]) == word[:-1]:
                logits[word[-1]] = INF
        logits[sorted(set(output))] -= params.presence_penalty
        output.append(int(logits.argmax()))
    return output


@pytest.fixture(scope="module")
def target():
    return tiny_llama(7)


@pytest.mark.parametrize("kind, k, pipelined", [("noisy", 3, False), ("noisy", "auto", True),
                                                ("ngram", 3, True)])
def test_masked_greedy_equals_the_target_alone(target, kind, k, pipelined):
    """Each prompt's plain greedy output supplies the allowed ids (its tokens and a dozen
    others) and a word to ban (its most common token); the output under those, a pair of
    tokens to ban: the verifier must ban the pair's second token after a drafted first
    one. The second prompt's presence penalty has the pools count its output (`seen`)."""
    drafter = ModelDrafter(noisy_copy(target, 0.01, seed=1)) if kind == "noisy" \
        else NgramDrafter(64)
    verifier = ModelVerifier(target)
    accepted = drafted = 0
    for i, prompt in enumerate([[5, 6, 7, 5, 6, 7, 5, 6], [3, 9, 3], [11]]):
        plain = reference_greedy(target, prompt, SamplingParams(temperature=0, max_tokens=16))
        common = max(set(plain), key=plain.count)
        params = SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.3 * (i == 1),
                                allowed_token_ids=tuple(sorted({*plain, *range(20, 32)})),
                                bad_words_ids=((common,),))
        masked = reference_greedy(target, prompt, params)
        pair = (masked[1], masked[2])
        params = replace(params, bad_words_ids=((common,), pair))
        expected = reference_greedy(target, prompt, params)
        assert expected != masked != plain and common not in expected
        assert set(expected) <= set(params.allowed_token_ids)
        assert pair not in set(zip(expected, expected[1:]))
        alone, _ = run(drafter, verifier, prompt, params, 0, request_id=f"alone{i}")
        out, state = run(drafter, verifier, prompt, params, k, request_id=f"r{i}",
                         pipelined=pipelined)
        assert alone == out == expected, f"prompt {i}, K={k}, {kind} drafter"
        accepted += state.stats.num_accepted_tokens
        drafted += state.stats.num_draft_tokens
    assert drafted > 0 and (kind == "ngram" or 0 < accepted < drafted)


class Passes(tuple):
    """A tuple that counts the passes Python makes over it (its iterations)."""

    count = 0

    def __iter__(self):
        Passes.count += 1
        return super().__iter__()


@pytest.mark.parametrize("max_tokens", [12, 48])
def test_the_ids_are_read_in_python_once_per_request_not_at_every_call_and_step(
        target, max_tokens):
    """Each pool holds a session's params for all its calls: what shaping and the calls'
    checks read of allowed_token_ids and bad_words (4,096 ids and 128 words cost 0.3 ms a
    request each time, 40 ms a draft step at 128 streams) is made once per params, so the
    passes over them do not grow with the output (they did, with its rounds and steps)."""
    Passes.count = 0
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            allowed_token_ids=Passes(range(10, 60)),
                            bad_words_ids=Passes(((12,), (30, 31), (40, 41, 42))))
    out, state = run(ModelDrafter(noisy_copy(target, 0.01, seed=1)), ModelVerifier(target),
                     [5, 6, 7], params, 3, request_id=f"passes{max_tokens}")
    assert len(out) == max_tokens and state.stats.num_draft_tokens >= max_tokens
    assert Passes.count <= 10  # its checks and the few arrays made of it (457 at 48 tokens)


def test_the_request_fields_read_as_vllms():
    body = CompletionRequest(prompt="x", allowed_token_ids=[4, 2], bad_words=["a b"],
                             return_tokens_as_token_ids=True)
    assert body.sampling(16).allowed_token_ids == (4, 2) and body.return_tokens_as_token_ids
    assert CompletionRequest(prompt="x", allowed_token_ids=None, bad_words=None).sampling(
        16).allowed_token_ids == ()
    for bad in ({"allowed_token_ids": []}, {"allowed_token_ids": [-1]},
                {"allowed_token_ids": list(range(4097))}, {"bad_words": [""]},
                {"bad_words": ["x" * 257]}, {"bad_words": ["w"] * (MAX_BAD_WORDS + 1)},
                {"bad_words": ["\ud800"]}):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="x", **bad)
        with pytest.raises(ValidationError):
            ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **bad)


@pytest.fixture(scope="module")
def reader():
    from deployments.prompts import PromptReader
    from deployments.router_args import RouterArgs
    from engine.checkpoint import Checkpoint
    from engine.models import load_tokenizer

    model = "models/demo/target"
    return PromptReader(RouterArgs(model=model), load_tokenizer(model), Checkpoint.load(model))


def read(reader, **fields) -> SamplingParams:
    return asyncio.run(reader.read(CompletionRequest(prompt="def ", **fields), chat=False)
                       ).sampling


def test_bad_words_tokenize_as_vllms_with_and_without_a_leading_space(reader):
    """vLLM's update_from_tokenizer: each word's leading whitespace stripped, then again
    after a space, kept only as another word of as many tokens (the demo tokenizer's
    "hello" is 2 tokens, " hello" 3: one sequence)."""
    def ids(text: str) -> tuple[int, ...]:
        return tuple(reader.tokenizer(text, add_special_tokens=False)["input_ids"])

    assert len(ids("hello")) != len(ids(" hello")) and len(ids("the")) == len(ids(" the"))
    sampling = read(reader, bad_words=["hello", "  the", "def foo"])
    assert sampling.bad_words_ids == (ids("hello"), ids("the"), ids(" the"), ids("def foo"),
                                      ids(" def foo"))


def test_a_special_tokens_text_in_a_bad_word_bans_that_token_as_vllms(reader):
    """vLLM's tokenizer reads a special token's text in a word as the token (its
    update_from_tokenizer encodes each word so): the end text bans the end token, alone
    or after a word's other tokens; it was a 400."""
    end = reader.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    a = tuple(reader.tokenizer("a", add_special_tokens=False)["input_ids"])
    sampling = read(reader, bad_words=["<|endoftext|>", "a<|endoftext|>"])
    assert sampling.bad_words_ids[0] == (end,) and sampling.bad_words_ids[1] == (*a, end)
    assert all(word[-1] == end for word in sampling.bad_words_ids)


@pytest.mark.parametrize("fields, words", [
    ({"allowed_token_ids": [4096]}, "allowed_token_ids must be in"),
    ({"bad_words": ["  "]}, "must tokenize to at least one token"),
    ({"bad_words": ["the"] * 65}, "the limits are 128")])  # "the" and " the" each
def test_what_the_vocabulary_refuses_is_a_400_naming_the_field(reader, fields, words):
    with pytest.raises(BadRequest, match=words) as refused:
        read(reader, **fields)
    assert refused.value.status == 400 and refused.value.param == next(iter(fields))


def test_the_wire_carries_the_masks():
    params = SamplingParams(temperature=0.5, allowed_token_ids=(9, 1, 4),
                            bad_words_ids=((3,), (5, 6, 7)))
    assert wire.sampling_from_proto(wire.sampling_to_proto(params)) == params
    assert wire.sampling_from_proto(wire.sampling_to_proto(SamplingParams())) == \
        SamplingParams()


def test_bad_params_are_refused_at_the_pool_boundary():
    for bad in ({"allowed_token_ids": (-1,)}, {"bad_words_ids": ((),)},
                {"bad_words_ids": ((1, -2),)}, {"bad_words_ids": ((1,),) * 129}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_the_masks_draft_chains_and_are_tagged():
    from deployments.metrics import features
    from speculative.frontend import tree_allowed

    for params in (SamplingParams(allowed_token_ids=(1,)), SamplingParams(bad_words_ids=((1,),))):
        assert params.shapes_logits and not tree_allowed(params)
    assert features(SamplingParams(allowed_token_ids=(1,), bad_words_ids=((2,),))) == [
        "allowed_token_ids", "bad_words"]
    assert SamplingParams(bad_words_ids=((1,), (2, 3, 4))).shaping_ids == (1, 2, 3, 4)


@pytest.mark.parametrize("masks, output, proposal, kept", [
    ({}, [], [1, 4, 9], [1, 4, 9]),
    ({"allowed_token_ids": (1, 2, 3)}, [], [1, 2, 5, 1], [1, 2]),
    ({"bad_words_ids": ((4,),)}, [], [1, 4, 2], [1]),
    ({"bad_words_ids": ((2, 3),)}, [7, 2], [3, 1], []),  # after the output's 2
    ({"bad_words_ids": ((2, 3),)}, [7], [2, 3], [2]),  # after the proposal's own 2
    ({"bad_words_ids": ((2, 3),)}, [7], [1, 3], [1, 3]),
    ({"bad_words_ids": ((6, 2, 3),)}, [6], [2, 3, 3], [2]),
])
def test_a_model_free_draft_is_cut_where_the_masks_would_reject_it(masks, output, proposal,
                                                                   kept):
    """A token allowed_token_ids or bad_words mask has p = 0: always rejected, so an n-gram
    or suffix proposal stops before it (a draft that cannot pay is not verified)."""
    params = SamplingParams(temperature=0, max_tokens=8, **masks)
    assert unmasked_prefix(params, output, proposal) == kept


def test_prompt_lookup_drafts_only_what_the_masks_leave():
    """The context repeats 5 6 7: lookup proposes 7 5 6 after its last 5 6; a banned 5 cuts
    it to 7, allowed ids without 7 to nothing."""
    prompt = (5, 6, 7, 5, 6, 7, 5, 6)

    def proposal(**masks):
        call = ProposeCall(f"lookup{len(masks)}{sorted(masks)}", PrefixSync(
            0, EMPTY_PREFIX_HASH, prompt), 3, SamplingParams(temperature=0, max_tokens=8,
                                                             **masks), seed=0,
            prompt_len=len(prompt))
        return NgramDrafter(64).propose_now(call).token_ids

    assert proposal() == (7, 5, 6)
    assert proposal(bad_words_ids=((5,),)) == (7,)
    assert proposal(allowed_token_ids=(5, 6)) == ()

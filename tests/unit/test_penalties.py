"""Penalties (presence, frequency, repetition) exact under speculation.

`penalize` follows its references position by position: Hugging Face's repetition-penalty
processor, and OpenAI's formula for presence and frequency written out here. Greedy output
with each penalty equals the target alone (K = 0) with the same penalty, and a plain
reference loop over the full sequence, for fixed K, auto K, pipelined drafting and the n-gram
drafter; and it differs from unpenalised output, so the penalty really applied.
"""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from engine.kv import Sequence
from speculative import shaping
from speculative.sampling import SamplingParams
from speculative.shaping import SeenTokens, Shaping, penalize, shape_batch
from speculative.types import PrefixSync
from tests.tiny import noisy_copy, run, tiny_llama
from verifier.engine import ModelVerifier

MAX_TOKENS = 24
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [3, 9, 3], [11]]
PENALTIES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.2),
    "negative": dict(presence_penalty=-0.5, frequency_penalty=-0.3, repetition_penalty=0.7),
}


def reference_row(logits, params: SamplingParams, prompt: list[int], output: list[int]):
    """One position's penalised logits, written from the definitions."""
    row = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(
        torch.tensor([prompt + output]), logits[None].clone())[0]
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return row


@pytest.mark.parametrize("name", list(PENALTIES))
def test_each_row_counts_the_tokens_drafted_before_it(name):
    params = SamplingParams(**PENALTIES[name])
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 16, generator=generator) * 3
    prompt, output, drafted = [1, 2, 2], [2, 5, 5, 9], [5, 7, 1]
    rows = penalize(logits, params, prompt, output, drafted)
    for r in range(4):
        expected = reference_row(logits[r], params, prompt, output + drafted[:r])
        torch.testing.assert_close(rows[r], expected)


def test_a_large_vocabulary_is_penalised_in_its_seen_columns_only():
    """All three penalties over 5,000 tokens with a long history, against the reference; an
    output id past the logits' vocabulary (a smaller draft's) counts nowhere, and the
    caller's logits are left as they were."""
    params = SamplingParams(**PENALTIES["negative"])
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5000, generator=generator) * 3
    before = logits.clone()
    ids = torch.randint(0, 5000, (90,), generator=generator).tolist()
    prompt, output, drafted = ids[:40], ids[40:88], ids[88:]
    rows = penalize(logits, params, prompt, output + [5003], drafted)
    for r in range(3):
        expected = reference_row(logits[r], params, prompt, output + drafted[:r])
        torch.testing.assert_close(rows[r], expected)
    assert torch.equal(logits, before)


def test_no_penalty_leaves_the_logits_alone():
    logits = torch.randn(2, 8)
    assert penalize(logits, SamplingParams(), [1], [2, 3], [4]) is logits


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(list(PENALTIES)), st.integers(0, 6),
       st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 21), max_size=6)),
                min_size=1, max_size=8),
       st.lists(st.integers(0, 19), max_size=3), st.lists(st.integers(0, 21), max_size=3))
def test_counts_grown_with_the_committed_tokens_shape_as_the_lists_do(name, prompt_len, steps,
                                                                     drafted, extra):
    """A pool's counts (SeenTokens), grown a round's tokens at a time and now and then cut
    back (then counted anew), shape the logits bit for bit as the whole prompt and output
    do, with tokens after those counted (a draft's assumed and drafted ones), rows counting
    drafted tokens, and ids past the vocabulary (a larger one's) counting nowhere."""
    params = SamplingParams(**PENALTIES[name])
    logits = torch.randn(len(drafted) + 1, 20, generator=torch.Generator().manual_seed(9)) * 3
    seen = SeenTokens(prompt_len, params.repetition_penalty != 1)
    committed: list[int] = []
    for cut, added in steps:
        kept = committed[:len(committed) - cut]
        for committed in (kept, kept + added):
            counted = Shaping(0, len(logits), params, (), extra, drafted, seen.of(committed))
            whole = Shaping(0, len(logits), params, committed[:prompt_len],
                            committed[prompt_len:] + extra, drafted)
            assert counted.output_len == whole.output_len
            assert torch.equal(shape_batch(logits, [counted]), shape_batch(logits, [whole]))


def test_a_rebuilt_sequence_is_counted_anew():
    """A full-prefix rebuild (known_len 0) may bring other tokens, as many or more: the
    counts are the new prefix's, not the old ones grown."""
    sequence = Sequence()
    sequence.apply(PrefixSync(0, 0, (1, 2, 3)))
    assert sequence.counted(1, True).counts.tolist() == [0, 1, 1]
    sequence.apply(PrefixSync(0, 0, (4, 4, 5, 6)))
    counted = sequence.counted(1, True)
    assert (counted.columns.tolist(), counted.counts.tolist(), counted.prompted.tolist()) == \
        ([4, 5, 6], [1, 1, 1], [True, False, False])


def test_each_pool_counts_a_penalised_request_s_tokens_once(target, monkeypatch):
    """The pools count the committed tokens as they grow (speculative.shaping.SeenTokens):
    over a request, the tokens counted are each committed token once per pool and a call's
    or draft step's own few (assumed and drafted tokens), not its whole output again at
    every call and step (which grew as the output's square)."""
    tokens, calls = [], []

    def counting(base, prompt, output, others=()):
        tokens.append(len(prompt) + len(output))
        return real(base, prompt, output, others)

    real = shaping.counted
    monkeypatch.setattr(shaping, "counted", counting)
    prompt, k = PROMPTS[0], 3
    params = SamplingParams(temperature=0, max_tokens=160, **PENALTIES["negative"])
    out, state = run(ModelDrafter(noisy_copy(target, 0.01, seed=1)), ModelVerifier(target),
                     prompt, params, k)
    assert len(out) == 160 and state.stats.num_accepted_tokens > 0
    # per counted() call, a draft step's own tokens: its assumed ones and those drafted
    assert sum(tokens) <= 2 * (len(prompt) + len(out)) + len(tokens) * (2 * k + 1)
    assert len(tokens) < len(out) * 2 * (k + 1)  # no hidden count per token either


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 101)])
def test_out_of_range_penalties_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.fixture(scope="module")
def target():
    return tiny_llama(7)


@torch.no_grad()
def reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """The target alone, the whole sequence forwarded at every step, penalised by hand."""
    output: list[int] = []
    for _ in range(params.max_tokens):
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, -1]
        output.append(int(reference_row(logits, params, prompt, output).argmax()))
    return output


@pytest.fixture(scope="module")
def references(target):
    """What depends on the penalty and the prompt alone, not on a case's drafter, K or mode:
    each (penalty, prompt)'s reference_greedy and each prompt's unpenalised output at K = 0
    (which no drafter serves), each computed once for the module's 24 cases, not once per
    case (about 2.8 of their 9 CPU s)."""
    @functools.cache
    def expected(name: str, i: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **PENALTIES[name])
        return reference_greedy(target, PROMPTS[i], params)

    @functools.cache
    def unpenalised(i: int) -> list[int]:
        plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        return run(NgramDrafter(64), ModelVerifier(target), PROMPTS[i], plain, 0,
                   request_id=f"plain{i}")[0]

    return expected, unpenalised


DRAFTERS = {
    "noisy": lambda target: ModelDrafter(noisy_copy(target, 0.01, seed=1)),
    "ngram": lambda target: NgramDrafter(64),
}
CASES = [("noisy", 3, False), ("noisy", "auto", False), ("noisy", 2, True),
         ("noisy", 5, True), ("ngram", 3, False), ("ngram", "auto", True)]


@pytest.mark.parametrize("kind, k, pipelined", CASES,
                         ids=[f"{kind}-K{k}-{'pipelined' if p else 'sequential'}"
                              for kind, k, p in CASES])
@pytest.mark.parametrize("name", list(PENALTIES))
def test_penalised_greedy_equals_the_target_alone(target, references, name, kind, k,
                                                  pipelined):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **PENALTIES[name])
    drafter, verifier = DRAFTERS[kind](target), ModelVerifier(target)
    reference, unpenalised = references
    changed = accepted = drafted = 0
    for i, prompt in enumerate(PROMPTS):
        expected = reference(name, i)
        alone, _ = run(drafter, verifier, prompt, params, 0, request_id=f"alone{i}")
        out, state = run(drafter, verifier, prompt, params, k, request_id=f"r{i}",
                         pipelined=pipelined)
        assert alone == expected, f"K = 0, prompt {i}"
        assert out == expected, f"prompt {i}, K={k}, {kind} drafter"
        changed += unpenalised(i) != expected
        accepted += state.stats.num_accepted_tokens
        drafted += state.stats.num_draft_tokens
    assert changed > 0  # the penalty changed some output: the check can see it
    # both verdicts ran (the n-gram drafter proposes repeats, which penalties discourage:
    # that it drafted is what its case needs)
    assert 0 < accepted < drafted if kind == "noisy" else drafted > 0

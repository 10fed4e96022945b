"""Sampling under a grammar after the reasoning keeps the gated, masked target's law through
the real engines (vLLM 0.32's structured outputs under a reasoning parser:
speculative.token_masks.TokenMasks's `after`).

Same pair, window and check as tests/stats/test_grammar_law.py, with the gate's end id 6
("e", which the target draws about one time in eight): every id is allowed until the output
holds it, and the regex ([ab][cd]){3,} holds from its start on the tokens after it, so the
window's sequences cross the gate at any of its positions, inside a drafted block too, or
never. min_tokens keeps the end token out of the window (the reasoning allows it). A
verifier that gates by the committed output alone (a drafted block's rows after the end id
left free) must fail the same check, or be refused by the verifier's own guard (it is);
one whose mask forbids a letter the rule allows (its outputs pass the guard) must fail the
check.
"""

import numpy as np
import pytest
import torch

import tests.stats.laws as laws
from speculative.grammar import compile_spec, ll_tokenizer
from speculative.sampling import SamplingParams
from speculative.token_masks import TokenMasks
from tests.stats.laws import law_after_first, sequence_law
from tests.stats.test_grammar_law import LETTERS, PROMPT, REGEX, masks_without_b
from tests.stats.test_pipelined_distribution import (  # noqa: F401 (fixtures)
    VOCAB,
    chi2_passes,
    draft,
    sample_counts,
    target,
)
from tests.tiny import char_tokenizer

END = (6,)  # the reasoning's end ids here


@pytest.fixture(scope="module")
def gated():
    ll = ll_tokenizer(char_tokenizer(LETTERS), VOCAB)
    text = compile_spec("regex", REGEX, ll)

    def allowed(grammar_text, output):
        """The gated mask after output; all tokens after an output the rule forbids (such a
        prefix has probability 0: any law will do)."""
        matcher = TokenMasks(ll, grammar_text, END)
        if matcher.advance(list(output)) < len(output):
            return torch.ones(VOCAB, dtype=torch.bool)
        return matcher.next_mask(VOCAB)

    laws.ALLOWED[0] = allowed
    params = SamplingParams(temperature=1.0, max_tokens=5, grammar=text, grammar_after=END,
                            min_tokens=5, min_tokens_end_ids=(0,))
    return ll, params


@pytest.fixture(scope="module")
def gated_law(target, gated) -> np.ndarray:
    params = gated[1]
    first = sequence_law(target, PROMPT, params, 1)
    return np.tensordot(first, law_after_first(target, PROMPT, params, 3), axes=1)


def gated_counts(target, draft, gated, stop_law=None):
    ll, params = gated
    return sample_counts(target, draft, False, stop_law=stop_law, params=params,
                         prompt=PROMPT, grammar_tokenizer=ll)


@pytest.mark.slow
def test_tokens_after_the_reasoning_follow_the_gated_law(target, draft, gated, gated_law):
    counts, totals = gated_counts(target, draft, gated)
    passes, message = chi2_passes(counts, gated_law)
    assert passes, f"{message}: a correct implementation fails with probability 1e-6"
    assert 0 < totals["accepted"] < totals["drafted"]
    crossed = counts.reshape(VOCAB, -1)[END[0]].sum()  # the gate at the window's first place
    assert 0 < crossed < counts.sum()


real_masks = TokenMasks.masks


def masks_gated_by_the_committed_output(self, output, drafted, vocab_size, device=None):
    """Mutant of the verifier's masks: while the committed output has not ended the
    reasoning, every row of the block is free, a drafted end id's followers too."""
    rows = real_masks(self, output, drafted, vocab_size, device)
    committed = TokenMasks(self.tokenizer, self.grammar, self.after)
    committed.advance(list(output))
    if not committed.opened:
        rows[:] = True
    return rows


@pytest.mark.slow
def test_the_check_catches_a_gate_blind_to_drafted_tokens(target, draft, gated, gated_law,
                                                          monkeypatch):
    monkeypatch.setattr(TokenMasks, "masks", masks_gated_by_the_committed_output)
    try:
        counts, _ = gated_counts(target, draft, gated, stop_law=gated_law)
    except ValueError as error:
        assert "breaks the request's grammar" in str(error)
        return
    passes, message = chi2_passes(counts, gated_law)
    assert not passes, f"the committed-only gate passed: {message}"


@pytest.mark.slow
def test_the_check_catches_a_gated_mask_too_strict(target, draft, gated, gated_law,
                                                   monkeypatch):
    """The mutant above is refused by the verifier's guard before the check is reached: a
    mask that forbids "b" before and after the gate (its outputs pass the guard) must fail
    the check itself (at the same sample size, stopping once it fails)."""
    monkeypatch.setattr(TokenMasks, "masks", masks_without_b)
    counts, _ = gated_counts(target, draft, gated, stop_law=gated_law)
    passes, message = chi2_passes(counts, gated_law)
    assert not passes, f"the too-strict gated mask passed: {message}"

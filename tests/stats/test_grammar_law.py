"""Sampling under a grammar keeps the masked target's law through the real engines.

Same pair, window and check as tests/stats/test_pipelined_distribution.py (the three tokens
after the first: the next round's two drafted positions and the one after them), under a
regex over a character tokenizer of the pair's 8 ids whose allowed letters alternate with
the position: ([ab][cd]){3,}. The exact law masks each position to what the grammar allows
after the output before it (a fresh llguidance matcher) and renormalises. A verifier that
masks every drafted position as the block's first (the committed output only) must fail
the same check at the same sample size, or be refused by the verifier's own guard (it is),
and a verifier whose mask forbids a letter the grammar allows (its outputs pass the guard)
must fail the check.
Chi-square at a false-failure rate of 1e-6.
"""

import numpy as np
import pytest
import torch

import tests.stats.laws as laws
from drafter.model import ModelDrafter
from speculative.grammar import compile_spec, ll_tokenizer
from speculative.token_masks import TokenMasks
from speculative.sampling import SamplingParams
from tests.stats.laws import law_after_first, sequence_law
from tests.stats.test_pipelined_distribution import (  # noqa: F401 (fixtures)
    DRAFT_TOP_K,
    K,
    SAMPLES,
    VOCAB,
    chi2_passes,
    draft,
    sample_counts,
    target,
)
from tests.tiny import Batched, char_tokenizer, run_seeded
from verifier.engine import ModelVerifier

LETTERS = "abcdef"  # ids 2..7 (0 is the end token, 1 unknown)
PROMPT = [2, 4, 3]  # "a c b"
REGEX = "([ab][cd]){3,}"  # longer than max_tokens: the end token is never allowed


@pytest.fixture(scope="module")
def grammar():
    ll = ll_tokenizer(char_tokenizer(LETTERS), VOCAB)
    text = compile_spec("regex", REGEX, ll)

    def allowed(grammar_text, output):
        """The mask after output; all tokens after an output the grammar forbids (such a
        prefix has probability 0: any law will do, and none makes NaNs)."""
        matcher = TokenMasks(ll, grammar_text)
        if matcher.advance(list(output)) < len(output):
            return torch.ones(VOCAB, dtype=torch.bool)
        return matcher.next_mask(VOCAB)

    laws.ALLOWED[0] = allowed
    return ll, SamplingParams(temperature=1.0, max_tokens=5, grammar=text)


@pytest.fixture(scope="module")
def masked_law(target, grammar) -> np.ndarray:
    params = grammar[1]
    first = sequence_law(target, PROMPT, params, 1)
    return np.tensordot(first, law_after_first(target, PROMPT, params, 3), axes=1)


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_constrained_tokens_follow_the_masked_law(target, draft, grammar, masked_law,
                                                  pipelined):
    counts, totals = constrained_counts(target, draft, grammar, pipelined)
    passes, message = chi2_passes(counts, masked_law)
    assert passes, f"{message}: a correct implementation fails with probability 1e-6"
    assert 0 < totals["accepted"] < totals["drafted"]
    assert (totals["pipelined_rounds"] > SAMPLES / 10) == pipelined


def constrained_counts(target, draft, grammar, pipelined: bool, stop_law=None):
    ll, params = grammar
    return sample_counts(target, draft, pipelined, stop_law=stop_law, params=params,
                         prompt=PROMPT, grammar_tokenizer=ll)


real_masks = TokenMasks.masks


def masks_of_the_committed_output(self, output, drafted, vocab_size, device=None):
    """Mutant of the verifier's masks: every position gets the block's first row."""
    rows = real_masks(self, output, drafted, vocab_size, device)
    return rows[:1].expand_as(rows).clone()


@pytest.mark.slow
def test_the_check_catches_masks_blind_to_drafted_tokens(target, draft, grammar, masked_law,
                                                         monkeypatch):
    """It commits tokens the grammar forbids: the chi-square sees them (cells of probability
    0), or the verifier's next call does (it refuses an output that breaks the grammar)."""
    monkeypatch.setattr(TokenMasks, "masks", masks_of_the_committed_output)
    try:
        counts, _ = constrained_counts(target, draft, grammar, False, stop_law=masked_law)
    except ValueError as error:
        assert "breaks the request's grammar" in str(error)
        return
    passes, message = chi2_passes(counts, masked_law)
    assert not passes, f"the committed-only mask passed: {message}"


def masks_without_b(self, output, drafted, vocab_size, device=None):
    """Mutant of the verifier's masks: too strict, "b" (id 3) never allowed (a bit lost from
    the mask): every output still follows the grammar, so the verifier's guard lets it
    through, and the drafted b's are rejected by the coins."""
    rows = real_masks(self, output, drafted, vocab_size, device).clone()
    rows[:, LETTERS.index("b") + 2] = False
    return rows


@pytest.mark.slow
def test_the_check_catches_a_mask_too_strict(target, draft, grammar, masked_law,
                                             monkeypatch):
    """The mutant above is refused by the verifier's guard before the check is reached: a
    mask that forbids more than the grammar, whose outputs the guard passes, must fail the
    check itself (at the same sample size, stopping once it fails)."""
    monkeypatch.setattr(TokenMasks, "masks", masks_without_b)
    counts, _ = constrained_counts(target, draft, grammar, False, stop_law=masked_law)
    passes, message = chi2_passes(counts, masked_law)
    assert not passes, f"the too-strict mask passed: {message}"


def test_every_output_follows_the_grammar(target, draft, grammar):
    import re

    ll, params = grammar
    drafter = Batched(ModelDrafter(draft, draft_top_k=DRAFT_TOP_K, grammar_tokenizer=ll))
    verifier = Batched(ModelVerifier(target, grammar_tokenizer=ll))
    for out, _ in run_seeded(drafter, verifier, PROMPT, params, K, 200):
        text = "".join(LETTERS[t - 2] for t in out)
        assert re.fullmatch("[ab][cd][ab][cd][ab]", text), text  # cut at max_tokens 5

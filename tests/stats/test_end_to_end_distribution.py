"""End to end in sampling mode: sequences from the speculative loop over real engines (tiny
random models, KV caches, rollback, batched pools) follow the target's own distribution.

The first output token t1 is the target's alone (the drafter prefills beside that round); the
next round drafts one token, so t2 is the accepted or recovered token and t3 the bonus. Given
t1, target-only sampling draws t2 ~ p(.|prompt, t1), t3 ~ p(.|prompt, t1, t2) with the same
temperature / top-k / top-p processing; with a vocabulary of 8 that law is computed exactly
from the target's forwards, a sharper reference than a second sample. Chi-square conditioned
on t1, and t1 itself against its own law (the verifier's draw in a round without a draft: the
conditioned check cannot see it), each at half the false-failure rate of 1e-6 per case,
samples seeded.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from drafter.suffix import SuffixDrafter
from speculative import accept as accept_module
from speculative.sampling import SamplingParams
from speculative.types import DraftBlock, DraftDists
from tests.stats.chisq import chi_square, conditional_chi_square
from tests.stats.laws import law_after_first, sequence_law
from tests.tiny import Batched, noisy_copy, run_seeded, tiny_llama
from verifier import engine as verifier_module
from verifier.engine import ModelVerifier

VOCAB = 8
PROMPT = [1, 5, 2, 1, 5]  # repeats: the n-gram drafter finds [1, 5] and proposes 2
SAMPLES = 6000
CHUNK = 1000  # a mutant's counts are checked after every CHUNK samples
FALSE_FAILURE = 1e-6
CHECK_FAILURE = FALSE_FAILURE / 2  # two checks a case: the first token, the two after it


@pytest.fixture(scope="module")
def target():
    model = tiny_llama(21, vocab_size=VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)  # flatter: every cell is likely enough to be seen
    return model


def make_drafter(target, kind: str):
    """Drafters of each kind; "padded-*": a draft whose embedding has fewer or more rows than
    the target's (as Qwen2.5 sizes differ), its q fitted to the target's vocabulary."""
    if kind == "ngram":
        return NgramDrafter(VOCAB)
    if kind == "suffix-tree":  # continuations down to 2% of their node's count proposed
        return SuffixDrafter(VOCAB, min_token_prob=0.02)
    if kind == "suffix":  # one drafter for all samples: earlier outputs count too
        return SuffixDrafter(VOCAB)
    if kind.startswith("padded"):
        rows = VOCAB - 2 if kind == "padded-smaller" else VOCAB + 3
        return ModelDrafter(tiny_llama(9, vocab_size=rows), vocab_size=VOCAB)
    return ModelDrafter(noisy_copy(target, 0.3, seed=2))


T1 = SamplingParams(temperature=1.0, max_tokens=3)
# each of its three shapings changes the law (a verifier that leaves one out fails:
# test_a_verifier_shaping_p_wrongly_fails): top-p cuts tokens top-k keeps, every cumulative
# tail 0.02 or more from its bound (no rounding decides); without the temperature the first
# token's statistic is 4.9 times the threshold on average, sd 0.7 (1,000 multinomial samples
# of its law: 2.8 at least). (At T 0.7 and top-p 0.9, top-p cuts nothing top-k keeps.)
NUCLEUS = SamplingParams(temperature=0.4, top_k=5, top_p=0.8, max_tokens=3)
CASES = [(params, kind) for params in (T1, NUCLEUS)
         for kind in ("model", "ngram", "padded-smaller", "padded-larger")] + [
    (T1, "suffix"), (T1, "suffix-tree")]
# "suffix-tree": width 3, so the suffix drafter proposes a root and the other frequent
# continuations beside it, no q: verified by matching the target's own draw at each row
TREE_WIDTHS = {"suffix-tree": 3}
CONTEXT = 512  # the tiny target's context, which a tree's nodes must stay within


@pytest.mark.slow
@pytest.mark.parametrize("params, drafter_kind", CASES, ids=[
    f"{kind}-{'T1' if params is T1 else 'T0.4-k5-p0.8'}" for params, kind in CASES])
def test_two_token_sequences_match_target_only_sampling(target, params, drafter_kind):
    counts, accepted, siblings, drafted = sample_counts(target, params, drafter_kind)
    first = sequence_law(target, PROMPT, params, 1)
    statistic, threshold, df = chi_square(counts.sum((1, 2)), first, CHECK_FAILURE)
    assert statistic < threshold, (
        f"first token: chi2 = {statistic:.1f} > {threshold:.1f} (df {df}); a correct "
        f"implementation fails this with probability {CHECK_FAILURE}"
    )
    law = law_after_first(target, PROMPT, params, 2)
    statistic, threshold, df = conditional_chi_square(counts, law, CHECK_FAILURE)
    assert statistic < threshold, (
        f"chi2 = {statistic:.1f} > {threshold:.1f} (df {df}); a correct implementation "
        f"fails this with probability {CHECK_FAILURE}"
    )
    assert 0 < accepted < drafted  # both the accepted and the recovered paths ran
    if drafter_kind in TREE_WIDTHS:
        assert siblings > SAMPLES / 20  # paths that took a continuation beside the main one


def sample_counts(target, params, drafter_kind, stop_law=None, stop_first=None):
    """Counts of the three tokens over SAMPLES seeded requests; with stop_law (the law after
    the first token) or stop_first (the first token's), stops early once the counts fail
    that check (a mutant's run), looking every CHUNK."""
    drafter = Batched(make_drafter(target, drafter_kind))
    verifier = Batched(ModelVerifier(target))
    counts = np.zeros((VOCAB,) * 3)
    accepted = siblings = drafted = 0
    for i, (out, state) in enumerate(run_seeded(
            drafter, verifier, PROMPT, params, 1, SAMPLES,
            tree_width=TREE_WIDTHS.get(drafter_kind, 1), context_limit=CONTEXT)):
        counts[tuple(out)] += 1
        accepted += state.stats.num_accepted_tokens
        siblings += state.stats.sibling_rounds
        drafted += state.stats.num_draft_tokens
        if (i + 1) % CHUNK == 0 and failed(counts, stop_law, stop_first):
            break
    return counts, accepted, siblings, drafted


def failed(counts, law_after, first) -> bool:
    """Whether the counts fail the check against the law after the first token or the first
    token's own (each where given)."""
    checks = [] if law_after is None else [conditional_chi_square(counts, law_after,
                                                                  CHECK_FAILURE)]
    if first is not None:
        checks.append(chi_square(counts.sum((1, 2)), first, CHECK_FAILURE))
    return any(statistic > threshold for statistic, threshold, _ in checks)


def main_child_taken_untested(tree, target_token_ids):
    """Mutant of the router's walk over a matched tree: the root's main child is taken as if
    the target's draw had matched it."""
    return real_walk(tree, (tree.token_ids[0], *target_token_ids[1:]))


real_walk = accept_module.accept_tree_greedy


@pytest.mark.slow
def test_a_matched_tree_taken_untested_fails(target, monkeypatch):
    monkeypatch.setattr(accept_module, "accept_tree_greedy", main_child_taken_untested)
    law = law_after_first(target, PROMPT, T1, 2)
    counts, *_ = sample_counts(target, T1, "suffix-tree", stop_law=law)
    statistic, threshold, _ = conditional_chi_square(counts, law, CHECK_FAILURE)
    assert statistic > threshold, "the untested-main-child mutant passed"


real_draw = verifier_module.draw_recovered_and_bonus


def first_token_off_its_law(target_probs, drafted, draft_probs, seeds):
    """Mutant of the verifier's draws: a round without a draft (a request's first) draws
    uniformly over p's support, p's weights ignored."""
    if target_probs.shape[1] == 1:
        support = (target_probs > 0).to(target_probs.dtype)
        target_probs = support / support.sum(-1, keepdim=True)
    return real_draw(target_probs, drafted, draft_probs, seeds)


def fails_its_checks(target, params, drafter_kind) -> bool:
    """Whether a case's own two checks fail, at its sample size (stopping once one fails):
    a mutant's run."""
    first = sequence_law(target, PROMPT, params, 1)
    law = law_after_first(target, PROMPT, params, 2)
    counts, *_ = sample_counts(target, params, drafter_kind, stop_law=law, stop_first=first)
    return failed(counts, law, first)


@pytest.mark.slow
def test_a_first_token_off_its_law_fails(target, monkeypatch):
    """The conditioned check cannot see the first token's law (it passes this mutant): the
    first-token check must."""
    monkeypatch.setattr(verifier_module, "draw_recovered_and_bonus", first_token_off_its_law)
    first = sequence_law(target, PROMPT, NUCLEUS, 1)
    counts, *_ = sample_counts(target, NUCLEUS, "model", stop_first=first)
    statistic, threshold, _ = chi_square(counts.sum((1, 2)), first, CHECK_FAILURE)
    assert statistic > threshold, "the first-token mutant passed"


real_logits_to_probs = verifier_module.logits_to_probs


def p_at_temperature_one(logits, params):
    """Mutant of the verifier's p: the request's temperature ignored (its top-k and top-p
    kept); the drafter's q and the reference keep it."""
    return real_logits_to_probs(logits, replace(params, temperature=1.0))


def p_without_top_k(logits, params):
    """Mutant of the verifier's p: the request's top-k ignored (its other shapings kept)."""
    return real_logits_to_probs(logits, replace(params, top_k=0))


def p_without_top_p(logits, params):
    """Mutant of the verifier's p: the request's top-p ignored (its other shapings kept)."""
    return real_logits_to_probs(logits, replace(params, top_p=1.0))


@pytest.mark.slow
@pytest.mark.parametrize("mutant", [p_at_temperature_one, p_without_top_k, p_without_top_p],
                         ids=["temperature-ignored", "top-k-ignored", "top-p-ignored"])
def test_a_verifier_shaping_p_wrongly_fails(target, monkeypatch, mutant):
    """The shaped case (model-T0.4-k5-p0.8) run through its own two checks, at its sample
    size (stopping once one fails): a verifier whose p leaves out the request's temperature,
    top-k or top-p (no other law test's verifier shapes by them) must fail them."""
    monkeypatch.setattr(verifier_module, "logits_to_probs", mutant)
    assert fails_its_checks(target, NUCLEUS, "model"), f"the {mutant.__name__} mutant passed"


real_draw_from = ModelDrafter.draw_from


def q_offset_by_the_padding(self, drafts, probs):
    """Mutant of a padded draft's q: its tokens drawn from q over the target's ids, but q
    shipped with its entries moved by the vocabularies' difference (the draft's id i sent as
    i + V - V', cyclically: padded at the front, or cut at the front). Exact where V' = V."""
    tokens = real_draw_from(self, drafts, probs)
    offset = VOCAB - self.model.config.vocab_size
    for draft in drafts:
        weights, ids = draft.q_rows[-1]
        draft.q_rows[-1] = (weights.roll(offset, -1), ids)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["padded-smaller", "padded-larger"])
def test_a_padded_draft_shipping_q_at_the_wrong_ids_fails(target, monkeypatch, drafter_kind):
    """A padded case's own two checks (at T1, its sample size, stopping once one fails)
    reject a draft whose q reaches the target's ids moved by the padding or the cut: the
    fitting of q to the target's vocabulary is what these cases are about."""
    monkeypatch.setattr(ModelDrafter, "draw_from", q_offset_by_the_padding)
    assert fails_its_checks(target, T1, drafter_kind), \
        f"the {drafter_kind} offset-q mutant passed"


real_ngram_propose = NgramDrafter.propose_now


def ngram_with_a_uniform_q(self, call):
    """Mutant of the n-gram drafter: its tokens shipped with a uniform q, not the point mass
    they were drawn from (so the target accepts them p(x) V times as often as it should)."""
    block = real_ngram_propose(self, call)
    if block.draft_probs is None:
        return block
    rows = torch.full((len(block.token_ids), VOCAB), 1 / VOCAB)
    return DraftBlock(block.token_ids, DraftDists.from_dense(rows))


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["ngram", "suffix"])
def test_model_free_drafts_tested_against_a_wrong_q_fail(target, monkeypatch, drafter_kind):
    """The n-gram and suffix (chain) cases' own checks (at T1, their sample size, stopping
    once one fails) reject a model-free draft verified against a law it was not drawn
    from: the drafted token taken as a draw of q by rejection sampling is what the cases
    are about (the suffix drafter ships its proposals through the n-gram drafter's
    propose_now)."""
    monkeypatch.setattr(NgramDrafter, "propose_now", ngram_with_a_uniform_q)
    assert fails_its_checks(target, T1, drafter_kind), \
        f"the {drafter_kind} uniform-q mutant passed"

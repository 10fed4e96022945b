"""Seeded statistical tests: tokens from rejection sampling are distributed as the target's.

The target and the draft are Markov chains over a small vocabulary (their next-token
distribution depends on the last token only), so the exact law of the first two output tokens
is known in closed form: p0[t1] * P[t1, t2]. Each check is a chi-square test at a
false-failure rate of 5e-7, two checks per case: a correct sampler fails a case with
probability < 1e-6. Mutants of the sampler must fail the same checks, so they can fail.
"""

import bisect
import dataclasses

import numpy as np
import pytest
import torch

import speculative.rejection as rejection
import verifier.engine
from speculative.sampling import SamplingParams, logits_to_probs, sample
from speculative.types import DraftDists
from tests.stats.chisq import chi_square

VOCAB = 6
# Sized by power, not count: at 8,000 samples the checks fail, with probability 1 - 1e-6,
# any law whose chi-square divergence from the target's, sum((p' - p)^2 / p), is at least
# 0.015 (the first token, 5 df) or 0.022 (the first two, 35 df) (noncentral chi-square, at
# chisq's threshold; 30,000 samples bought 0.004 and 0.006 at 3.75 times the cost).
# Measured: the K = 1 mutants below fail by 250-750 samples, the K = 3 one by 5,500
# (141.7 against 90.8 at 8,000).
SAMPLES = 8_000
CHUNK = 500  # a mutant's counts are checked after every CHUNK samples
FALSE_FAILURE = 5e-7


class MarkovPair:
    def __init__(self, params: SamplingParams, seed: int):
        g = torch.Generator().manual_seed(seed)
        logits = lambda *shape: torch.randn(*shape, generator=g) * 1.5  # noqa: E731
        self.target_start = logits_to_probs(logits(VOCAB), params)
        self.target_next = logits_to_probs(logits(VOCAB, VOCAB), params)
        self.draft_start = logits_to_probs(logits(VOCAB), params)
        self.draft_next = logits_to_probs(logits(VOCAB, VOCAB), params)
        # the rows a position reads: 0 the start's, t + 1 the one after token t
        self.target_rows = torch.cat([self.target_start[None], self.target_next])
        self.draft_rows = torch.cat([self.draft_start[None], self.draft_next])
        # the draft's own draws are the test's, not the product's: inverted cumulative sums
        # on the host (a torch draw per drafted token cost a third of the test's time)
        rows = self.draft_rows.double()
        self.draft_cumulative = (rows.cumsum(-1) / rows.sum(-1, keepdim=True)).tolist()
        self.last_positive = [max(i for i, w in enumerate(row) if w > 0) for row in rows.tolist()]

    def draw_draft(self, row: int, uniform: float) -> int:
        """The draft's token after row `row` (0: the start, t + 1: after token t)."""
        return min(bisect.bisect_right(self.draft_cumulative[row], uniform),
                   self.last_positive[row])

    def first_twos(self, k: int, count: int, generator,
                   host: np.random.Generator) -> list[tuple[int, int]]:
        """`count` samples' first two tokens: speculative rounds with K = k until each has
        committed two, on the product's path: the verifier draws every residual and the bonus
        in advance (verifier.engine.draw_recovered_and_bonus, each chain from its own seed)
        and the router tosses the coins (rejection.accept_drawn), reading q_i(x_i) as it does
        from the wire form. The unfinished samples' rounds run side by side, one draw over
        their chains a round, as a verifier's batch does: a chain's draws do not depend on
        the chains beside it. `host` draws the draft's tokens and the verifier's seeds."""
        outputs: list[list[int]] = [[] for _ in range(count)]
        running = list(range(count))
        while running:
            chains, rows = [], []  # each chain's drafted tokens, and the row of each position
            for sample, uniforms in zip(running, host.random((len(running), k)).tolist()):
                chain_rows = [outputs[sample][-1] + 1 if outputs[sample] else 0]
                chain = []
                for uniform in uniforms:
                    chain.append(self.draw_draft(chain_rows[-1], uniform))
                    chain_rows.append(chain[-1] + 1)
                chains.append(chain)
                rows.append(chain_rows)
            rows = torch.tensor(rows)  # [N, K + 1]
            draft = self.draft_rows[rows[:, :k]]  # [N, K, V]
            seeds = host.integers(0, 2**62, size=len(running)).tolist()
            drawn = verifier.engine.draw_recovered_and_bonus(self.target_rows[rows], chains,
                                                             draft, seeds)
            at_draft = DraftDists.from_dense(draft.flatten(0, 1)).at(
                [token for chain in chains for token in chain])
            for index, (sample, chain, scores) in enumerate(zip(running, chains, drawn)):
                out = rejection.accept_drawn(chain, at_draft[index * k:(index + 1) * k],
                                             scores.draft_target_probs,
                                             scores.recovered_token_ids,
                                             scores.bonus_token_id, generator)
                outputs[sample].extend(out.output_token_ids)
            running = [sample for sample in running if len(outputs[sample]) < 2]
        return [(output[0], output[1]) for output in outputs]

    def exact_pairs(self) -> np.ndarray:
        return (self.target_start[:, None] * self.target_next).numpy()


def checks(pair: MarkovPair, k: int, seed: int, stop_at_failure: bool = False):
    """(first token, first two) chi-square results over SAMPLES; stop_at_failure: stop as
    soon as a check fails, looking every CHUNK samples (a mutant's run)."""
    generator, host = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    counts = np.zeros((VOCAB, VOCAB))
    exact = pair.exact_pairs()
    for _ in range(SAMPLES // CHUNK):
        for first_two in pair.first_twos(k, CHUNK, generator, host):
            counts[first_two] += 1
        if stop_at_failure and failed(results(counts, exact)):
            break
    return results(counts, exact)


def results(counts, exact):
    return (chi_square(counts.sum(1), exact.sum(1), FALSE_FAILURE),
            chi_square(counts, exact, FALSE_FAILURE))


def failed(checked) -> bool:
    return any(statistic > threshold for statistic, threshold, _ in checked)


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05),
]


@pytest.mark.slow
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}"
                         + (f"-min{p.min_p}" if p.min_p else ""))
@pytest.mark.parametrize("k", [1, 3], ids=["K1", "K3"])
def test_first_token_and_first_two_tokens_match_the_target(params, k):
    pair = MarkovPair(params, seed=11)
    checked = checks(pair, k, 5)
    for name, (statistic, threshold, df) in zip(("first token", "first two"), checked):
        assert statistic < threshold, (
            f"{name}: chi2 = {statistic:.1f} > {threshold:.1f} (df {df}); a correct sampler "
            f"fails this with probability {FALSE_FAILURE}"
        )


def recover_from_target(target_probs, draft_probs):
    return target_probs  # mutant: skips the residual


real_draw = verifier.engine.draw_recovered_and_bonus


def bonus_from_last_drafted_position(target_probs, drafted, draft_probs, seeds):
    """Mutant: draws each chain's bonus token from p_K instead of p_(K+1)."""
    k = target_probs.shape[1] - 1
    return [dataclasses.replace(scores, bonus_token_id=sample(
        rows[max(k - 1, 0)], torch.Generator().manual_seed(seed)))
        for scores, rows, seed in zip(real_draw(target_probs, drafted, draft_probs, seeds),
                                      target_probs, seeds)]


real_rand = torch.rand


def coins_of_zero(*size, **kwargs):
    """Mutant of torch.rand for the router's coins (its 0-d draws): always 0, so every drafted
    token is accepted; the verifier's draws (shaped [K + 1, 1]) stay as they were."""
    return torch.tensor(0.0) if size in ((), ((),)) else real_rand(*size, **kwargs)


real_residual_rows = verifier.engine.residual_rows


def residual_past_the_first_is_p(target_probs, draft_probs):
    """Mutant: the residual right at a chain's first position, p itself at the later ones
    (exact at K = 1: only a longer chain can see it)."""
    rows = real_residual_rows(target_probs, draft_probs)
    return torch.cat([rows[:, :1], target_probs[:, 1:]], 1)


MUTANTS = {  # name: (patch, K)
    "accept all": (lambda mp: mp.setattr(rejection.torch, "rand", coins_of_zero), 1),
    "residual is p": (lambda mp: mp.setattr(verifier.engine, "residual_rows",
                                            recover_from_target), 1),
    "bonus from p_K": (lambda mp: mp.setattr(verifier.engine, "draw_recovered_and_bonus",
                                             bonus_from_last_drafted_position), 1),
    # the K = 3 cases': a bug past the first position (the bonus, the fourth token, is out
    # of their checks' sight: "bonus from p_K" is exact there)
    "residual past the first is p": (lambda mp: mp.setattr(
        verifier.engine, "residual_rows", residual_past_the_first_is_p), 3),
}


@pytest.mark.slow
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_the_checks_catch_a_broken_sampler(monkeypatch, mutant):
    """Each mutant fails the real test's check, at its sample size (stopping once it
    fails), for its K: 1 (where a round's bonus is the second token), or 3 (where the
    second token is a drafted position's)."""
    patch, k = MUTANTS[mutant]
    patch(monkeypatch)
    pair = MarkovPair(SamplingParams(temperature=1.0), seed=11)
    checked = checks(pair, k, 5, stop_at_failure=True)
    assert failed(checked), checked

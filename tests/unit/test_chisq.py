"""The law tests' chi-square helpers against published values (scipy 1.17.1's, quoted)."""

from math import comb

import numpy as np
import pytest

from tests.stats.chisq import (TAIL_MARGIN, chi2_isf, chi_square, conditional_chi_square,
                               two_sample_chi_square)


@pytest.mark.parametrize("tail, df, quantile", [
    (0.05, 1, 3.8414588206941285), (0.05, 10, 18.30703805327515),
    (1e-6, 1, 23.928126976934827), (1e-6, 63, 131.36970205168686),
    (1e-6, 4095, 4539.664051381019)])
def test_the_upper_tail_quantile_is_chi_squares(tail, df, quantile):
    assert chi2_isf(tail, df) == pytest.approx(quantile, rel=1e-9)


def test_the_two_sample_statistic_is_the_contingency_tables():
    statistic, threshold, df = two_sample_chi_square({0: 10, 1: 20, 2: 30}, {0: 20, 1: 20, 2: 20},
                                                     1e-6)
    # chi2_contingency(correction=False, lambda_="cressie-read"); Pearson's (lambda_ 1): 16 / 3
    assert (statistic, df) == (pytest.approx(5.350459346561102), 2)
    assert threshold == pytest.approx(chi2_isf(1e-6 / TAIL_MARGIN, 2))


def test_a_sample_where_the_law_has_none_fails_even_beside_small_cells():
    """A cell of probability 0 with a sample in it is an outright failure, also when the
    pooling of small cells would have put it beside cells of positive probability."""

    law = [0.5, 0.49, 0.0025, 0.0025, 0.0025, 0.0025, 0.0]  # cells 2-6 pooled (expected < 5)
    counts = [500, 490, 2, 3, 2, 2, 1]  # the pooled cell holds exactly its expected 10
    statistic, threshold, _ = chi_square(counts, law, 1e-6)
    assert statistic > threshold
    statistic, threshold, _ = conditional_chi_square([counts, counts], [law, law], 1e-6)
    assert statistic > threshold


def rejections(check, draws) -> int:
    return sum(statistic > threshold for statistic, threshold, _ in map(check, draws))


def test_a_correct_sampler_fails_no_more_often_than_asked_beside_a_tiny_cell():
    """The first token's law of a sampler case (temperature 0.6) at 8,000 samples: one cell
    expects 2.25 samples, pooled alone it made Pearson's tail 47 times chi-square's at 5e-7
    (2.25 times at 1e-3); the pool now takes the next smallest cell, and the threshold a
    tenth of the rate (TAIL_MARGIN)."""

    law = np.array([0.04616, 0.946545, 0.00127, 0.00028125, 0.0020238, 0.00372])
    law /= law.sum()
    draws = np.random.default_rng(5).multinomial(8000, law, size=20_000)
    assert rejections(lambda counts: chi_square(counts, law, 1e-3), draws) <= 20


def test_groups_pooled_whole_keep_their_degrees_of_freedom():
    """Six first tokens seen 4 times each (every cell of theirs pooled) beside one seen 400
    times: their pool's count is fixed by their totals, so the statistic is chi-square with
    the big group's 3 df. Counting one df off per group left max(1, 5 - 7) = 1: a correct
    sampler failed 8.5% of the checks at 1%."""

    law = np.array([[0.25] * 4] + [[0.5, 0.5, 0.0, 0.0]] * 6)
    rng = np.random.default_rng(6)
    draws = [np.vstack([rng.multinomial(400, law[0])]
                       + [rng.multinomial(4, row) for row in law[1:]]) for _ in range(2000)]
    assert rejections(lambda counts: conditional_chi_square(counts, law, 1e-2), draws) <= 20


def test_a_law_whose_other_cells_expect_fewer_than_five_in_all_is_still_tested():
    """One token expects 2.4 of 8,000 samples and the other 7,997.6: the pool's top-up took
    the likeliest cell too, and the one cell left held the whole sample (df 0, statistic
    0), so the check passed whatever the counts. That cell stays, tested exactly beside the
    pool (its count is binomial; two samples: hypergeometric), at no more than the rate."""

    law = np.array([0.9997, 0.0003])
    for check in (lambda counts: chi_square(counts, law, 1e-6),
                  lambda counts: conditional_chi_square(np.array([counts]), law[None], 1e-6)):
        statistic, threshold, _ = check([4000, 4000])
        assert statistic > threshold
        statistic, threshold, _ = check([7998, 2])
        assert statistic < threshold
    rng = np.random.default_rng(7)
    draws = rng.multinomial(8000, law, size=20_000)
    assert rejections(lambda counts: chi_square(counts, law, 1e-2), draws) <= 200
    statistic, threshold, df = two_sample_chi_square({0: 10_000}, {0: 91, 1: 9}, 1e-6)
    assert statistic > threshold and df == 1  # Fisher's: p = C(100, 9) / C(10109, 9)
    pairs = zip(rng.multinomial(3000, law, size=1000), rng.multinomial(1000, law, size=1000))
    assert rejections(lambda pair: two_sample_chi_square(
        *({0: counts[0], 1: counts[1]} for counts in pair), 1e-1), pairs) <= 100


def test_a_law_whose_every_cell_expects_fewer_than_five_is_still_tested():
    """Forty samples over 20 equally likely cells (each expects 2): pooled whole, the pool
    would hold the whole sample and the check could not fail. The likeliest cell (the first
    of a tie) stays out of the pool, tested exactly beside it (binomial; two samples:
    hypergeometric), at no more than the rate: forty in it fail. Its count alone could not
    see forty in a pooled cell (it is then 0, with probability 0.95^40 = 0.13): each pooled
    cell's count is tested too, exactly (binomial, Bonferroni), each half the rate."""
    law = np.full(20, 0.05)
    for cell in (0, 7):
        heaped = np.zeros(20)
        heaped[cell] = 40
        for check in (lambda counts: chi_square(counts, law, 1e-6),
                      lambda counts: conditional_chi_square(counts.reshape(2, 10),
                                                            law.reshape(2, 10) * 2, 1e-6)):
            statistic, threshold, _ = check(heaped)
            assert statistic > threshold, cell
            statistic, threshold, _ = check(np.full(20, 2.0))
            assert statistic < threshold
    draws = np.random.default_rng(8).multinomial(40, law, size=20_000)
    assert rejections(lambda counts: chi_square(counts, law, 1e-2), draws) <= 200
    statistic, threshold, df = two_sample_chi_square({0: 8}, {1: 8}, 1e-3)  # each 4 expected
    assert statistic > threshold and df == 1  # Fisher's: 2 / C(16, 8) of the law reaches it


def test_a_pooled_cell_fails_from_the_count_a_correct_sampler_reaches_at_its_share_of_the_rate():
    """Beside a lone cell, a pooled cell fails at the least count c whose binomial upper tail
    P(X >= c) is at most half the rate over the pooled cells, and passes at c - 1 (the bound
    computed here from exact binomial sums)."""
    law = np.full(20, 0.05)  # 40 samples: the first cell lone, 19 pooled
    tail = 1e-6 / 2 / 19
    above = [sum(comb(40, x) * 0.05 ** x * 0.95 ** (40 - x) for x in range(c, 41))
             for c in range(41)]
    bound = next(c for c in range(41) if above[c] <= tail)
    for count, fails in ((bound, True), (bound - 1, False)):
        counts = np.full(20, 2.0)
        counts[7], counts[8] = count, 0
        counts[9:9 + count - 4] -= 1  # other pooled cells give up what cell 7 took; the lone
        # cell (the first) keeps its expected 2
        assert counts.sum() == 40 and counts.min() >= 0
        statistic, threshold, _ = chi_square(counts, law, 1e-6)
        assert (statistic > threshold) == fails, (count, statistic, threshold)

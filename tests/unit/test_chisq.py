"""The law tests' chi-square helpers against published values (scipy 1.17.1's, quoted)."""

import pytest

from tests.stats.chisq import chi2_isf, two_sample_chi_square


@pytest.mark.parametrize("tail, df, quantile", [
    (0.05, 1, 3.8414588206941285), (0.05, 10, 18.30703805327515),
    (1e-6, 1, 23.928126976934827), (1e-6, 63, 131.36970205168686),
    (1e-6, 4095, 4539.664051381019)])
def test_the_upper_tail_quantile_is_chi_squares(tail, df, quantile):
    assert chi2_isf(tail, df) == pytest.approx(quantile, rel=1e-9)


def test_the_two_sample_statistic_is_the_contingency_tables():
    statistic, threshold, df = two_sample_chi_square({0: 10, 1: 20, 2: 30}, {0: 20, 1: 20, 2: 20},
                                                     1e-6)
    assert (statistic, df) == (pytest.approx(16 / 3), 2)  # chi2_contingency, no correction
    assert threshold == pytest.approx(chi2_isf(1e-6, 2))


def test_a_sample_where_the_law_has_none_fails_even_beside_small_cells():
    """A cell of probability 0 with a sample in it is an outright failure, also when the
    pooling of small cells would have put it beside cells of positive probability."""
    from tests.stats.chisq import chi_square, conditional_chi_square

    law = [0.5, 0.49, 0.0025, 0.0025, 0.0025, 0.0025, 0.0]  # cells 2-6 pooled (expected < 5)
    counts = [500, 490, 2, 3, 2, 2, 1]  # the pooled cell holds exactly its expected 10
    statistic, threshold, _ = chi_square(counts, law, 1e-6)
    assert statistic > threshold
    statistic, threshold, _ = conditional_chi_square([counts, counts], [law, law], 1e-6)
    assert statistic > threshold

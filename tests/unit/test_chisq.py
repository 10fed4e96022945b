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

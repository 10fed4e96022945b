"""Chi-square goodness of fit sized by the false-failure rate a correct sampler may have."""

import numpy as np
from scipy import stats


def chi_square(counts, expected_probs, false_failure: float):
    """(statistic, threshold, df) of observed counts against a known distribution.

    Cells with fewer than 5 expected samples are pooled into one, so the chi-square
    approximation holds; a correct sampler exceeds the threshold with probability
    `false_failure`.
    """
    counts = np.asarray(counts, dtype=float).ravel()
    expected = np.asarray(expected_probs, dtype=float).ravel() * counts.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    # a sample in a cell of zero probability is an outright failure
    if np.any((expected == 0) & (counts > 0)):
        return float("inf"), 0.0, len(counts) - 1
    keep = expected > 0
    statistic = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return statistic, float(stats.chi2.isf(false_failure, df)), df

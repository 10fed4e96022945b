"""Chi-square goodness of fit sized by the false-failure rate a correct sampler may have."""

import numpy as np
import torch


def chi_square(counts, expected_probs, false_failure: float):
    """(statistic, threshold, df) of observed counts against a known distribution.

    Cells with fewer than 5 expected samples are pooled into one, so the chi-square
    approximation holds; a correct sampler exceeds the threshold with probability
    `false_failure`.
    """
    counts = np.asarray(counts, dtype=float).ravel()
    expected = np.asarray(expected_probs, dtype=float).ravel() * counts.sum()
    # a sample in a cell of zero probability is an outright failure: looked for before the
    # pooling, which would hide it among the small cells of positive probability
    if np.any((expected == 0) & (counts > 0)):
        return float("inf"), 0.0, len(counts) - 1
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    statistic = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return statistic, chi2_isf(false_failure, df), df


def conditional_chi_square(counts, conditional_probs, false_failure: float):
    """(statistic, threshold, df) of counts[g, ...] against a known law of the rest given
    the group g: each group's expected counts are its own total times its row of
    `conditional_probs` (rows sum to 1), so only the law within groups is tested.

    A request's first token is the target's alone (its round drafts nothing while the
    drafter prefills beside it), so the law tests condition on it: the groups are the first
    token, the cells the drafted positions after it. Cells with fewer than 5 expected samples
    are pooled into one; df loses one per group (each group's total is given).
    """
    counts = np.asarray(counts, dtype=float)
    groups = counts.shape[0]
    counts = counts.reshape(groups, -1)
    law = np.asarray(conditional_probs, dtype=float).reshape(groups, -1)
    expected = law * counts.sum(1, keepdims=True)
    observed_groups = int((counts.sum(1) > 0).sum())
    counts, expected = counts.ravel(), expected.ravel()
    if np.any((expected == 0) & (counts > 0)):  # before pooling, as chi_square's
        return float("inf"), 0.0, len(counts) - observed_groups
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    statistic = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    df = max(1, int(keep.sum()) - observed_groups)
    return statistic, chi2_isf(false_failure, df), df


def two_sample_chi_square(first: dict, second: dict, false_failure: float):
    """(statistic, threshold, df) of two samples of outcomes ({outcome: count}) drawn from
    one law: the 2 x C contingency test, outcomes with fewer than 5 expected in either
    sample pooled into one."""
    outcomes = sorted(set(first) | set(second), key=str)
    table = np.array([[first.get(o, 0) for o in outcomes], [second.get(o, 0) for o in outcomes]],
                     dtype=float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    small = (expected < 5).any(0)
    if small.any():
        table = np.column_stack([table[:, ~small], table[:, small].sum(1)])
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 0.0, float("inf"), 0
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1  # (2 - 1) x (C - 1)
    return statistic, chi2_isf(false_failure, df), df


def chi2_isf(tail: float, df: int) -> float:
    """The x that a chi-square variable of df degrees of freedom exceeds with probability
    `tail`: P(X > x) = Q(df / 2, x / 2), Q the regularized upper incomplete gamma function
    (torch.special.gammaincc), decreasing in x, inverted by bisection to float64 precision."""
    def above(x: float) -> float:
        return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                             torch.tensor(x / 2, dtype=torch.float64)))

    low, high = 0.0, max(1.0, 2.0 * df)
    while above(high) > tail:
        low, high = high, 2 * high
    for _ in range(200):
        middle = (low + high) / 2
        if middle in (low, high):
            break
        low, high = (middle, high) if above(middle) > tail else (low, middle)
    return high

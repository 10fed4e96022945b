"""Chi-square goodness of fit sized by the false-failure rate a correct sampler may have."""

import functools

import numpy as np
import torch

# The statistic is Cressie and Read's power divergence at lambda = 2/3 (their advice), not
# Pearson's: where cells expect 5-30 samples, Pearson's upper tail at 1e-6 is heavier than
# chi-square's (each cell's Poisson skew, squared). Over the suite's exact laws, a correct
# sampler crosses chi2_isf(1e-6) 1.1-4 times as often as 1e-6 with Pearson's and 1.0-2.2
# times with this one (a Poisson convolution of each law, checked by multinomial draws);
# on a law whose cells expect 12-30, 9.3 and 3.0 times at 5e-7 (1e8 draws). So the
# threshold is taken at a tenth of the rate asked for (then 0.1-0.4 of it; 0.4 on that law,
# measured), and the pool holds 5 expected or more (pooled alone, 2.25 expected samples made
# Pearson's tail 47 times chi-square's).
LAMBDA = 2 / 3
TAIL_MARGIN = 10
SMALL = 5  # cells expecting fewer samples are pooled


def pooled_cells(expected: np.ndarray) -> np.ndarray:
    """[cells] bool: the cells of positive expectation pooled into one, those expecting fewer
    than SMALL and, while the pool itself expects fewer, the smallest of the others, but
    never the last of them: pooled too, one cell would hold the whole sample, and the check
    could not fail (lone_cell_threshold tests that cell beside a pool of fewer). Where every
    cell expects fewer than SMALL, the likeliest is kept out of the pool for that reason."""
    pool = (expected > 0) & (expected < SMALL)
    kept = int(((expected > 0) & ~pool).sum())
    if pool.any():
        for cell in np.argsort(expected, kind="stable"):
            if expected[pool].sum() >= SMALL or kept == 1:
                break
            if expected[cell] > 0 and not pool[cell]:
                pool[cell], kept = True, kept - 1
    if kept == 0 and pool.sum() > 1:
        pool[int(np.argmax(expected))] = False
    return pool


def lone_cell(expected: np.ndarray, pool: np.ndarray) -> int | None:
    """The one cell kept beside a pool (all the others together), where either expects
    fewer than SMALL samples (chi-square's tail is far off there), else None."""
    kept = np.flatnonzero(~pool & (expected > 0))
    pooled = expected[pool].sum()
    return int(kept[0]) if len(kept) == 1 and 0 < pooled and min(
        pooled, expected[kept[0]]) < SMALL else None


def lone_cell_threshold(statistics: np.ndarray, log_probs: np.ndarray, tail: float) -> float:
    """A t that the statistic reaches with probability `tail` or less, when it is
    statistics[x] with probability exp(log_probs[x]) (x: the lone cell's count): exact, the
    largest values while their mass stays within the tail, t halfway between them and the
    rest (the statistic takes few values: `>` and `>=` then agree, rounding aside)."""
    order = np.argsort(-statistics, kind="stable")
    reached = np.cumsum(np.exp(log_probs[order]))  # P(statistic >= each), largest first
    kept = statistics[order[min(int(np.searchsorted(reached, tail, side="right")),
                                len(order) - 1)]]  # the largest value not rejected
    rejected = statistics[statistics > kept]
    return float((kept + rejected.min()) / 2) if rejected.size else float("inf")


def log_choose(n, k) -> np.ndarray:
    n, k = (torch.as_tensor(np.asarray(v, dtype=float)) for v in (n, k))
    return (torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)).numpy()


def log_binomial(n: int, p: float) -> np.ndarray:
    """log P(X = x) for x = 0..n, X ~ Binomial(n, p)."""
    x = torch.arange(n + 1, dtype=torch.float64)
    p = torch.tensor(p, dtype=torch.float64)
    return log_choose(n, x.numpy()) + (torch.special.xlogy(x, p)
                                       + torch.special.xlog1py(n - x, -p)).numpy()


def heaped(counts: np.ndarray, trials: np.ndarray, probs: np.ndarray, tail: float) -> bool:
    """Whether some cell holds more samples than a correct sampler puts in any of them but
    with probability `tail`: cell i's count is Binomial(trials[i], probs[i]), and it fails
    where P(count or more) <= tail / cells (Bonferroni). Beside a lone cell the pool's
    cells expect few samples each, and the pool's total alone cannot see them heaped."""
    share = tail / len(counts)
    return any(count >= heap_bound(int(n), float(p), share)
               for count, n, p in zip(counts, trials, probs) if count > n * p)


@functools.lru_cache(maxsize=4096)  # a law's cells share few (trials, probability) pairs
def heap_bound(n: int, p: float, tail: float) -> int:
    """The least c with P(X >= c) <= tail, X ~ Binomial(n, p) (n + 1 where none is)."""
    above = np.cumsum(np.exp(log_binomial(n, p))[::-1])[::-1]  # P(X >= c), c = 0..n
    return int(np.argmax(above <= tail)) if above[-1] <= tail else n + 1


def power_terms(observed, expected):
    """Each cell's term of the power divergence, 2 / (l (l + 1)) [O ((O / E)^l - 1) -
    l (O - E)], non-negative (the last part sums to 0 over a sample)."""
    return 2 / (LAMBDA * (LAMBDA + 1)) * (
        observed * ((observed / expected) ** LAMBDA - 1) - LAMBDA * (observed - expected))


@functools.lru_cache(maxsize=1024)  # a mutant's run asks for the same threshold each chunk
def binomial_threshold(total: float, expected: float, n: int, p: float, tail: float) -> float:
    """lone_cell_threshold of a cell expecting `expected` of `total` samples beside the
    pool (the rest), its count Binomial(n, p)."""
    x = np.arange(n + 1, dtype=float)
    statistics = power_terms(x, expected) + power_terms(total - x, total - expected)
    return lone_cell_threshold(statistics, log_binomial(n, p), tail)


def divergence(counts: np.ndarray, expected: np.ndarray, pool: np.ndarray) -> float:
    """The power divergence of counts from expected over the cells of positive expectation
    outside the pool, and the pool as one cell: 2 / (l (l + 1)) sum O ((O / E)^l - 1) -
    l (O - E), each cell's term non-negative (the last sums to 0 over a sample), chi-square
    with the cells' df as Pearson's is."""
    kept = ~pool & (expected > 0)
    observed, expecting = counts[kept], expected[kept]
    if pool.any():
        observed = np.append(observed, counts[pool].sum())
        expecting = np.append(expecting, expected[pool].sum())
    return float(power_terms(observed, expecting).sum())


def chi_square(counts, expected_probs, false_failure: float):
    """(statistic, threshold, df) of observed counts against a known distribution.

    Cells with fewer than 5 expected samples are pooled into one (pooled_cells), so the
    chi-square approximation holds; a correct sampler exceeds the threshold with probability
    `false_failure` or less (TAIL_MARGIN).
    """
    counts = np.asarray(counts, dtype=float).ravel()
    expected = np.asarray(expected_probs, dtype=float).ravel() * counts.sum()
    # a sample in a cell of zero probability is an outright failure: looked for before the
    # pooling, which would hide it among the small cells of positive probability
    if np.any((expected == 0) & (counts > 0)):
        return float("inf"), 0.0, len(counts) - 1
    pool = pooled_cells(expected)
    total, lone = counts.sum(), lone_cell(expected, pool)
    if lone is not None:  # its count is Binomial(total, its probability); half the rate
        # each to it and to the pooled cells' counts
        if heaped(counts[pool], np.full(int(pool.sum()), int(total)), expected[pool] / total,
                  false_failure / 2):
            return float("inf"), 0.0, 1
        return (divergence(counts, expected, pool), binomial_threshold(
            total, expected[lone], int(total), expected[lone] / total, false_failure / 2), 1)
    df = int((~pool & (expected > 0)).sum()) + int(pool.any()) - 1
    return divergence(counts, expected, pool), chi2_isf(false_failure / TAIL_MARGIN, df), df


def conditional_chi_square(counts, conditional_probs, false_failure: float):
    """(statistic, threshold, df) of counts[g, ...] against a known law of the rest given
    the group g: each group's expected counts are its own total times its row of
    `conditional_probs` (rows sum to 1), so only the law within groups is tested.

    A request's first token is the target's alone (its round drafts nothing while the
    drafter prefills beside it), so the law tests condition on it: the groups are the first
    token, the cells the drafted positions after it. Cells with fewer than 5 expected samples
    are pooled into one (pooled_cells). df is Pearson's exact mean given the groups' totals
    (the divergence's to first order): a group whose cells are all kept loses one (its
    total is given), but the pool draws from several groups, whose totals fix only part of it.
    """
    counts = np.asarray(counts, dtype=float)
    groups = counts.shape[0]
    counts = counts.reshape(groups, -1)
    law = np.asarray(conditional_probs, dtype=float).reshape(groups, -1)
    totals = counts.sum(1)
    expected = (law * totals[:, None]).ravel()
    counts = counts.ravel()
    if np.any((expected == 0) & (counts > 0)):  # before pooling, as chi_square's
        return float("inf"), 0.0, len(counts) - int((totals > 0).sum())
    pool = pooled_cells(expected)
    lone = lone_cell(expected, pool)
    if lone is not None:  # its count is Binomial(its group's total, its probability there);
        # half the rate each to it and to the pooled cells' counts, each binomial alike
        groups_of = np.arange(counts.size) // law.shape[1]
        if heaped(counts[pool], totals[groups_of[pool]].astype(int), law.ravel()[pool],
                  false_failure / 2):
            return float("inf"), 0.0, 1
        group = lone // law.shape[1]
        return (divergence(counts, expected, pool), binomial_threshold(
            counts.sum(), expected[lone], int(totals[group]), law.ravel()[lone],
            false_failure / 2), 1)
    kept = ~pool & (expected > 0)
    # each kept cell's variance over its expectation is 1 - p; the pool's, the groups' own
    # n q (1 - q) (q: a group's probability in the pool) over its expectation
    df = float((1 - law.ravel()[kept]).sum())
    if pool.any():
        share = (law * pool.reshape(groups, -1)).sum(1)
        df += float((totals * share * (1 - share)).sum() / expected[pool].sum())
    df = max(df, 1.0)
    return divergence(counts, expected, pool), chi2_isf(false_failure / TAIL_MARGIN, df), df


def two_sample_chi_square(first: dict, second: dict, false_failure: float):
    """(statistic, threshold, df) of two samples of outcomes ({outcome: count}) drawn from
    one law: the 2 x C contingency test, outcomes with fewer than 5 expected in either
    sample pooled into one (with the smallest others while it holds fewer)."""
    outcomes = sorted(set(first) | set(second), key=str)
    table = np.array([[first.get(o, 0) for o in outcomes], [second.get(o, 0) for o in outcomes]],
                     dtype=float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    small = pooled_cells(expected.min(0))
    lone = lone_cell(expected.min(0), small)
    if small.any():
        table = np.column_stack([table[:, ~small], table[:, small].sum(1)])
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 0.0, float("inf"), 0
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    statistic = divergence(table.ravel(), expected.ravel(), np.zeros(table.size, bool))
    if lone is not None:  # the lone outcome's count in the first sample, given the margins:
        # hypergeometric (Fisher's exact test, with this statistic)
        (first_total, second_total), column = table.sum(1), table[:, 0].sum()
        x = np.arange(max(0, column - second_total), min(first_total, column) + 1)
        cells = np.stack([x, first_total - x, column - x, second_total - column + x])
        law = log_choose(column, x) + log_choose(table.sum() - column, first_total - x) - \
            log_choose(table.sum(), first_total)
        return statistic, lone_cell_threshold(
            power_terms(cells, expected.ravel()[:, None]).sum(0), law, false_failure), 1
    df = table.shape[1] - 1  # (2 - 1) x (C - 1)
    return statistic, chi2_isf(false_failure / TAIL_MARGIN, df), df


@functools.lru_cache(maxsize=1024)  # a mutant's run asks for the same threshold each chunk
def chi2_isf(tail: float, df: float) -> float:
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

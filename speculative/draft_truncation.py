"""A draft q's truncation (the drafter's `draft_top_k` and `draft_q_mass`): the entries of a
row it keeps, found without sorting the whole vocabulary."""

import torch


def kept_by_mass(values: torch.Tensor, mass: float) -> torch.Tensor:
    """[n] bool: which of [n] values, most likely first, a q truncated to `mass` keeps: each
    entry whose predecessors hold less than mass (the fewest holding it), zeros left out."""
    before = values.cumsum(-1) - values  # the mass of the entries ahead of each
    return (before < mass) & (values > 0)


# A float32's sign, 8 exponent bits and 2 mantissa bits: 1024 buckets, 4 an octave.
BUCKET_SHIFT = 21
NUM_BUCKETS = 1 << (32 - 1 - BUCKET_SHIFT)
MASS_MARGIN = 1e-6  # far above the rounding of a float32 sum near 1


def value_buckets(probs: torch.Tensor) -> torch.Tensor:
    """[V] float32 -> [V] bucket per entry, in the order of the values: non-negative floats
    order like their bit patterns, so their leading bits bucket them without a sort."""
    return (probs.view(torch.int32) >> BUCKET_SHIFT).clamp_min(0)  # -0.0 joins bucket 0


def lowest_bucket_holding(buckets: torch.Tensor, probs: torch.Tensor, mass: float) -> int:
    """The lowest bucket b such that the entries in buckets >= b hold `mass` (plus a margin),
    read off a histogram of the row's mass; 0 when the row cannot hold it."""
    mass_from_top = torch.bincount(buckets, weights=probs, minlength=NUM_BUCKETS).flip(0)
    taken = int(torch.searchsorted(mass_from_top.cumsum(0), mass + MASS_MARGIN))
    return max(NUM_BUCKETS - 1 - taken, 0)


def sorted_candidates(probs: torch.Tensor, buckets: torch.Tensor,
                      lowest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the entries in buckets >= lowest, most likely first."""
    ids = (buckets >= lowest).nonzero().squeeze(-1)
    values, order = torch.sort(probs[ids], descending=True)
    return values, ids[order]


def fewest_holding_mass(probs: torch.Tensor, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [m], ids [m]) of the fewest most likely entries of a [V] row whose total is
    >= mass, most likely first, zeros left out: what sorting the whole row keeps (up to ties),
    found by sorting only the candidates above a histogram's threshold (one pass over V).

    The candidates are the row's top entries, so their sorted prefix and its sums are the full
    sort's; when they hold the mass, no entry after them would be kept. What is cut is at
    most 1 - mass of q, so acceptance loses at most that much per position.
    """
    probs = probs.float().contiguous()
    buckets = value_buckets(probs)
    lowest = lowest_bucket_holding(buckets, probs, mass)
    values, ids = sorted_candidates(probs, buckets, lowest)
    # summed as the sort's cumsum accumulates (float64); short only at a rounding borderline
    if lowest > 0 and float(values.sum(dtype=torch.float64)) < mass + MASS_MARGIN:
        values, ids = sorted_candidates(probs, buckets, 0)  # the whole row
    keep = kept_by_mass(values, mass)
    return values[keep], ids[keep]


def kept_entries(probs: torch.Tensor, top_k: int, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [m], ids [m]) that a truncated draft q keeps of a [V] row, most likely first,
    zeros left out: its top_k largest entries (0: all), renormalised, then of those the fewest
    holding `mass` (1: all). The caller renormalises what is kept."""
    if 0 < top_k < probs.shape[-1]:
        values, ids = torch.topk(probs, top_k)
        values = values / values.sum()
        keep = kept_by_mass(values, mass) if mass < 1 else values > 0
        return values[keep], ids[keep]
    if mass < 1:
        return fewest_holding_mass(probs, mass)
    ids = probs.nonzero().squeeze(-1)
    return probs[ids], ids

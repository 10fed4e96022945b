"""A draft q's truncation (speculative.draft_truncation) at its edges: top-k renormalises
before the mass is taken, and an entry whose predecessors already hold the mass is cut."""

import torch

from speculative.draft_truncation import kept_by_mass, kept_entries


def test_an_entry_after_exactly_the_mass_is_cut():
    values = torch.tensor([0.5, 0.25, 0.25])
    assert kept_by_mass(values, 0.75).tolist() == [True, True, False]


def test_top_k_renormalises_before_the_mass_is_taken():
    """The top 2 of [0.3, 0.3, 0.2, 0.2] are each half of what top-k keeps: a mass of 0.5
    keeps the first alone (of the unrenormalised 0.3, 0.3 it would keep both)."""
    values, ids = kept_entries(torch.tensor([0.3, 0.3, 0.2, 0.2]), top_k=2, mass=0.5)
    assert values.tolist() == [0.5] and len(ids) == 1 and int(ids[0]) in (0, 1)

"""q in its wire form: read by gathering, truncated by mass without sorting the vocabulary."""

import pytest
import torch

import speculative.draft_truncation as truncation
from speculative.draft_truncation import fewest_holding_mass
from speculative.types import DraftDists


def truncate_mass(probs: torch.Tensor, mass: float) -> torch.Tensor:
    """The reference: sort the whole [V] row, keep the fewest most likely entries whose total
    is >= mass (what the drafter shipped before it stopped sorting), renormalise."""
    values, order = torch.sort(probs, dim=-1, descending=True)
    before = values.cumsum(-1) - values  # the mass of the entries ahead of each
    keep = (before < mass).scatter(-1, order, before < mass)
    truncated = probs * keep
    return truncated / truncated.sum(-1, keepdim=True)


def sparse_q() -> DraftDists:
    """Three positions over a vocabulary of 10, float16 weights not summing to 1, the first
    row padded with a zero weight as the drafter pads its narrower rows."""
    weights = torch.tensor([[3.0, 1.0, 0.0], [1.0, 1.0, 2.0], [5.0, 0.5, 0.25]],
                           dtype=torch.float16)
    ids = torch.tensor([[4, 7, 0], [0, 9, 2], [1, 2, 3]])
    return DraftDists(weights, ids, 10)


def test_at_is_the_dense_law_gathered_for_sparse_and_dense_forms():
    q = sparse_q()
    dense_weights = torch.zeros(3, 10, dtype=torch.float16).scatter_add_(1, q.ids, q.weights)
    dense_form = DraftDists.from_dense(dense_weights)
    assert q.shape == dense_form.shape == (3, 10)
    torch.testing.assert_close(q.dense(), dense_form.dense())
    torch.testing.assert_close(q.dense().sum(-1), torch.ones(3))
    for tokens in [(4, 9, 1), (7, 2, 3), (0, 0, 2)]:
        positions = torch.arange(3), list(tokens)
        assert q.at(tokens) == q.dense()[positions].tolist()  # bit for bit
        assert dense_form.at(tokens) == dense_form.dense()[positions].tolist()
        torch.testing.assert_close(torch.tensor(q.at(tokens)), torch.tensor(dense_form.at(tokens)))
    assert q.at((4, 9, 1)) == [0.75, 0.25, pytest.approx(5.0 / 5.75)]


def test_a_token_the_sparse_row_does_not_list_has_q_zero():
    q = sparse_q()
    assert q.at((5, 3, 9)) == [0.0, 0.0, 0.0]
    assert q.at((0, 1, 4))[0] == 0.0  # id 0 in row 0 is only padding (weight 0)


def test_reading_q_refuses_what_no_sampler_drew_from():
    weights = torch.tensor([[1.0, -1.0], [1.0, 1.0]])
    bad = DraftDists(weights, torch.tensor([[1, 2], [3, 4]]), 8)
    for read in (lambda: bad.at((1, 3)), bad.dense):
        with pytest.raises(ValueError, match="non-negative"):
            read()
    with pytest.raises(ValueError, match="token ids"):
        sparse_q().at((1, 2))
    with pytest.raises(ValueError, match="token ids"):
        sparse_q().at((1, 2, 10))
    with pytest.raises(ValueError, match="entries per position"):
        DraftDists(torch.ones(2, 5), None, 8)
    with pytest.raises(ValueError, match="shaped like"):
        DraftDists(torch.ones(2, 5), torch.zeros(2, 4, dtype=torch.long), 8)


def test_stack_pads_sparse_rows_and_compact_picks_the_smaller_form():
    rows = [(torch.tensor([0.5, 0.25, 0.125, 0.125]), torch.tensor([3, 1, 5, 0])),
            (torch.tensor([1.0]), torch.tensor([6]))]
    q = DraftDists.stack(rows, 64)
    assert q.weights.tolist() == [[0.5, 0.25, 0.125, 0.125], [1.0, 0, 0, 0]]
    assert q.ids.tolist() == [[3, 1, 5, 0], [6, 0, 0, 0]]
    assert q.compact() is q  # 4 entries of 4 + 4 bytes beat 64 of 4
    dense = DraftDists.stack(rows, 7).compact()  # 7 entries of 4 bytes beat 4 of 8
    assert dense.ids is None and dense.weights.shape == (2, 7)
    assert dense.weights[0].tolist() == [0.125, 0.25, 0, 0.5, 0, 0.125, 0]
    assert dense.weights[1].tolist() == [0, 0, 0, 0, 0, 0, 1.0]
    half = DraftDists.stack([(torch.ones(3, dtype=torch.float16), None)] * 2, 3)
    assert half.ids is None and half.compact() is half


def random_rows(count: int, vocab_size: int, sharpness: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(count, vocab_size, generator=generator), -1)


@pytest.mark.parametrize("mass", [0.5, 0.9, 0.99, 0.999])
@pytest.mark.parametrize("vocab_size, sharpness", [(4096, 1.0), (4096, 4.0), (50_000, 8.0)])
def test_mass_selection_keeps_exactly_what_a_sort_keeps(mass, vocab_size, sharpness):
    """Flat rows need thousands of entries (far past any first guess), sharp ones a few."""
    for seed, row in enumerate(random_rows(8, vocab_size, sharpness, seed=int(mass * 1000))):
        values, ids = fewest_holding_mass(row, mass)
        reference = truncate_mass(row, mass)
        assert set(ids.tolist()) == set(reference.nonzero().squeeze(-1).tolist()), seed
        assert values.equal(row[ids]) and bool((values[:-1] >= values[1:]).all())
        torch.testing.assert_close(values / values.sum(), reference[ids])


def test_mass_selection_sorts_only_candidates_and_falls_back_when_they_are_short(monkeypatch):
    row = random_rows(1, 4096, 1.0, seed=3)[0]
    sorted_lengths = []
    real_sort = torch.sort

    def counting_sort(values, *args, **kwargs):
        sorted_lengths.append(values.shape[-1])
        return real_sort(values, *args, **kwargs)

    monkeypatch.setattr(truncation.torch, "sort", counting_sort)
    kept = fewest_holding_mass(row, 0.5)[1]
    assert len(sorted_lengths) == 1 and len(kept) <= sorted_lengths[0] < 4096 / 2
    # a threshold whose candidates turn out short of the mass: the whole row is sorted
    top_bucket = int(truncation.value_buckets(row).max())
    monkeypatch.setattr(truncation, "lowest_bucket_holding", lambda *args: top_bucket)
    assert fewest_holding_mass(row, 0.5)[1].equal(kept)
    assert len(sorted_lengths) == 3 and sorted_lengths[2] == 4096


def test_mass_selection_of_a_row_with_zeros_and_a_mass_it_cannot_reach():
    row = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25])
    assert set(fewest_holding_mass(row, 0.6)[1].tolist()) in ({1, 3}, {1, 4})
    assert set(fewest_holding_mass(row * 0.99, 0.9999)[1].tolist()) == {1, 3, 4}


def test_an_id_listed_twice_holds_the_sum_of_its_weights_for_router_and_verifier():
    """The router's q(x) (`at`) and the verifier's residual q (`dense`) must be one law."""
    q = DraftDists(torch.tensor([[0.25, 0.25, 0.5]]), torch.tensor([[1, 1, 2]]), 4)
    assert q.at([1]) == [0.5]
    assert torch.equal(q.dense(), torch.tensor([[0.0, 0.5, 0.5, 0.0]]))


def test_a_row_keeps_every_entry_bit_for_bit_in_its_sparse_form():
    probs = torch.zeros(16)
    probs[[2, 5, 11]] = torch.tensor([1e-12, 0.3333333, 0.6666667 - 1e-12])
    row = DraftDists.of_row(probs)
    assert row.ids is not None  # the sparse form: 3 of 16 entries
    assert row.weights.dtype == torch.float32 and torch.equal(row.weights[0], probs[[2, 5, 11]])
    assert row.at([2])[0] > 0


@pytest.mark.parametrize("sparse", [False, True])
def test_rows_are_the_positions_asked_for(sparse):
    q = sparse_q() if sparse else DraftDists.from_dense(torch.softmax(
        torch.randn(3, 10, generator=torch.Generator().manual_seed(0)), -1))
    rest = q.rows(1)
    assert len(rest) == 2 and torch.equal(rest.dense(), q.dense()[1:])
    assert torch.equal(q.rows(0, 2).dense(), q.dense()[:2])

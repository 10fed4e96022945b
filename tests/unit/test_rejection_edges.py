"""A coin of exactly 0 never accepts a token the target gives probability 0.

torch.rand's float32 uniforms are 0 once in 2**24 draws: a test u * q <= p (not <) then
accepts a drafted token of p = 0 (one that top-k, top-p, a grammar or min_tokens masked),
an output the target alone never gives. Such a mutant passed every unit and statistical
test (one coin in 16 million); here the coin is 0 every time, by hand.
"""

import torch

from speculative.rejection import accept_drawn, accept_first_predrafted, rejection_sample
from speculative.types import DraftDists


def zero_coins(monkeypatch) -> None:
    """Every torch.rand uniform 0 (the coins, and the uniform of any residual draw)."""
    def rand(*size, **kw):
        shape = size[0] if len(size) == 1 and isinstance(size[0], tuple) else size
        return torch.zeros(shape, dtype=kw.get("dtype") or torch.float32)
    monkeypatch.setattr(torch, "rand", rand)


def test_accept_drawn_rejects_a_token_of_target_probability_zero_at_a_zero_coin(monkeypatch):
    zero_coins(monkeypatch)
    out = accept_drawn((5, 2), [0.5, 0.5], [0.0, 0.9], recovered_token_ids=(3, 1),
                       bonus_token_id=9, generator=torch.Generator())
    assert (out.output_token_ids, out.num_accepted) == ((3,), 0)
    # a positive p still accepts at that coin (0 < p)
    out = accept_drawn((5,), [0.5], [1e-9], (3,), 9, torch.Generator())
    assert (out.output_token_ids, out.num_accepted) == ((5, 9), 1)


def test_rejection_sample_rejects_a_token_of_target_probability_zero_at_a_zero_coin(
        monkeypatch):
    zero_coins(monkeypatch)
    q = torch.tensor([[0.5, 0.5, 0.0]])
    p = torch.tensor([[0.0, 0.4, 0.6], [1.0, 0.0, 0.0]])
    out = rejection_sample([0], q, p, torch.Generator())
    # rejected; the residual norm(max(0, p - q)) = [0, 0, 1] recovers token 2
    assert (out.output_token_ids, out.num_accepted) == ((2,), 0)


def test_a_predrafted_token_of_target_probability_zero_is_rejected_at_a_zero_coin(
        monkeypatch):
    zero_coins(monkeypatch)
    q = DraftDists.from_dense(torch.tensor([[0.5, 0.5, 0.0]]))
    p = DraftDists.from_dense(torch.tensor([[0.0, 0.4, 0.6]]))
    assert accept_first_predrafted(0, q, p, torch.Generator()) == (2, False)

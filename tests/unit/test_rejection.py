"""Exact hand-built cases and property tests of the rejection sampler's invariants."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculative.rejection import (
    accept_drawn,
    accept_first_predrafted,
    accept_greedy,
    rejection_sample,
    residual,
    residual_rows,
)
from speculative.tree import ROOT, DraftTree, accept_tree, accept_tree_drawn
from speculative.types import DraftDists


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def one_hot(index, size=4):
    return torch.nn.functional.one_hot(torch.tensor(index), size).float()


def test_equal_distributions_accept_everything_and_add_a_bonus():
    dist = torch.tensor([0.1, 0.2, 0.3, 0.4])
    for seed in range(50):
        out = rejection_sample([3, 1, 2], dist.repeat(3, 1), dist.repeat(4, 1), gen(seed))
        assert out.num_accepted == 3
        assert out.output_token_ids[:3] == (3, 1, 2) and len(out.output_token_ids) == 4


def test_disjoint_distributions_always_reject_and_recover_from_the_target():
    draft = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    target = torch.tensor([[0.0, 0.0, 0.25, 0.75], [0.25] * 4])
    seen = set()
    for seed in range(100):
        out = rejection_sample([1], draft, target, gen(seed))
        assert out.num_accepted == 0 and len(out.output_token_ids) == 1
        seen.add(out.output_token_ids[0])
    assert seen == {2, 3}


def test_one_hot_target_accepts_only_its_token():
    draft = torch.tensor([[0.25] * 4, [0.25] * 4])
    target = torch.stack([one_hot(2), one_hot(0), one_hot(1)])
    assert rejection_sample([2, 0], draft, target, gen()).output_token_ids == (2, 0, 1)
    out = rejection_sample([2, 3], draft, target, gen())
    assert out.output_token_ids == (2, 0) and out.num_accepted == 1


def test_one_hot_draft_is_accepted_with_the_target_probability():
    # q = delta(1): accept iff u < p(1) = 0.3; the recovered token is never 1
    target = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.25] * 4])
    accepted = 0
    for seed in range(2000):
        out = rejection_sample([1], one_hot(1)[None], target, gen(seed))
        accepted += out.num_accepted
        assert out.num_accepted == 1 or out.output_token_ids[0] in (0, 2)
    assert 0.25 < accepted / 2000 < 0.35  # binomial sd 0.01: 5 sd either side


def test_residual_guard_returns_the_target_when_p_equals_q():
    p = torch.tensor([0.5, 0.5])
    assert torch.equal(residual(p, p), p)
    torch.testing.assert_close(residual(torch.tensor([0.6, 0.4]), p), torch.tensor([1.0, 0.0]))


def test_greedy_accepts_the_matching_prefix_then_the_target_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]).output_token_ids == (5, 6, 7, 8)
    out = accept_greedy([5, 9, 7], [5, 6, 7, 8])
    assert out.output_token_ids == (5, 6) and out.num_accepted == 1
    assert accept_greedy([], [4]).output_token_ids == (4,)


def test_accept_drawn_takes_the_draw_of_the_first_rejected_position():
    # p(x) >= q(x) at position 0: always accepted; p(x) = 0 at position 1: always rejected
    out = accept_drawn([4, 5, 6], [0.5, 0.5, 0.5], [0.9, 0.0, 0.9], [1, 2, 3], 9, gen())
    assert out.output_token_ids == (4, 2) and out.num_accepted == 1
    out = accept_drawn([4, 5], [0.5, 0.5], [0.7, 0.6], [1, 2], 9, gen())
    assert out.output_token_ids == (4, 5, 9) and out.num_accepted == 2
    assert accept_drawn([], [], [], [], 3, gen()).output_token_ids == (3,)


@st.composite
def rounds(draw):
    vocab = draw(st.integers(2, 6))
    k = draw(st.integers(1, 5))
    weights = st.lists(st.floats(0, 1), min_size=vocab, max_size=vocab).filter(
        lambda w: sum(w) > 0.1
    )
    draft = torch.tensor([draw(weights) for _ in range(k)])
    target = torch.tensor([draw(weights) for _ in range(k + 1)])
    draft, target = draft / draft.sum(-1, keepdim=True), target / target.sum(-1, keepdim=True)
    tokens = [int(torch.multinomial(row, 1, generator=gen(i))) for i, row in enumerate(draft)]
    return tokens, draft, target, draw(st.integers(0, 2**32))


@settings(max_examples=300, deadline=None)
@given(rounds())
def test_invariants(case):
    tokens, draft, target, seed = case
    out = rejection_sample(tokens, draft, target, gen(seed))
    n = out.num_accepted
    assert 0 <= n <= len(tokens)
    assert len(out.output_token_ids) == n + 1  # between 1 and K + 1 tokens
    assert list(out.output_token_ids[:n]) == tokens[:n]  # accepted = a prefix of the draft
    last = out.output_token_ids[-1]
    if n < len(tokens):  # recovered: from the residual where it has mass, else from p
        res = (target[n] - draft[n]).clamp_min(0)
        assert res[last] > 0 or (res.sum() <= 1e-12 and target[n, last] > 0)
    else:  # bonus: from p(K+1)
        assert target[-1, last] > 0
    for i in range(n):  # an accepted token is possible under the target
        assert target[i, tokens[i]] > 0


def test_residual_rows_are_each_rows_residual():
    """The verifier's batched residuals, a row with no residual mass (p == q) included."""
    g = torch.Generator().manual_seed(3)
    target = torch.rand(4, 9, generator=g).softmax(-1)
    draft = torch.rand(4, 9, generator=g).softmax(-1)
    draft[2] = target[2]
    rows = residual_rows(target, draft)
    for i in range(4):
        assert torch.allclose(rows[i], residual(target[i], draft[i]))
    assert torch.equal(rows[2], target[2])


def test_a_chain_is_refused_scores_without_one_entry_per_drafted_position():
    """accept read a verifier's chain scores as they came: more rows than drafted tokens
    were cut to them (another block's rows taken for this one's), fewer decided the round
    until a coin reached a missing one, a missing bonus draw was committed as None, and a
    greedy answer's count was an assert (gone under python -O)."""
    import pytest

    from speculative.accept import accept
    from speculative.types import DraftBlock, DraftDists, TargetScores

    block = DraftBlock((1, 2), DraftDists.from_dense(torch.full((2, 4), 0.25)))
    refused = [
        (False, TargetScores(draft_target_probs=(0.25,) * 3, recovered_token_ids=(3,) * 3,
                             bonus_token_id=0), "3 target probabilities"),
        (False, TargetScores(draft_target_probs=(0.01,), recovered_token_ids=(3,),
                             bonus_token_id=0), "1 target probabilities"),
        (False, TargetScores(draft_target_probs=(1.0, 1.0), recovered_token_ids=(3,),
                             bonus_token_id=0), "1 residual draws"),
        (False, TargetScores(draft_target_probs=(1.0, 1.0), recovered_token_ids=(3, 3)),
         "bonus"),
        (True, TargetScores(target_token_ids=(1, 2, 3, 0)), "4 argmaxes"),
        (True, TargetScores(target_token_ids=(1,)), "1 argmaxes"),
    ]
    for greedy, scores, message in refused:
        with pytest.raises(ValueError, match=message):
            accept(block, scores, greedy, gen())
    exact = TargetScores(draft_target_probs=(1.0, 1.0), recovered_token_ids=(3, 3),
                         bonus_token_id=0)
    assert accept(block, exact, False, gen())[0].output_token_ids == (1, 2, 0)
    assert accept(DraftBlock((), None), TargetScores(target_token_ids=(5,)), True,
                  gen())[0].output_token_ids == (5,)


def test_the_predrafted_token_meets_algorithm_1_draw_for_draw():
    """accept_first_predrafted (the loop's pipelined bonus position: y1 drawn from q', tested
    against p(K+1)) takes rejection_sample's coin and residual draw of a one-token round: y1
    kept iff Algorithm 1 accepts it, else the same recovered token, from norm(max(0, p - q'))
    (a rule tested against p alone, or with p and q' swapped, passed every unit test)."""
    from speculative.rejection import accept_first_predrafted
    from speculative.types import DraftDists

    g = torch.Generator().manual_seed(11)
    outcomes = set()
    for seed in range(200):
        q = torch.rand(6, generator=g).softmax(-1) if seed % 2 else \
            torch.tensor([0.05, 0.4, 0.05, 0.3, 0.1, 0.1])
        p = torch.tensor([0.3, 0.1, 0.25, 0.05, 0.2, 0.1])
        y1 = int(torch.multinomial(q, 1, generator=g))
        token, taken = accept_first_predrafted(y1, DraftDists.from_dense(q[None]),
                                               DraftDists.from_dense(p[None]), gen(seed))
        reference = rejection_sample([y1], q[None], torch.stack([p, p]), gen(seed))
        assert (token, taken) == (reference.output_token_ids[0], reference.num_accepted == 1)
        outcomes.add(taken)
    assert outcomes == {True, False}  # both branches compared


def test_a_nan_target_law_stays_nan_through_its_residual():
    """A target row whose law is NaN (NaN or inf logits) has no residual: it keeps p, which
    draws the index past the vocabulary that the verifier marks LAWLESS, never a token of the
    draft's q (falling back to q there passed every unit test)."""
    from speculative.sampling import sample_rows

    q = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    p = torch.tensor([[float("nan")] * 3, [0.6, 0.3, 0.1]])
    assert residual(p[0], q[0]).isnan().all()
    rows = residual_rows(p, q)
    assert rows[0].isnan().all()
    torch.testing.assert_close(rows[1], torch.tensor([1.0, 0.0, 0.0]))
    assert sample_rows(rows, gen()).tolist() == [3, 0]


def test_a_sampled_tree_without_q_is_verified_by_matching_the_targets_draws():
    """A model-free drafter's tree (no q) under sampling: the verifier's draws at each row
    are followed down the tree, as greedy's argmaxes are (walking it with the acceptance
    probabilities of a tree with q, which such scores do not hold, passed every unit
    test)."""
    from speculative.accept import accept
    from speculative.tree import ROOT
    from speculative.types import DraftBlock, TargetScores

    block = DraftBlock((3, 5, 1, 2, 4), None, parents=(ROOT, ROOT, 0, 1, 1))
    for draws, output in [((5, 9, 4, 9, 9, 0), (5, 4, 0)), ((3, 1, 9, 8, 9, 9), (3, 1, 8)),
                          ((7, 9, 9, 9, 9, 9), (7,))]:
        scores = TargetScores(target_token_ids=draws, tree_nodes=5)
        outcome, _ = accept(block, scores, False, gen())
        assert outcome.output_token_ids == output and outcome.num_accepted == len(output) - 1


def test_a_coin_of_zero_never_accepts_a_token_the_target_rules_out(monkeypatch):
    """u < min(1, p(x) / q(x)) is strict: at p(x) = 0 a coin of exactly 0 (torch.rand gives
    one in 2**24) must reject x, in every form of the test (`<=` there, or dropping the
    q(x) > 0 guard for `coin * q <= p`, emitted a token the target gives no mass and passed
    every other test). Every router coin is 0 here; p(x) > 0 is still accepted."""
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *size, **kwargs: torch.tensor(0.0)
                        if size in ((), ((),)) else real_rand(*size, **kwargs))
    q = torch.tensor([0.5, 0.5, 0.0, 0.0])
    p = torch.tensor([0.0, 0.0, 0.25, 0.75])
    out = rejection_sample([1], q[None], torch.stack([p, p]), gen())
    assert out.num_accepted == 0 and out.output_token_ids[0] in (2, 3)
    assert accept_drawn([1], [0.5], [0.0], [2], 9, gen()).output_token_ids == (2,)
    assert accept_drawn([1], [0.5], [1e-6], [2], 9, gen()).output_token_ids == (1, 9)
    token, taken = accept_first_predrafted(1, DraftDists.from_dense(q[None]),
                                           DraftDists.from_dense(p[None]), gen())
    assert not taken and token in (2, 3)
    tree = DraftTree((1, 0), (ROOT, ROOT))
    walked = accept_tree(tree, torch.stack([q, q, q]), torch.stack([p, p, p]), gen())
    assert walked.round.num_accepted == 0 and walked.round.output_token_ids[0] in (2, 3)
    drawn = accept_tree_drawn(tree, [0.0, 0.0], [3, 8, 8], gen())
    assert drawn.round.output_token_ids == (3,)

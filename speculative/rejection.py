"""Rejection sampling of a drafted block (Leviathan et al. 2023, Algorithm 1).

Glossary (as in vLLM): output tokens = accepted tokens + one recovered token (drawn from the
residual at the first rejection) or one bonus token (drawn from p(K+1) when all K pass).
Every round therefore commits between 1 and K + 1 tokens.

Variable names follow the paper with the project's prefixes: draft_probs is q, target_probs
is p. Both are the distributions AFTER temperature / top-k / top-p, i.e. exactly the ones the
tokens were (or would be) drawn from; that is what makes the output distribution equal p's.
"""

from dataclasses import dataclass, field

import torch

from speculative.sampling import sample


@dataclass(frozen=True)
class RoundOutcome:
    output_token_ids: tuple[int, ...]  # accepted tokens, then the recovered or bonus token
    num_accepted: int  # excludes the recovered / bonus token
    # a pre-drafted y1 tested at the bonus position (loop.continue_with_predraft): 1 if
    # tested, and whether it was accepted (the output's last token is then y1)
    predraft_tested: int = 0
    predraft_accepted: int = 0
    # bookkeeping, not the outcome (a chain accepted as a tree equals Algorithm 1's):
    tree: int = field(default=0, compare=False)  # 1 for a draft tree's round
    off_main_chain: int = field(default=0, compare=False)  # its path left the main chain


def accept_greedy(draft_token_ids, target_token_ids) -> RoundOutcome:
    """Greedy: p and q are one-hot, so accept while x_i == argmax p_i, then emit argmax p_j.

    draft_token_ids: [K]; target_token_ids: [K + 1] (argmax of p1..p(K+1)).
    """
    assert len(target_token_ids) == len(draft_token_ids) + 1
    num_accepted = 0
    for drafted, target in zip(draft_token_ids, target_token_ids):
        if drafted != target:
            break
        num_accepted += 1
    output = tuple(draft_token_ids[:num_accepted]) + (target_token_ids[num_accepted],)
    return RoundOutcome(output, num_accepted)


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over [V], or p itself when the residual has no mass.

    In exact arithmetic a rejection implies p != q and so a positive residual; the guard only
    catches rounding, where p is the right answer (p == q up to rounding).
    """
    diff = (target_probs - draft_probs).clamp_min(0)
    total = diff.sum()
    if not total > 1e-12:
        return target_probs
    return diff / total


def residual_rows(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """`residual` of every row at once: [K, V] p and q -> [K, V], on their device (one new
    tensor besides the result, worked on in place: 341 -> 257 us for 16 x 4 rows of 4,096)."""
    diff = torch.sub(target_probs, draft_probs).clamp_min_(0)
    total = diff.sum(-1, keepdim=True)
    return torch.where(total > 1e-12, diff.div_(total.clamp_min(1e-12)), target_probs)


def rejection_sample(
    draft_token_ids,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> RoundOutcome:
    """Accept x_i iff u_i < min(1, p_i(x_i) / q_i(x_i)); residual at the first rejection.

    draft_token_ids: [K]; draft_probs: [K, V]; target_probs: [K + 1, V]. The reference form,
    with p in hand; the loop uses accept_drawn, which the statistical tests hold to this law.
    """
    num_drafted = len(draft_token_ids)
    assert draft_probs.shape[0] == num_drafted and target_probs.shape[0] == num_drafted + 1
    output: list[int] = []
    for i, token in enumerate(draft_token_ids):
        draft_p = float(draft_probs[i, token])
        target_p = float(target_probs[i, token])
        coin = float(torch.rand((), generator=generator))
        if draft_p > 0 and coin * draft_p < target_p:  # u < p/q without dividing
            output.append(token)
            continue
        recovered = sample(residual(target_probs[i], draft_probs[i]), generator)
        return RoundOutcome(tuple(output) + (recovered,), i)
    bonus = sample(target_probs[num_drafted], generator)
    return RoundOutcome(tuple(output) + (bonus,), num_drafted)


def accept_drawn(
    draft_token_ids,
    draft_probs_at_draft,
    target_probs_at_draft,
    recovered_token_ids,
    bonus_token_id: int,
    generator: torch.Generator,
) -> RoundOutcome:
    """The same test as rejection_sample, given what the verifier drew in advance.

    q_i(x_i) and p_i(x_i) decide acceptance with the router's coins; at the first rejection j
    the output takes recovered_token_ids[j], a draw from norm(max(0, p_j - q_j)) made
    independently of the coins; if all K pass, bonus_token_id, a draw from p(K+1). Since the
    draws are independent of the coins, the output has the law of Algorithm 1.
    """
    output: list[int] = []
    for i, token in enumerate(draft_token_ids):
        draft_p, target_p = float(draft_probs_at_draft[i]), float(target_probs_at_draft[i])
        coin = float(torch.rand((), generator=generator))
        if draft_p > 0 and coin * draft_p < target_p:
            output.append(token)
            continue
        return RoundOutcome(tuple(output) + (recovered_token_ids[i],), i)
    return RoundOutcome(tuple(output) + (bonus_token_id,), len(draft_token_ids))


def accept_first_predrafted(token_id: int, draft_row, target_row, generator: torch.Generator
                            ) -> tuple[int, bool]:
    """The bonus position of a fully accepted round, settled with a pre-drafted token: the
    same test as any drafted position (Algorithm 1 on one token). (the token, whether it is
    the drafted one).

    token_id: y1, drawn by the drafter from draft_row (q'_1, a one-row DraftDists) beside the
    verify; target_row: p(K+1), the verifier's one-row DraftDists. y1 is accepted iff
    u < min(1, p(y1) / q'(y1)); otherwise the output is drawn from norm(max(0, p - q')). Either
    way the token has p(K+1)'s law, and when it is y1 the rest of the pre-draft continues it.
    """
    draft_p = draft_row.at([token_id])[0]
    target_p = target_row.at([token_id])[0]
    coin = float(torch.rand((), generator=generator))
    if draft_p > 0 and coin * draft_p < target_p:
        return token_id, True
    return sample(residual(target_row.dense()[0], draft_row.dense()[0]), generator), False

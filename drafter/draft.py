"""A draft in progress: one call's block while the model drafter drafts it (drafter.model),
and the processing of each step's logits (grammar, then shaping) its rows share."""

from dataclasses import dataclass, field

import torch

from engine.kv import Sequence
from speculative.token_masks import TokenMasks, masked
from speculative.shaping import Shaping, committed_history, shape_batch
from speculative.types import ProposeCall


@dataclass
class Draft:
    """One call's block while it is being drafted."""

    call: ProposeCall
    sequence: Sequence
    assumed: list[int]
    num_tokens: int
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    q_rows: list[tuple] = field(default_factory=list)  # shipped_q of each drafted token
    matcher: TokenMasks | None = None  # the request's grammar, at the block's next position
    confidence: float = 1.0  # the drafted tokens' probabilities multiplied (draft_confidence)
    threshold: float = 0.0  # the block ends once `confidence` falls below it
    reports: bool = False  # the block reports its confidence after each token
    confidences: list[float] = field(default_factory=list)
    width: int = 1  # > 1: a tree, up to that many children at each node of the main chain
    nodes: int = 0  # the tree's node budget (0: width at every node)
    # per level of the main chain: its token's probability under the draft's law, and the
    # top `width` ids a greedy draft takes its siblings from
    levels: list[tuple] = field(default_factory=list)
    siblings: list[list[int]] = field(default_factory=list)  # the others, per depth

    def tree(self) -> tuple[tuple[int, ...], tuple[int, ...] | None, list[tuple]]:
        """(tokens, parents, q rows) of the block: the main chain (as a chain's), then each
        depth's other children in the order drawn, each with its parent's law; a block
        without siblings is a chain (parents None)."""
        chain = len(self.token_ids)
        if not any(self.siblings[:chain]):
            return tuple(self.token_ids), None, self.q_rows
        tokens, parents = list(self.token_ids), list(range(-1, chain - 1))
        q_rows = list(self.q_rows)
        for depth, others in enumerate(self.siblings[:chain]):
            tokens += others
            parents += [depth - 1] * len(others)
            q_rows += [self.q_rows[depth]] * len(others) if self.q_rows else []
        return tuple(tokens), tuple(parents), q_rows

    def took(self, token: int) -> None:
        self.token_ids.append(token)
        if self.matcher is not None:
            self.matcher.advance([token])

    def shaping(self, row: int) -> Shaping | None:
        """Row `row` of a step's logits as the request's logit_bias, min_tokens and
        penalties shape it (speculative.shaping.shape_batch), counting the output so far:
        committed, assumed and drafted (as the verifier will); None when they are unset."""
        sampling = self.call.sampling
        if not sampling.shapes_logits:
            return None
        return Shaping(row, 1, sampling, **committed_history(
            sampling, self.call.prompt_len, self.sequence, self.assumed + self.token_ids))


def processed(drafts: list[Draft], lines: torch.Tensor) -> torch.Tensor:
    """[R, V] logits of the drafts' next positions (row i: drafts[i]'s), each masked by its
    request's grammar, then all shaped in one shape_batch; `lines` itself when none is."""
    masks = [(row, draft.matcher.next_mask(lines.shape[-1], lines.device))
             for row, draft in enumerate(drafts) if draft.matcher is not None]
    if masks:
        lines = lines.clone()
        for row, allowed in masks:
            lines[row] = masked(lines[row], allowed)
    return shape_batch(lines, [shaping for shaping in (
        draft.shaping(row) for row, draft in enumerate(drafts)) if shaping is not None])

"""The target engine: score K drafted tokens plus the position after them in ONE forward."""

import torch

from engine.kv import SessionStore
from speculative.rejection import residual
from speculative.sampling import draft_law, logits_to_probs, sample
from speculative.types import ScoreCall, TargetScores, check_call, timed


class ModelVerifier:
    """Holds the target model and each request's KV cache.

    A call first rolls the request's cache back to the committed prefix (the rejected suffix
    of the previous round is cropped away), or rebuilds it when the call carries the whole
    prefix, then feeds the newly committed tokens and x1..xK in a single forward.
    """

    def __init__(self, model, *, max_cached_requests: int = 256) -> None:
        self.model = model.eval()
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.sessions = SessionStore(max_cached_requests)

    async def score(self, call: ScoreCall) -> TargetScores:
        return timed(self.score_now, call)

    async def release(self, request_id: str) -> None:
        self.sessions.release(request_id)

    def score_now(self, call: ScoreCall) -> TargetScores:
        vocab_size = self.model.config.vocab_size
        check_call(call.sync.new_token_ids + call.draft_token_ids, vocab_size,
                   len(call.draft_token_ids))
        drafted = list(call.draft_token_ids)
        draft_probs = None
        if not call.sampling.greedy and drafted:
            shape = None if call.draft_probs is None else tuple(call.draft_probs.shape)
            if shape != (len(drafted), vocab_size):
                raise ValueError(f"sampling needs draft_probs of shape {(len(drafted), vocab_size)}"
                                 f", got {shape}")
            draft_probs = draft_law(call.draft_probs)  # checked before the cache is touched
        length = call.sync.committed_len + len(drafted)
        if self.max_positions is not None and length > self.max_positions:
            raise ValueError(f"{length} tokens exceed the target's context of "
                             f"{self.max_positions} (max_position_embeddings)")
        sequence = self.sessions.sync(call.request_id, call.sync)
        logits = sequence.feed(self.model, drafted, num_logits=len(drafted) + 1)  # [K+1, V]
        if call.sampling.greedy:
            return TargetScores(target_token_ids=tuple(logits.argmax(-1).tolist()))
        return draw_recovered_and_bonus(logits_to_probs(logits, call.sampling), drafted,
                                        draft_probs, call.seed)


def draw_recovered_and_bonus(target_probs, drafted: list[int], draft_probs, seed: int) -> TargetScores:
    """p_i(x_i), a residual draw per position and a bonus draw: all the router needs.

    target_probs: [K + 1, V]; draft_probs: [K, V]. Every residual is drawn, used or not, so
    the draws do not depend on where the router's coins reject.
    """
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(len(drafted))
    at_draft = target_probs[positions, torch.tensor(drafted, dtype=torch.long)].tolist()
    recovered = [sample(residual(target_probs[i], draft_probs[i]), generator)
                 for i in range(len(drafted))]
    bonus = sample(target_probs[len(drafted)], generator)
    return TargetScores(draft_target_probs=tuple(at_draft), recovered_token_ids=tuple(recovered),
                        bonus_token_id=bonus)

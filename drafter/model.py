"""A draft engine around any Hugging Face causal LM, with per-request KV caches."""

import torch

from engine.kv import SessionStore
from speculative.sampling import (
    fit_vocab,
    logits_to_probs,
    sample,
    truncate_mass,
    truncate_top_k,
)
from speculative.types import DraftBlock, ProposeCall, check_call, timed


class ModelDrafter:
    """Proposes K tokens autoregressively with the draft model.

    `vocab_size` is the vocabulary the pools agree on (the target's embedding rows; default:
    the draft's own). Each q may be made smaller for the wire before it is sampled from:
    `draft_top_k` > 0 keeps its top entries, `draft_q_mass` < 1 the fewest top entries that
    hold that mass, and `draft_q_dtype` float16 rounds it to half precision. The output stays
    exact because the token is drawn from the very q that is shipped. Past the draft's own
    context length it drafts nothing: those rounds are the target's alone.
    """

    def __init__(self, model, *, vocab_size: int | None = None, max_cached_requests: int = 256,
                 draft_top_k: int = 0, draft_q_mass: float = 1.0,
                 draft_q_dtype: str = "float32") -> None:
        self.model = model.eval()
        self.vocab_size = vocab_size or model.config.vocab_size
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.draft_top_k, self.draft_q_mass = draft_top_k, draft_q_mass
        self.draft_q_dtype = {"float32": torch.float32, "float16": torch.float16}[draft_q_dtype]
        self.sessions = SessionStore(max_cached_requests)

    async def propose(self, call: ProposeCall) -> DraftBlock:
        return timed(self.propose_now, call)

    async def release(self, request_id: str) -> None:
        self.sessions.release(request_id)

    def propose_now(self, call: ProposeCall) -> DraftBlock:
        assumed = list(call.assumed_token_ids)
        check_call(call.sync.new_token_ids + call.assumed_token_ids, self.vocab_size,
                   call.num_speculative_tokens)
        sequence = self.sessions.sync(call.request_id, call.sync)
        num_tokens = call.num_speculative_tokens
        if self.max_positions is not None:  # the last drafted token is never fed
            room = self.max_positions + 1 - len(sequence.committed) - len(assumed)
            num_tokens = max(0, min(num_tokens, room))
        if num_tokens == 0:
            return DraftBlock((), None)
        generator = torch.Generator().manual_seed(call.seed)
        greedy = call.sampling.greedy
        # Feeding the committed tail also covers the "all K accepted" case: the drafter never
        # fed its own last token x_K, so it is fed now together with the bonus token (or, for
        # a pre-draft, together with the assumed block under verification).
        logits = sequence.feed(self.model, assumed, num_logits=1)[0]  # [V_draft]
        token_ids: list[int] = []
        draft_probs: list[torch.Tensor] = []
        for i in range(num_tokens):
            logits = fit_vocab(logits, self.vocab_size)  # [V]
            if greedy:
                token_ids.append(int(logits.argmax()))
            else:
                probs = self.shipped_q(logits_to_probs(logits, call.sampling))
                token_ids.append(sample(probs.float(), generator))
                draft_probs.append(probs)
            if i + 1 < num_tokens:
                logits = sequence.feed(self.model, assumed + token_ids, num_logits=1)[0]
        return DraftBlock(tuple(token_ids), torch.stack(draft_probs) if draft_probs else None)

    def shipped_q(self, probs: torch.Tensor) -> torch.Tensor:
        """[V] q as it will travel: truncated, then rounded to the wire's precision."""
        probs = truncate_mass(truncate_top_k(probs, self.draft_top_k), self.draft_q_mass)
        return probs.to(self.draft_q_dtype)

"""The target engine: score K drafted tokens plus the position after them in ONE forward."""

from speculative.kv import SessionStore
from speculative.sampling import logits_to_probs
from speculative.types import ScoreCall, TargetScores, check_call


class ModelVerifier:
    """Holds the target model and each request's KV cache.

    A call first rolls the request's cache back to the committed prefix (the rejected suffix
    of the previous round is cropped away), or rebuilds it when the call carries the whole
    prefix, then feeds the newly committed tokens and x1..xK in a single forward.
    """

    def __init__(self, model, *, max_cached_requests: int = 256) -> None:
        self.model = model.eval()
        self.sessions = SessionStore(max_cached_requests)

    async def score(self, call: ScoreCall) -> TargetScores:
        return self.score_now(call)

    async def release(self, request_id: str) -> None:
        self.sessions.release(request_id)

    def score_now(self, call: ScoreCall) -> TargetScores:
        check_call(call.sync.new_token_ids + call.draft_token_ids, self.model.config.vocab_size,
                   len(call.draft_token_ids))
        sequence = self.sessions.sync(call.request_id, call.sync)
        drafted = list(call.draft_token_ids)
        logits = sequence.feed(self.model, drafted, num_logits=len(drafted) + 1)  # [K+1, V]
        if call.sampling.greedy:
            return TargetScores(tuple(logits.argmax(-1).tolist()), None)
        return TargetScores((), logits_to_probs(logits, call.sampling))

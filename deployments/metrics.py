"""Router metrics, exported through Serve's Prometheus metrics (names as vLLM users know them)."""

from ray.serve.metrics import Counter, Histogram

from speculative.loop import RequestState

ROUND_BOUNDARIES_S = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


class RouterMetrics:
    def __init__(self) -> None:
        self.num_drafts = Counter("spec_decode_num_drafts",
                                  description="Rounds that drafted at least one token.")
        self.num_draft_tokens = Counter("spec_decode_num_draft_tokens",
                                        description="Tokens proposed by the drafter.")
        self.num_accepted_tokens = Counter("spec_decode_num_accepted_tokens",
                                           description="Drafted tokens the target accepted.")
        self.accepted_per_pos = Counter(
            "spec_decode_num_accepted_tokens_per_pos",
            description="Accepted tokens by position in the draft.", tag_keys=("position",))
        self.cache_misses = Counter("spec_decode_cache_misses",
                                    description="Pool calls that had to rebuild a KV cache.")
        self.rounds_by_k = Counter(
            "spec_decode_rounds_by_num_speculative_tokens",
            description="Rounds by the number of tokens drafted (K, as the K policy chose it).",
            tag_keys=("num_speculative_tokens",))
        self.round_seconds = Histogram(
            "spec_decode_round_seconds", description="Mean time per round of a request, by phase "
            "(draft and verify compute, transport, router).",
            boundaries=ROUND_BOUNDARIES_S, tag_keys=("phase",))

    def record(self, state: RequestState) -> None:
        stats = state.stats
        for counter, value in ((self.num_drafts, stats.num_drafts),
                               (self.num_draft_tokens, stats.num_draft_tokens),
                               (self.num_accepted_tokens, stats.num_accepted_tokens),
                               (self.cache_misses, stats.cache_misses)):
            if value:  # Ray counters refuse increments of 0
                counter.inc(value)
        for position, count in enumerate(stats.accepted_per_position):
            if count:
                self.accepted_per_pos.inc(count, tags={"position": str(position)})
        for k, count in stats.rounds_by_k.items():
            self.rounds_by_k.inc(count, tags={"num_speculative_tokens": str(k)})
        if stats.rounds:
            for phase, seconds in stats.phase_seconds().items():
                self.round_seconds.observe(seconds / stats.rounds, tags={"phase": phase})

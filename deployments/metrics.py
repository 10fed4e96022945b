"""Router and pool metrics, exported through Serve's Prometheus metrics (the router's named as
vLLM users know them)."""

from ray.serve.metrics import Counter, Gauge, Histogram

from engine.kv import PoolEngine, kv_usage
from speculative.state import RequestState

ROUND_BOUNDARIES_S = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
BATCH_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128]
# a choice's first text and its whole: from a lone short one to a long chat under load
LATENCY_BOUNDARIES_S = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0,
                        120.0, 300.0]
# a token's share of a choice: speculation's several a round to a loaded CPU pool's one
TOKEN_BOUNDARIES_S = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


# GAUGE_TTL_NOTE: Ray's metrics agent drops a gauge's series 2 report intervals (20 s by
# default) after its last set, so a gauge that holds still (an idle pool, a router whose
# running choices do not change) vanished from the export; its owner sets it again from
# Serve's periodic health check (every 10 s by default, the pools' every 2 s)


def rss_mb() -> float:
    """This process's resident set size in MB (Linux)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


class PoolMetrics:
    """A pool replica's batches: how many calls each ran, and how full they were (the
    occupancy its autoscaling policy reads: deployments.autoscaling); its KV cache's use and
    the sessions it holds; its direct calls in flight (the load that policy adds)."""

    def __init__(self, pool: str) -> None:
        self.tags = {"pool": pool}
        self.batch_size = Histogram(
            "specserve_pool_batch_size", description="Calls per batch a pool replica ran in "
            "one forward (a step, for the drafter).", boundaries=BATCH_BOUNDARIES,
            tag_keys=("pool",))
        self.occupancy = Gauge(
            "specserve_pool_batch_occupancy", description="The running batch's size over "
            "max_batch_size (1: full batches, the pool is saturated; 0: no call to run).",
            tag_keys=("pool",))
        self.kv_cache_usage = Gauge(
            "kv_cache_usage_perc", description="The share of the replica's KV cache units "
            "(blocks, or regions) its sessions hold, 0 to 1, as vLLM's: units only retired "
            "prefixes hold count as free (an allocation evicts them); 0 without a KV pool.",
            tag_keys=("pool",))
        self.sessions = Gauge(
            "specserve_pool_sessions", description="Request sessions the replica holds (a "
            "request's tokens and cache, until its release, eviction or TTL).",
            tag_keys=("pool",))
        self.direct_calls = Gauge(
            "specserve_pool_direct_calls", description="Calls in flight on the replica's own "
            "gRPC port (the router's, once Serve placed their request): Serve's count of "
            "ongoing requests misses them, and the pools' autoscaling policy adds them to it.",
            tag_keys=("pool",))
        # the gauges' values, set again by refresh; the engine's as read_engine last read them
        self.last_occupancy, self.last_kv_cache_usage, self.last_sessions = 0.0, 0.0, 0
        self.refresh(0)  # each reads 0 from the start (a gauge never set is not exported)

    def record_batch(self, batch_size: int, max_batch_size: int) -> None:
        self.batch_size.observe(batch_size, tags=self.tags)
        self.last_occupancy = batch_size / max_batch_size
        self.occupancy.set(self.last_occupancy, tags=self.tags)

    def record_idle(self) -> None:
        """No call left to run: the gauge says so (it held the last batch's value for good,
        an idle pool reading as busy as when it stopped)."""
        self.last_occupancy = 0.0
        self.occupancy.set(0.0, tags=self.tags)

    def read_engine(self, engine: PoolEngine) -> None:
        """Its KV cache's use and its sessions, for the gauges' next refresh: called by the
        thread that has the engine to itself (the loop never reads what the worker changes),
        after each batch and release. Two counts, no walk over the units (UnitPool.usage)."""
        self.last_kv_cache_usage, self.last_sessions = kv_usage(engine), len(engine.sessions)

    def record_direct_calls(self, in_flight: int) -> None:
        """The direct calls in flight as the autoscaling stats report them, set where those
        are read (a poll, a health check), not at each call."""
        self.direct_calls.set(in_flight, tags=self.tags)

    def refresh(self, direct_calls: int) -> None:
        """The gauges set again to their values (GAUGE_TTL_NOTE), and to the direct calls in
        flight now, from Serve's health check on the event loop."""
        self.occupancy.set(self.last_occupancy, tags=self.tags)
        self.kv_cache_usage.set(self.last_kv_cache_usage, tags=self.tags)
        self.sessions.set(self.last_sessions, tags=self.tags)
        self.record_direct_calls(direct_calls)


def features(sampling) -> list[str]:
    """The features a choice's sampling uses, as the metrics tag them."""
    used = {"structured_output": sampling.grammar is not None,
            "logprobs": sampling.logprobs is not None, "penalties": sampling.penalized,
            "logit_bias": bool(sampling.logit_bias), "min_tokens": sampling.min_tokens > 0,
            "allowed_token_ids": bool(sampling.allowed_token_ids),
            "bad_words": bool(sampling.bad_words_ids)}
    return [name for name, on in used.items() if on]


def feature_counters() -> tuple[Counter, Counter, Counter]:
    """Choices decoded with each feature (features'), their drafted and accepted
    tokens."""
    choices = Counter(
        "specserve_feature_choices", description="Choices decoded with a feature "
        "(structured_output, logprobs, penalties, logit_bias, min_tokens, "
        "allowed_token_ids, bad_words).", tag_keys=("feature",))
    drafted = Counter("specserve_feature_draft_tokens", description="Tokens drafted for "
                      "choices with a feature.", tag_keys=("feature",))
    accepted = Counter("specserve_feature_accepted_tokens", description="Drafted tokens "
                       "accepted for choices with a feature.", tag_keys=("feature",))
    return choices, drafted, accepted


class RouterMetrics:
    def __init__(self) -> None:
        # a request's life, under vLLM's names (without its `vllm:` prefix); per choice, as
        # each of a request's n choices is one of vLLM's sequences
        self.running = Gauge(
            "num_requests_running", description="Choices running in this router replica "
            "(n counts); at max_running_requests a request waits its turn.")
        self.waiting = Gauge(
            "num_requests_waiting", description="Requests waiting in this router replica for "
            "their choices to run (first come first served); beyond max_waiting_requests a "
            "request gets 429.")
        # both read 0 from the start, as vLLM's do: a gauge never set is not exported, so a
        # dashboard (or an autoscaler) read no series until a request first ran, or waited
        self.running.set(0)
        self.waiting.set(0)
        self.prompt_tokens = Counter("prompt_tokens", description="Prompt tokens of the "
                                     "requests decoded (each prompt once, as usage counts).")
        self.generation_tokens = Counter("generation_tokens",
                                         description="Tokens output by the choices.")
        # vLLM's prefix cache counters, per choice as each of its sequences queries the cache:
        # the hit rate is hits over queries
        self.prefix_cache_queries = Counter(
            "prefix_cache_queries", description="Prompt tokens looked up in the verifier's "
            "prefix cache (each choice's prompt).")
        self.prefix_cache_hits = Counter(
            "prefix_cache_hits", description="Prompt tokens the verifier took from its prefix "
            "cache (each choice's cached_tokens).")
        self.request_success = Counter(
            "request_success", description="Choices that finished, by finish reason (stop, "
            "length, repetition).", tag_keys=("finished_reason",))
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds", description="Seconds from a choice's start to its "
            "first text (a stream's first content chunk).", boundaries=LATENCY_BOUNDARIES_S)
        self.e2e_latency = Histogram(
            "e2e_request_latency_seconds", description="Seconds from a choice's start to its "
            "end, of the choices that finished.", boundaries=LATENCY_BOUNDARIES_S)
        self.time_per_output_token = Histogram(
            "request_time_per_output_token_seconds", description="A finished choice's mean "
            "seconds per output token after its first text.", boundaries=TOKEN_BOUNDARIES_S)
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
        self.draft_fallback_rounds = Counter(
            "specserve_draft_fallback_rounds", description="Rounds run by the target alone "
            "because the drafter failed or missed its deadline (exact, slower).")
        self.busy_retries = Counter(
            "specserve_busy_retries", description="Pool calls tried again after a pause "
            "because the pool had no room for them (its KV cache or calls in flight full): "
            "the verifier's, and the drafter's for seeded sampled requests.")
        self.rounds_by_k = Counter(
            "spec_decode_rounds_by_num_speculative_tokens",
            description="Rounds by the number of tokens drafted (K, as the K policy chose it).",
            tag_keys=("num_speculative_tokens",))
        self.round_seconds = Histogram(
            "spec_decode_round_seconds", description="Mean time per round of a request, by phase "
            "(draft and verify compute, transport, router).",
            boundaries=ROUND_BOUNDARIES_S, tag_keys=("phase",))
        # what requests use beyond a prompt, and what it does to acceptance
        self.feature_choices, self.feature_draft_tokens, self.feature_accepted_tokens = \
            feature_counters()

    def refresh(self, running: int, waiting: int) -> None:
        """The gauges set again to these values (GAUGE_TTL_NOTE)."""
        self.running.set(running)
        self.waiting.set(waiting)

    def record_choice(self, state: RequestState, prompt_tokens: int,
                      first_text_s: float | None, seconds: float) -> None:
        """A choice's end (finished, failed or cancelled): its tokens, and, finished, its
        finish reason and times; then its speculative counts (record)."""
        for counter, value in ((self.prompt_tokens, prompt_tokens),
                               (self.generation_tokens, state.num_output_tokens),
                               (self.prefix_cache_queries, len(state.request.prompt_token_ids)),
                               (self.prefix_cache_hits, state.stats.cached_tokens)):
            if value:  # Ray counters refuse increments of 0
                counter.inc(value)
        if state.finish_reason is not None:
            self.request_success.inc(1, tags={"finished_reason": state.finish_reason})
            self.e2e_latency.observe(seconds)
            if first_text_s is not None and state.num_output_tokens > 1:
                self.time_per_output_token.observe(
                    (seconds - first_text_s) / (state.num_output_tokens - 1))
        if first_text_s is not None:
            self.time_to_first_token.observe(first_text_s)
        self.record(state)

    def record(self, state: RequestState) -> None:
        stats = state.stats
        for feature in features(state.request.sampling):
            tags = {"feature": feature}
            self.feature_choices.inc(1, tags=tags)
            if stats.num_draft_tokens:
                self.feature_draft_tokens.inc(stats.num_draft_tokens, tags=tags)
            if stats.num_accepted_tokens:
                self.feature_accepted_tokens.inc(stats.num_accepted_tokens, tags=tags)
        for counter, value in ((self.num_drafts, stats.num_drafts),
                               (self.num_draft_tokens, stats.num_draft_tokens),
                               (self.num_accepted_tokens, stats.num_accepted_tokens),
                               (self.cache_misses, stats.cache_misses),
                               (self.draft_fallback_rounds, stats.draft_fallback_rounds),
                               (self.busy_retries, stats.busy_retries)):
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

"""Autoscaling that sees the direct data path.

Serve's autoscaler counts the requests Serve routed; once a request is placed, the router talks
to the replica's own gRPC port, which Serve never sees. Each pool replica reports its direct
calls in flight (`record_autoscaling_stats`, polled when the deployment has an
autoscaling_config); this policy adds them to Serve's count and keeps Serve's queue-length rule:
desired replicas = load / target_ongoing_requests. Each replica also reports how full its
batches ran (`batch_occupancy`), and the policy asks for enough replicas to keep that under
TARGET_OCCUPANCY. Serve still applies min/max replicas, the up/down-scale delays and smoothing
to what it returns. Name it in a config as

    autoscaling_config:
      target_ongoing_requests: 2
      policy: {policy_function: deployments.autoscaling:direct_aware_policy}
"""

DIRECT_IN_FLIGHT = "direct_in_flight"
BATCH_OCCUPANCY = "batch_occupancy"
TARGET_OCCUPANCY = 0.75  # of max_batch_size: past it, the pool asks for more replicas


class Occupancy:
    """How full a replica's batches are: the mean batch size since the last poll, over the
    largest batch it may run (1.0: every forward was a full batch, the pool is saturated)."""

    def __init__(self, max_batch_size: int) -> None:
        self.max_batch_size = max_batch_size
        self.calls = self.batches = 0

    def observe(self, batch_size: int) -> None:
        self.calls += batch_size
        self.batches += 1

    def take(self) -> float:
        """The occupancy since the last take (0 when no batch started: idle)."""
        occupancy = self.calls / self.batches / self.max_batch_size if self.batches else 0.0
        self.calls = self.batches = 0
        return occupancy


def direct_aware_policy(ctx) -> tuple[float, dict]:
    """ctx: ray.serve.config.AutoscalingContext -> (desired replicas, policy state).

    The larger of two asks: the queue rule over all calls in flight, and enough replicas to
    bring the pool's mean batch occupancy down to TARGET_OCCUPANCY (a pool whose batches run
    full is saturated however short its queue looks): the occupancies reported, summed, over
    TARGET_OCCUPANCY. A running replica that has not reported yet (Serve pushes a new one's
    first stats up to 10 s after it runs) counts no batches, as it counts no calls: it holds
    no sessions yet, and taking the others' mean for it asked for yet another replica."""
    if ctx.current_num_replicas == 0:  # Serve scales up from zero on its own count
        return ctx.target_num_replicas, {}
    metrics = ctx.aggregated_metrics or {}
    direct = sum((metrics.get(DIRECT_IN_FLIGHT) or {}).values())
    load = ctx.total_num_requests + direct
    by_queue = load / ctx.config.get_target_ongoing_requests()
    by_batches = sum((metrics.get(BATCH_OCCUPANCY) or {}).values()) / TARGET_OCCUPANCY
    return max(by_queue, by_batches), {}

"""Autoscaling that sees the direct data path.

Serve's autoscaler counts the requests Serve routed; once a request is placed, the router talks
to the replica's own gRPC port, which Serve never sees. Each pool replica reports its direct
calls in flight (`record_autoscaling_stats`, polled when the deployment has an
autoscaling_config); this policy adds them to Serve's count and keeps Serve's queue-length rule:
desired replicas = load / target_ongoing_requests. Serve still applies min/max replicas, the
up/down-scale delays and smoothing to what it returns. Name it in a config as

    autoscaling_config:
      target_ongoing_requests: 2
      policy: {policy_function: deployments.autoscaling:direct_aware_policy}
"""

DIRECT_IN_FLIGHT = "direct_in_flight"


def direct_aware_policy(ctx) -> tuple[float, dict]:
    """ctx: ray.serve.config.AutoscalingContext -> (desired replicas, policy state)."""
    if ctx.current_num_replicas == 0:  # Serve scales up from zero on its own count
        return ctx.target_num_replicas, {}
    direct = sum(((ctx.aggregated_metrics or {}).get(DIRECT_IN_FLIGHT) or {}).values())
    load = ctx.total_num_requests + direct
    return load / ctx.config.get_target_ongoing_requests(), {}

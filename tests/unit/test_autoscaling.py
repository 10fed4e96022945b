"""The autoscaling policy that adds direct-path calls to Serve's own request count."""

import importlib

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.autoscaling import (
    BATCH_OCCUPANCY,
    DIRECT_IN_FLIGHT,
    TARGET_OCCUPANCY,
    Occupancy,
    direct_aware_policy,
)
from deployments.local import load_config

DEPLOYMENT = DeploymentID(name="VerifierPool", app_name="verifier")


def context(replicas: int, serve_requests: float, direct: list[float] | None,
            occupancy: list[float] | None = None) -> AutoscalingContext:
    ids = [ReplicaID(f"r{i}", DEPLOYMENT) for i in range(replicas)]
    metrics = None if direct is None else {DIRECT_IN_FLIGHT: dict(zip(ids, direct))}
    if occupancy is not None:
        metrics[BATCH_OCCUPANCY] = dict(zip(ids, occupancy))
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name="VerifierPool", app_name="verifier",
        current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=ids,
        total_num_requests=serve_requests, total_queued_requests=0, aggregated_metrics=metrics,
        raw_metrics=None, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=0.0,
        config=AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=4))


@pytest.mark.parametrize("replicas, serve_requests, direct, desired", [
    (1, 4, [0], 1.0),           # Serve's count alone: the usual rule
    (1, 0, [12], 3.0),          # direct calls alone: Serve would have seen no load at all
    (2, 2, [3, 3], 2.0),        # both, summed over replicas
    (2, 0, [0, 0], 0.0),        # idle: Serve's min_replicas clamps it afterwards
    (1, 8, None, 2.0),          # no replica reported yet
])
def test_desired_replicas_count_direct_calls(replicas, serve_requests, direct, desired):
    assert direct_aware_policy(context(replicas, serve_requests, direct)) == (desired, {})


@pytest.mark.parametrize("occupancy, desired", [
    ([0.25, 0.25], 2.0),                          # batches half empty: the queue rule rules
    ([1.0, 1.0], 2 / TARGET_OCCUPANCY),           # every batch full: saturated, scale up
    ([1.0, 0.5], 2 * 0.75 / TARGET_OCCUPANCY),    # the pool's mean occupancy
])
def test_full_batches_ask_for_more_replicas(occupancy, desired):
    ctx = context(2, 8, [0, 0], occupancy)  # the queue rule alone: 8 / 4 = 2 replicas
    assert direct_aware_policy(ctx)[0] == pytest.approx(desired)


def test_the_batch_rule_reads_the_pools_mean_occupancy_where_it_decides_alone():
    """No queue at all: the ask is the batches' alone, from the replicas' mean (one full,
    one half full: 0.75 of max_batch_size, TARGET_OCCUPANCY's worth of two replicas)."""
    assert direct_aware_policy(context(2, 0, [0, 0], [1.0, 0.5]))[0] == pytest.approx(
        2 * 0.75 / TARGET_OCCUPANCY)


def test_a_replica_that_has_not_reported_yet_adds_no_batches():
    """Serve pushes a new replica's first stats up to 10 s after it runs. The replica that
    holds every session runs full batches (its own ask: 1 / TARGET_OCCUPANCY, 2 replicas,
    as running); taking its mean for the new one asked for 2.67, a third replica as soon as
    upscale_delay_s is shorter than that lag."""
    ctx = context(2, 0, [0], [1.0])  # r1 runs, not reported yet
    assert direct_aware_policy(ctx)[0] == pytest.approx(1 / TARGET_OCCUPANCY)


def test_serve_applies_its_upscale_delay_to_this_policy(monkeypatch):
    """Serve wraps a custom policy in its factors and delays (Ray 2.60): a full pool's ask is
    held for upscale_delay_s, then taken."""
    from ray.serve import autoscaling_policy

    if not hasattr(autoscaling_policy, "_apply_autoscaling_config"):  # Serve's private wrapper
        pytest.skip("this Ray wraps custom policies elsewhere")
    policy = autoscaling_policy._apply_autoscaling_config(direct_aware_policy)
    ctx = context(1, 0, [0], [1.0])
    ctx.config = AutoscalingConfig(min_replicas=1, max_replicas=8, upscale_delay_s=10)
    decisions = []
    for now in (0.0, 5.0, 10.0):
        monkeypatch.setattr(autoscaling_policy.time, "time", lambda now=now: now)
        decision, ctx.policy_state = policy(ctx)
        decisions.append(decision)
    assert decisions == [1, 1, 2]


def test_occupancy_is_the_mean_batch_over_the_cap_since_the_last_poll():
    occupancy = Occupancy(max_batch_size=8)
    for size in (8, 4, 2, 2):
        occupancy.observe(size)
    assert occupancy.take() == 0.5
    assert occupancy.take() == 0.0  # nothing ran since: idle


def test_from_zero_replicas_it_defers_to_serve():
    ctx = context(0, 3, [])
    assert direct_aware_policy(ctx)[0] == ctx.target_num_replicas


def test_the_gpu_config_names_this_policy_for_both_pools():
    named = {}
    for app in load_config("gpu.yaml")["applications"]:
        for deployment in app["deployments"]:
            policy = deployment.get("autoscaling_config", {}).get("policy")
            if policy:
                module, function = policy["policy_function"].split(":")
                named[deployment["name"]] = getattr(importlib.import_module(module), function)
    assert named == {"DrafterPool": direct_aware_policy, "VerifierPool": direct_aware_policy}

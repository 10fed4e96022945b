"""bench.router_turn's in-process mode: its instant pools drive the round as the served pools
do (the output is the verifier's tokens whatever the drafts), and the measure runs."""

import asyncio

import pytest

from bench.router_turn import InstantPools, in_process
from speculative.driver import Generation
from speculative.state import Request
from speculative.costs import CostModel
from speculative.fixed_k import FixedK
from speculative.policy import k_policy
from speculative.sampling import SamplingParams


@pytest.mark.parametrize("k", [0, 1, 4])
def test_the_output_is_the_verifiers_tokens_at_any_k(k):
    pools = InstantPools(prompt_len=3)
    generation = Generation(Request("r", (5, 6, 7), SamplingParams(temperature=0,
                                                                   max_tokens=20)))
    asyncio.run(generation.run(pools, pools, FixedK(k)))
    assert generation.token_ids == [pools.at(p) for p in range(20)]
    if k:  # the drafter is wrong at every third position: some rounds commit several
        assert generation.stats.rounds < 20


@pytest.mark.parametrize("k, pipelined", [(2, False), ("auto", True)])
def test_the_in_process_measure_runs(k, pipelined):
    assert in_process(streams=2, k=k, max_tokens=8, requests=4, pipelined=pipelined) > 0


def test_the_instant_pools_report_a_loaded_batchs_costs():
    """So that the adaptive K runs its loaded path (BatchTrials) and its cost model fills."""
    pools = InstantPools(prompt_len=3, batch_size=16)
    generation = Generation(Request("r", (5, 6, 7), SamplingParams(temperature=0,
                                                                   max_tokens=40)))
    costs = CostModel()
    policy = k_policy("auto", True, greedy=True, costs=costs)
    asyncio.run(generation.run(pools, pools, policy, True))
    assert generation.token_ids == [pools.at(p) for p in range(40)]
    assert policy.loaded and costs.trials_at(16).k is not None
    assert costs.verify and costs.drafts and costs.overlap

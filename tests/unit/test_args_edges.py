"""Edges of the router's and the pools' args (deployments.router_args, deployments.pool_args),
each at its exact bound: one past it fails at deploy naming the arg, the bound itself and the
values docs/operations.md gives a meaning (0: none waits, 0: 429 at once) are taken, the
defaults are the documented ones, and what the args build carries each of them."""

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from deployments import local, placement, served_models
from deployments.placement import ROUTE_PREFIX_TOKENS, LoadBound, prefix_route_key
from deployments.pool_args import DrafterArgs, VerifierArgs
from deployments.router_args import RouterArgs
from speculative.options import MAX_PLAIN_STEPS, MAX_TREE_WIDTH, SpeculationDefaults, TreeShape
from speculative.policy import KBounds
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.types import PrefixSync


@pytest.mark.parametrize("model, args, field", [
    (RouterArgs, {"adaptive_k": {"min": 3, "max": 8, "initial": 2}}, "adaptive_k"),
    (RouterArgs, {"adaptive_k": {"min": 5, "max": 2}}, "adaptive_k"),  # not at the start
    (RouterArgs, {"plain_steps": MAX_PLAIN_STEPS + 1}, "plain_steps"),
    (RouterArgs, {"draft_confidence": 1.0}, "draft_confidence"),  # a drafter refuses 1
    (RouterArgs, {"max_context_tokens": 1}, "max_context_tokens"),
    (RouterArgs, {"speculative_tree": {"width": MAX_TREE_WIDTH + 1}}, "speculative_tree.width"),
    # a node beside the main chain, of a tree's 64 at most
    (RouterArgs, {"speculative_tree": {"depth": 64}}, "speculative_tree.depth"),
    (RouterArgs, {"responses_store": {"ttl_s": 0}}, "responses_store"),  # stores nothing
    (RouterArgs, {"grpc_address": "localhost"}, "grpc_address"),  # gRPC would dial 443
    (RouterArgs, {"grpc_address": "127.0.0.1:65536"}, "grpc_address"),
    # gRPC looks "http://127.0.0.1" up as a host name: every pool call UNAVAILABLE
    (RouterArgs, {"grpc_address": "http://127.0.0.1:9000"}, "grpc_address"),
    (RouterArgs, {"grpc_address": "grpc://127.0.0.1:9000"}, "grpc_address"),
    (RouterArgs, {"verifier_app": ""}, "verifier_app"),
    (VerifierArgs, {"device": "cuda:0x"}, "device"),
    (VerifierArgs, {"device": "cuda:"}, "device"),
    (VerifierArgs, {"kv_cache_tokens": 19}, "kv_cache_tokens"),  # the warm-up needs 20
    (VerifierArgs, {"max_batch_size": 1025}, "max_batch_size"),
    (VerifierArgs, {"max_batch_tokens": 15}, "max_batch_tokens"),
    (DrafterArgs, {"draft_confidence": 1.0}, "draft_confidence"),
    (DrafterArgs, {"ngram_max": 0}, "ngram_max")])
def test_one_past_each_bound_fails_at_deploy_naming_the_arg(model, args, field):
    """`field`: the arg, and after a dot the field inside it the error names."""
    with pytest.raises(ValidationError) as refused:
        model.model_validate(args)
    where, (arg, _, inner) = refused.value.errors()[0]["loc"], field.partition(".")
    assert where[0] == arg and (not inner or where[-1] == inner)


def test_each_bound_itself_and_the_documented_zeros_are_taken():
    """0 waiting requests (429 at once), no busy wait, no prefix placement: each documented;
    an adaptive K fixed by equal bounds; a drafter of n-grams of one length."""
    router = RouterArgs(max_waiting_requests=0, busy_wait_s=0, prefix_affinity_tokens=0,
                        plain_steps=MAX_PLAIN_STEPS, draft_confidence=0.999,
                        max_context_tokens=2, adaptive_k={"min": 3, "max": 3, "initial": 3},
                        speculative_tree={"width": MAX_TREE_WIDTH, "depth": 63})
    assert router.adaptive_k.bounds() == KBounds(3, 3, 3)
    for address in ("[::1]:65535", "pools.internal:1", "unix:/run/serve.sock",
                    "dns:///pools.internal:9000", "unix:///run/serve.sock"):
        assert RouterArgs(grpc_address=address).grpc_address == address
    assert (router.max_waiting_requests, router.busy_wait_s) == (0, 0)
    drafter = DrafterArgs(drafter="ngram", ngram_min=3, ngram_max=3, draft_top_k=0,
                          draft_q_mass=1, kv_cache_tokens=20, max_batch_size=1024,
                          max_batch_tokens=16, batch_linger=0, device="cuda:12")
    assert (drafter.ngram_min, drafter.ngram_max, drafter.device) == (3, 3, "cuda:12")


def test_the_defaults_are_those_the_operations_doc_gives():
    router, pool = RouterArgs(), VerifierArgs()
    assert (router.call_timeout_s, router.draft_timeout_s, router.busy_wait_s) == (30, 1, 30)
    assert (router.max_running_requests, router.max_waiting_requests) == (128, 128)
    assert (router.prefix_affinity_tokens, router.prefix_affinity_load_factor) == (32, 1.25)
    assert router.local_drafter_cached_tokens == 262_144
    assert router.scheduling_policy == "fcfs" and router.default_max_tokens == 16
    assert (pool.max_batch_tokens, pool.session_ttl_s, pool.health_stall_s) == (512, 600, 60)
    assert pool.direct_host == "loopback" and pool.max_concurrent_rpcs is None


def test_the_speculation_defaults_carry_each_router_arg():
    args = RouterArgs(num_speculative_tokens=5, adaptive_k={"min": 1, "max": 6, "seeded": 3},
                      pipelined_drafting="greedy", busy_wait_s=7, call_timeout_s=9,
                      speculative_tree="auto", draft_confidence=0.5, plain_steps=3)
    assert args.speculation_defaults() == SpeculationDefaults(
        5, KBounds(1, 6), 3, "greedy", 7, TreeShape(auto=True), 0.5, 3)
    tree = RouterArgs(speculative_tree={"width": 3, "depth": 4, "nodes": 9})
    assert tree.speculation_defaults().tree == TreeShape(3, 4, 9)
    assert RouterArgs().speculation_defaults().tree == TreeShape()  # chains


def test_the_drafter_spec_carries_every_arg_it_names():
    """Each DrafterSpec field from its arg (`kind` from `drafter`), every one off its
    default, so that one not copied keeps the spec's default and shows."""
    args = DrafterArgs(model="d", target="t", drafter="ngram", dtype="float16", device="cuda:1",
                       max_cached_requests=7, max_cached_tokens=70, session_ttl_s=5,
                       engine="paged", attention="regions", cuda_graphs=False,
                       kv_cache_tokens=64, draft_top_k=3, draft_q_mass=0.5,
                       draft_q_dtype="float16", draft_confidence=0.25, max_batch_tokens=32,
                       ngram_min=2, ngram_max=5)
    spec = args.spec()
    for field in dataclasses.fields(spec):
        arg = "drafter" if field.name == "kind" else field.name
        assert getattr(spec, field.name) == getattr(args, arg), field.name
        assert getattr(spec, field.name) != field.default, field.name


def test_a_prompt_of_exactly_the_placement_tokens_is_placed_by_its_prefix():
    exact = tuple(range(1, ROUTE_PREFIX_TOKENS + 1))
    placed = prefix_route_key("a", PrefixSync(0, EMPTY_PREFIX_HASH, exact))
    assert placed == prefix_route_key("b", PrefixSync(0, EMPTY_PREFIX_HASH, exact + (9,)))
    assert placed.startswith("prefix-")
    assert prefix_route_key("c", PrefixSync(0, EMPTY_PREFIX_HASH, exact), tokens=3) != "c"


def test_the_prefixes_placed_least_recently_are_forgotten_first(monkeypatch):
    monkeypatch.setattr(placement, "HOMES_KEPT", 2)
    bound = LoadBound(1.25)
    for key in ("prefix-1", "prefix-2", "prefix-1", "prefix-3"):  # prefix-1 placed again
        bound.landed(key, "a:1")
    assert list(bound.homes) == ["prefix-1", "prefix-3"]


def test_free_ports_move_the_proxies_and_the_routers_address_on_a_copy():
    config = local.load_config()
    moved = local.on_free_ports(config)
    http, grpc = moved["http_options"]["port"], moved["grpc_options"]["port"]
    assert http != grpc and http in local.PORT_RANGE and grpc in local.PORT_RANGE
    assert local.app_config(moved, "router")["args"]["grpc_address"] == f"127.0.0.1:{grpc}"
    assert config == local.load_config()


@pytest.mark.parametrize("missing", [OSError, ValueError])
def test_a_target_without_a_tokenizer_serves_the_tokenizer_arg(monkeypatch, missing):
    """Where the target's folder has no tokenizer to compare with, the arg's is the one."""
    def load(name):
        if name == "target":
            raise missing(f"no tokenizer in {name}")
        return SimpleNamespace(name=name, get_vocab=lambda: {"a": 0})

    monkeypatch.setattr(served_models, "load_tokenizer", load)
    assert served_models.served_tokenizer("target", "tok").name == "tok"


def test_free_ports_wrap_around_within_their_range(monkeypatch):
    """A process whose offset is the range's last port finds the next one at its start."""
    monkeypatch.setattr(local, "_handed_out", set())
    span = len(local.PORT_RANGE)
    pid = next(pid for pid in range(1, 10 * span) if pid * 97 % span == span - 1)
    monkeypatch.setattr(local.os, "getpid", lambda: pid)
    ports = [local.free_port() for _ in range(3)]
    assert len(set(ports)) == 3 and all(port in local.PORT_RANGE for port in ports)


def test_while_the_replica_count_is_unknown_the_replicas_met_stand_for_it():
    """No count read (None): a hot prefix's replica holding 3 of 4 requests over the 2
    replicas met is at its bound, ceil(1.25 x 4 / 2), and the next request spills."""
    bound = LoadBound(1.25)
    bound.landed("prefix-hot", "a:1")
    bound.landed("other", "b:1")
    pins = {f"r{i}": "a:1" for i in range(3)}

    async def spill():
        return bound.spill("prefix-hot", pins)

    assert bound.replicas is None and asyncio.run(spill()) == (True, "b:1")


def test_an_api_key_with_a_control_character_inside_fails_at_deploy():
    """A tab or a NUL inside the key survives the strip; no header carries it."""
    for key in ("sk\t1", "sk\x001"):
        with pytest.raises(ValidationError) as refused:
            RouterArgs(api_key=key)
        assert refused.value.errors()[0]["loc"][0] == "api_key"

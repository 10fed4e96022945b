"""A pool replica outside Serve: its own gRPC port, its worker thread, its load report."""

import asyncio
import contextlib
import json
import threading

import grpc
import pytest
from pydantic import ValidationError

from deployments import auth
from deployments.autoscaling import BATCH_OCCUPANCY, DIRECT_IN_FLIGHT
from deployments.pool_args import WARM_UP_K, WARM_UP_PROMPT_TOKENS, DrafterArgs, VerifierArgs
from deployments.pools import DrafterPool, VerifierPool
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from speculative.prefixes import prefix_hash

KEY = auth.metadata  # called at each use: the secret the fixture set


@pytest.fixture(autouse=True)
def pool_secret(monkeypatch):
    monkeypatch.setenv(auth.ENV, "test-secret")
    monkeypatch.setattr(auth, "_secret", None)


async def local_replica(cls, args):
    replica = cls.__new__(cls)
    await cls.__init__(replica, args)
    return replica


@contextlib.asynccontextmanager
async def direct(replica, stub_class):
    """A stub of the replica's own gRPC port; the channel and the server stop after."""
    channel = grpc.aio.insecure_channel(replica.address)
    try:
        yield stub_class(channel)
    finally:
        await channel.close()
        await replica.server.stop(None)


async def local_drafter():
    return await local_replica(DrafterPool, DrafterArgs())


def propose(request_id: str, length: int = 3) -> pb.ProposeRequest:
    """A greedy K = 3 call after `length` new tokens (5, 6, 7, ...)."""
    return pb.ProposeRequest(request_id=request_id, num_speculative_tokens=3,
                             sync=pb.PrefixSync(new_token_ids=range(5, 5 + length)),
                             sampling=pb.SamplingParams(temperature=0))


def greedy_score(request_id: str, length: int = 120) -> pb.ScoreRequest:
    """A greedy call without drafts after `length` new tokens (1, 2, 3, ...)."""
    return pb.ScoreRequest(request_id=request_id, sampling=pb.SamplingParams(),
                           sync=pb.PrefixSync(new_token_ids=range(1, length + 1)))


async def hold_engine(replica) -> threading.Event:
    """The replica's worker holds the engine until the gate returned is set: the model is
    busy, and calls wait for it (a lone one too, which would otherwise run on the loop)."""
    gate = threading.Event()
    replica.worker.submit(replica.owning, gate.wait)
    await until(replica.engine_lock.locked)
    return gate


async def until(condition, timeout_s: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def test_direct_calls_waiting_for_the_model_are_reported_as_load():
    async def main():
        replica = await local_drafter()
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            gate = await hold_engine(replica)  # the model is busy until the gate opens
            calls = [asyncio.ensure_future(stub.Propose(propose(f"r{i}"), metadata=KEY()))
                     for i in range(3)]
            await until(lambda: replica.direct_in_flight == 3)
            polled = await replica.record_autoscaling_stats()
            assert polled[DIRECT_IN_FLIGHT] == 3.0
            gate.set()
            responses = await asyncio.gather(*calls)
            assert [len(r.token_ids) for r in responses] == [3, 3, 3]
            assert all(r.direct_address == replica.address and r.compute_us > 0
                       for r in responses)
            # the calls that waited for the busy model ran as one batch
            assert max(r.load.batch_size for r in responses) >= 2
            stats = await replica.record_autoscaling_stats()
            assert stats[DIRECT_IN_FLIGHT] == 0.0
            # the batches started since the first poll, and before it (the three calls may
            # have formed one batch before it, which that poll took)
            assert polled[BATCH_OCCUPANCY] + stats[BATCH_OCCUPANCY] > 0
            assert replica.direct_calls_served() == 3

    asyncio.run(main())


def test_an_idle_replicas_occupancy_gauge_reads_0_not_its_last_batch(monkeypatch):
    """The batch occupancy gauge (Prometheus) of a replica with no call to run reads 0; it
    held the last batch's value for good, a pool gone idle reading as busy as it was."""
    from deployments import metrics as metrics_module

    occupancy = []

    class Metric:
        def __init__(self, name, **_):
            self.name = name

        def set(self, value, tags=None):
            occupancy.append(value)

        def observe(self, value, tags=None):
            pass

    monkeypatch.setattr(metrics_module, "Gauge", Metric)
    monkeypatch.setattr(metrics_module, "Histogram", Metric)

    async def main():
        replica = await local_drafter()
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            await asyncio.gather(*(stub.Propose(propose(f"r{i}"), metadata=KEY())
                                   for i in range(3)))
            await until(lambda: not replica.waiting)

    asyncio.run(main())
    assert max(occupancy) > 0 and occupancy[-1] == 0.0


def test_a_bad_direct_call_is_invalid_argument_and_not_left_in_flight():
    async def main():
        replica = await local_drafter()
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            bad = propose("bad")
            bad.sync.new_token_ids[:] = [10**6]
            try:
                await stub.Propose(bad, metadata=KEY())
                raise AssertionError("a token id outside the vocabulary was accepted")
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "out of range" in error.details()
            assert replica.direct_in_flight == 0

    asyncio.run(main())


LONE_CALLS = {  # pool: (replica class, args, stub, rpc, a request of `length` new tokens)
    "drafter": (DrafterPool, DrafterArgs(), pb_grpc.DrafterStub, "Propose", propose),
    "verifier": (VerifierPool, VerifierArgs(), pb_grpc.VerifierStub, "Score", greedy_score),
}


@pytest.mark.parametrize("pool", LONE_CALLS)
def test_a_lone_small_call_runs_on_the_event_loop_and_the_rest_on_the_worker(pool):
    """A lone call of a few tokens runs on the replica's event loop (no hop to the worker
    and back); a long feed (a prefill), and a call while the worker holds the engine, run
    on the worker, the latter once the worker lets go of the engine."""
    cls, args, stub_class, rpc, request = LONE_CALLS[pool]

    async def main():
        replica = await local_replica(cls, args)
        ran_on, engine_batch = [], replica.engine_batch

        def recording(run_batch, calls):
            ran_on.append(threading.current_thread().name)
            return engine_batch(run_batch, calls)

        replica.engine_batch = recording
        async with direct(replica, stub_class) as stub:
            call = getattr(stub, rpc)
            small = await call(request("small", 3), metadata=KEY())
            await call(request("long", 40), metadata=KEY())
            gate = await hold_engine(replica)  # the worker holds the engine
            held = asyncio.ensure_future(call(request("held", 3), metadata=KEY()))
            await until(lambda: replica.direct_in_flight == 1)
            await asyncio.sleep(0.05)
            assert not held.done()  # it waits for the engine, not beside it
            gate.set()
            assert (await held).direct_address == small.direct_address == replica.address
        assert ran_on[0] == threading.current_thread().name
        assert [name.startswith("engine") for name in ran_on] == [False, True, True]

    asyncio.run(main())


def test_a_lone_call_of_several_steps_leaves_the_loop_free_between_them():
    """A lone K = 0 call of 4 steps feeds one token a step, and runs a forward per step, each
    straight after the one before: the loop gets a turn between two, so it serves (other
    calls, health checks, releases) between them, never blocked for all of them in one go
    (up to MAX_PLAIN_STEPS forwards, as a client's plain_steps asks)."""
    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs())
        await replica.Score(greedy_score("s", 20))
        loop, ran, turns, engine_batch = asyncio.get_running_loop(), [], [], replica.engine_batch

        def recording(run_batch, calls):  # and whether the loop has run since the last step
            ran.append((threading.current_thread().name, len(turns)))
            loop.call_soon_threadsafe(turns.append, None)
            return engine_batch(run_batch, calls)

        replica.engine_batch = recording
        answer = await replica.Score(pb.ScoreRequest(
            request_id="s", steps=4, sync=pb.PrefixSync(
                known_len=20, known_hash=prefix_hash(range(1, 21)), new_token_ids=[7])))
        assert len(answer.continued_token_ids) == 3
        assert [loop_turns for _, loop_turns in ran] == [0, 1, 2, 3]
        await replica.server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize("closing", ["sweep", "eviction"])
def test_a_lone_call_that_closes_sessions_runs_on_the_worker(closing):
    """A lone small call runs on the event loop, and what it closes with it: a TTL sweep
    due, a session evicted for its own. A suffix drafter's close indexes the session's
    output (about 170 us a token: 1.5 s to sweep 20 outputs of 1,500 tokens, 0.13 s to
    evict one), which every call and health check of the replica waited for. Such a call
    runs on the worker."""
    args = DrafterArgs(drafter="suffix", session_ttl_s=0.2) if closing == "sweep" else \
        DrafterArgs(drafter="suffix", max_cached_requests=1)

    async def main():
        replica = await local_replica(DrafterPool, args)
        closed_on, remember = [], replica.engine.remember

        def recording(request_id, output):
            closed_on.append(threading.current_thread().name)
            return remember(request_id, output)

        replica.engine.remember = recording
        await replica.Propose(propose("a"))
        if closing == "sweep":
            await asyncio.sleep(0.3)  # a's session expires
        await replica.Propose(propose("b"))  # small and alone: inline, but for the close
        assert replica.session_ids() == ["b"]
        assert len(closed_on) == 1 and closed_on[0].startswith("engine")
        await replica.server.stop(None)

    asyncio.run(main())


def test_a_stuck_model_worker_fails_the_health_check():
    async def main():
        replica = await local_replica(DrafterPool, DrafterArgs(health_stall_s=0.2))
        await replica.check_health()  # idle: healthy
        gate = await hold_engine(replica)  # the worker is stuck
        call = asyncio.ensure_future(replica.Propose(propose("s")))
        await until(lambda: replica.waiting == 1)
        await asyncio.sleep(0.3)
        with pytest.raises(RuntimeError, match="has not finished a batch"):
            await replica.check_health()
        gate.set()
        await call
        await replica.check_health()  # progressing again
        await asyncio.sleep(0.3)  # idle past health_stall_s: nothing waits, so healthy
        await replica.check_health()
        await replica.server.stop(None)

    asyncio.run(main())


def test_a_call_refused_on_a_long_idle_replica_does_not_fail_the_health_check():
    """A refused call counts as waiting until its future's done callback runs; a health
    check scheduled before that callback must not take the idle time for a stall."""
    async def main():
        replica = await local_replica(DrafterPool, DrafterArgs(health_stall_s=0.2))
        await asyncio.sleep(0.3)  # idle past health_stall_s
        stale = propose("s")  # no sampling held for it: refused at once (REBUILD)
        stale.ClearField("sampling")
        stale.sync.known_len = 5
        call = asyncio.ensure_future(replica.Propose(stale))
        health = asyncio.ensure_future(replica.check_health())  # runs right after the call
        assert (await call).status == pb.REBUILD
        await health
        await replica.server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize("pool", ["drafter", "verifier"])
def test_a_replica_runs_its_model_before_it_is_ready_and_keeps_no_session(monkeypatch, pool):
    """No request pays the model's first forwards: the replica's start runs greedy and
    sampled calls through its engine (prefill and K-token steps) and drops their caches."""
    from engine.runner import ModelRunner

    shapes = []
    forward = ModelRunner.forward

    def counting(runner, segments):
        shapes.append(sum(len(s.token_ids) for s in segments))
        return forward(runner, segments)

    monkeypatch.setattr(ModelRunner, "forward", counting)

    async def main():
        pool_class, args = (DrafterPool, DrafterArgs()) if pool == "drafter" else \
            (VerifierPool, VerifierArgs())
        replica = await local_replica(pool_class, args)
        assert len(replica.engine.sessions) == 0
        await replica.server.stop(None)

    asyncio.run(main())
    assert max(shapes) >= 16 and min(shapes) <= 5  # a prefill and a step of a few tokens
    assert len(shapes) >= 3


@pytest.mark.parametrize("pool", ["drafter", "verifier"])
def test_the_least_kv_cache_the_args_take_holds_the_warm_up_and_less_fails_the_start(pool):
    """kv_cache_tokens' least value (the warm-up's 16-token prompt and its K = 4 step) starts
    the replica; 16 (one block), which the args took before, failed every start of it: it
    is refused as the config is read, and were it given, the start fails naming the arg
    (before, the warm-up passed over its calls' refusals and the replica answered every
    request OUT_OF_RANGE, the router's 400)."""
    from engine.scheduler import KVCacheTooSmall

    pool_class, args_class = (DrafterPool, DrafterArgs) if pool == "drafter" else \
        (VerifierPool, VerifierArgs)
    least = WARM_UP_PROMPT_TOKENS + WARM_UP_K

    async def started():
        replica = await local_replica(pool_class, args_class(kv_cache_tokens=least,
                                                             attention="paged"))
        await replica.server.stop(None)

    asyncio.run(started())
    with pytest.raises(ValidationError, match="kv_cache_tokens"):
        args_class(kv_cache_tokens=least - 1)
    unchecked = args_class(attention="paged").model_copy(update={"kv_cache_tokens": 16})
    with pytest.raises(KVCacheTooSmall, match="kv_cache_tokens"):
        asyncio.run(local_replica(pool_class, unchecked))


def test_a_call_without_room_in_the_kv_cache_is_resource_exhausted_alone():
    """Two 120-token prompts in one batch of a verifier whose paged cache holds 208
    positions (tests/unit/test_admission.py): the one that reaches the batch first is
    served (the two calls may arrive in either order), the other refused with
    RESOURCE_EXHAUSTED (the router's 429), and served once the first is released."""
    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs(kv_cache_tokens=208,
                                                                 max_cached_requests=2))
        async with direct(replica, pb_grpc.VerifierStub) as stub:
            gate = await hold_engine(replica)  # the model is busy until the gate opens
            first = asyncio.ensure_future(stub.Score(greedy_score("x", 8), metadata=KEY()))
            await until(lambda: replica.waiting == 1)  # x holds the batcher: a and b queue
            calls = [asyncio.ensure_future(stub.Score(greedy_score(r), metadata=KEY()))
                     for r in ("a", "b")]
            await until(lambda: replica.waiting == 3)
            gate.set()
            await first
            answers = dict(zip(("a", "b"), await asyncio.gather(*calls,
                                                                 return_exceptions=True)))
            [refused_id] = [r for r, a in answers.items() if isinstance(a, grpc.aio.AioRpcError)]
            [served_id] = [r for r in answers if r != refused_id]
            served, refused = answers[served_id], answers[refused_id]
            assert len(served.greedy.target_token_ids) == 1
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "KV cache" in refused.details()
            await stub.Release(pb.ReleaseRequest(request_id=served_id), metadata=KEY())
            again = await stub.Score(greedy_score(refused_id), metadata=KEY())
            assert again.greedy.target_token_ids == served.greedy.target_token_ids

    asyncio.run(main())


def test_a_session_says_its_sampling_once_and_a_replica_without_it_asks_for_a_rebuild():
    async def main():
        replica = await local_drafter()
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            sampled = propose("s")
            sampled.sampling.temperature = 1.0
            first = await stub.Propose(sampled, metadata=KEY())
            assert first.status == pb.OK and first.HasField("draft_probs")
            later = pb.ProposeRequest(request_id="s", num_speculative_tokens=3,
                                      sync=pb.PrefixSync(known_len=3, known_hash=prefix_hash(
                                          [5, 6, 7]), new_token_ids=[8]), seed=2)
            again = await stub.Propose(later, metadata=KEY())
            # the session's parameters (sampled: a q comes back), not the empty message's
            assert again.status == pb.OK and again.HasField("draft_probs")
            replica.sampling.forget("s")  # as if evicted: the cache is here, not the params
            assert "s" in replica.engine.sessions
            gone = await stub.Propose(later, metadata=KEY())
            assert gone.status == pb.REBUILD and not gone.token_ids

    asyncio.run(main())


def test_an_http_request_to_a_pool_is_a_404_in_openais_error_shape():
    answer = asyncio.run(VerifierPool.__call__(None, None))
    assert answer.status_code == 404
    assert "gRPC only" in json.loads(answer.body)["error"]["message"]


def test_an_http_request_to_a_pool_is_a_path_not_a_model():
    """A pool's route is a path the router does not serve, as the router's own 404s (code
    null: deployments.ingress.not_routed), not OpenAI's model_not_found for a model."""
    error = json.loads(asyncio.run(VerifierPool.__call__(None, None)).body)["error"]
    assert error["code"] is None and error["param"] is None

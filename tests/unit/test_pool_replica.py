"""A pool replica outside Serve: its own gRPC port, its worker thread, its load report."""

import asyncio
import threading

import grpc

from deployments.autoscaling import DIRECT_IN_FLIGHT
from deployments.pools import DrafterArgs, DrafterPool
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc


async def local_drafter():
    cls = DrafterPool.func_or_class
    replica = cls.__new__(cls)
    await cls.__init__(replica, DrafterArgs())
    return replica


def propose(request_id: str) -> pb.ProposeRequest:
    return pb.ProposeRequest(request_id=request_id, num_speculative_tokens=3,
                             sync=pb.PrefixSync(new_token_ids=[5, 6, 7]),
                             sampling=pb.SamplingParams(temperature=0))


async def until(condition, timeout_s: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def test_direct_calls_waiting_for_the_model_are_reported_as_load():
    async def main():
        replica = await local_drafter()
        channel = grpc.aio.insecure_channel(replica.address)
        stub = pb_grpc.DrafterStub(channel)
        gate = threading.Event()
        replica.worker.submit(gate.wait)  # the model is busy until the gate opens
        calls = [asyncio.ensure_future(stub.Propose(propose(f"r{i}"))) for i in range(3)]
        await until(lambda: replica.direct_in_flight == 3)
        assert replica.record_autoscaling_stats()[DIRECT_IN_FLIGHT] == 3.0
        gate.set()
        responses = await asyncio.gather(*calls)
        assert [len(r.token_ids) for r in responses] == [3, 3, 3]
        assert all(r.direct_address == replica.address and r.compute_us > 0 for r in responses)
        # the calls that waited for the busy model ran as one batch
        assert max(r.load.batch_size for r in responses) >= 2
        assert replica.record_autoscaling_stats()[DIRECT_IN_FLIGHT] == 0.0
        assert replica.direct_calls_served() == 3
        await channel.close()
        await replica.server.stop(None)

    asyncio.run(main())


def test_a_bad_direct_call_is_invalid_argument_and_not_left_in_flight():
    async def main():
        replica = await local_drafter()
        channel = grpc.aio.insecure_channel(replica.address)
        bad = propose("bad")
        bad.sync.new_token_ids[:] = [10**6]
        try:
            await pb_grpc.DrafterStub(channel).Propose(bad)
            raise AssertionError("a token id outside the vocabulary was accepted")
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "out of range" in error.details()
        assert replica.direct_in_flight == 0
        await channel.close()
        await replica.server.stop(None)

    asyncio.run(main())

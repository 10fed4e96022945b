"""The drafter and verifier pools: thin Serve deployments serving specserve.proto.

Serve's gRPC proxy calls the method named like the rpc with the decoded request message; each
replica also serves the same servicer methods on its own gRPC port (`direct_address` in every
answer), which the router uses once Serve has placed a request. A malformed request answers
INVALID_ARGUMENT; a call whose base the replica does not hold answers status REBUILD (the
router resends the whole prefix).
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
import torch
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from deployments import wire
from deployments.batcher import ContinuousBatcher
from deployments.metrics import PoolMetrics
from deployments.autoscaling import BATCH_OCCUPANCY, DIRECT_IN_FLIGHT, Occupancy
from drafter.registry import DrafterSpec, build_drafter
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from engine.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm
from speculative.types import StaleBase
from verifier.engine import ModelVerifier


class PoolArgs(BaseModel):
    """`applications[].args` of a pool app; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    torch_threads: int = 1  # match the replica's num_cpus
    max_cached_requests: int = 256
    # calls that share one forward: those arriving while the model is busy join the next
    max_batch_size: int = Field(default=32, ge=1, le=1024)


class DrafterArgs(PoolArgs):
    model: str = DEMO_DRAFT
    target: str = DEMO_TARGET  # the verifier's checkpoint: the vocabulary both pools agree on
    drafter: str = "model"  # a kind of drafter.registry.DRAFTERS
    # q as shipped (drafter.registry.DrafterSpec): top entries (0 = all), the fewest top
    # entries holding this mass (1 = all), precision
    draft_top_k: int = DrafterSpec.draft_top_k
    draft_q_mass: float = DrafterSpec.draft_q_mass
    draft_q_dtype: Literal["float32", "float16"] = DrafterSpec.draft_q_dtype
    ngram_min: int = 1
    ngram_max: int = 4

    def spec(self) -> DrafterSpec:
        return DrafterSpec(kind=self.drafter, model=self.model, target=self.target,
                           dtype=self.dtype, device=self.device,
                           max_cached_requests=self.max_cached_requests,
                           draft_top_k=self.draft_top_k, draft_q_mass=self.draft_q_mass,
                           draft_q_dtype=self.draft_q_dtype, ngram_min=self.ngram_min,
                           ngram_max=self.ngram_max)


class VerifierArgs(PoolArgs):
    model: str = DEMO_TARGET


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit tests)
        return "local"


def node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


async def serve_directly(servicer, add_to_server) -> tuple[grpc.aio.Server, str]:
    """Serve `servicer` on a free port of this node; returns (server, "host:port")."""
    import ray

    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    server = grpc.aio.server()
    add_to_server(servicer, server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, f"{host}:{port}"


def is_direct(grpc_context) -> bool:
    """Whether a call came over the replica's own port (not through Serve's proxy)."""
    return grpc_context is not None and not isinstance(grpc_context, RayServegRPCContext)


def refuse(grpc_context, error: Exception, response):
    if grpc_context is not None:
        grpc_context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
        grpc_context.set_details(str(error))
    return response


class PoolReplica:
    """What both pools share: the direct server, batching, answering a call, release,
    introspection.

    Calls, from Serve's proxy or the direct port alike, queue for the replica's batcher:
    whatever has arrived while the model was busy runs as one batch (one forward per step
    for all its calls, `engine.batch`), on one worker thread (the engine and its caches are
    single-threaded), so the event loop stays free for gRPC, health checks and metrics, and
    calls waiting for the model are visible as in flight.
    """

    engine = None  # set by the subclass before start()

    async def start(self, add_to_server, run_batch, max_batch_size: int, pool: str) -> None:
        """run_batch: the engine's list of calls -> list of answers (or their refusals)."""
        self.replica_id = replica_id()
        self.direct_calls = 0  # served over the replica's own port, ever
        self.direct_in_flight = 0  # the same, now: Serve's autoscaler cannot see these
        self.occupancy = Occupancy(max_batch_size)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine",
                                         initializer=torch.set_num_threads,
                                         initargs=(torch.get_num_threads(),))
        self.metrics = PoolMetrics(pool)

        async def in_batch(calls: list) -> list:
            self.occupancy.observe(len(calls))
            self.metrics.record_batch(len(calls), max_batch_size)
            return await self.on_worker(run_batch, calls)

        self.batcher = ContinuousBatcher(in_batch, max_batch_size)
        self.server, self.address = await serve_directly(self, add_to_server)

    async def on_worker(self, work, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, work, *args)

    async def answer(self, call_from_proto, request, to_proto, response_type, grpc_context):
        """to_proto(the call's answer in a batch); StaleBase -> REBUILD; ValueError ->
        INVALID_ARGUMENT."""
        direct = is_direct(grpc_context)
        self.direct_calls += direct
        self.direct_in_flight += direct
        try:
            result = await self.batcher.submit(call_from_proto(request))
        except ValueError as error:  # refused while decoding the message
            result = error
        finally:
            self.direct_in_flight -= direct
        if isinstance(result, StaleBase):
            response = response_type(status=pb.REBUILD)
        elif isinstance(result, ValueError):
            return refuse(grpc_context, result, response_type(replica_id=self.replica_id))
        else:
            response = to_proto(result)
        response.replica_id, response.direct_address = self.replica_id, self.address
        return response

    async def Release(self, request: pb.ReleaseRequest, grpc_context=None) -> pb.ReleaseResponse:
        released = request.request_id in self.engine.sessions
        await self.on_worker(self.engine.sessions.release, request.request_id)
        return pb.ReleaseResponse(released=released)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Load Serve cannot see (polled when the deployment has an autoscaling_config; the
        policy deployments.autoscaling:direct_aware_policy adds it to Serve's own count), and
        how full the replica's batches have been since the last poll."""
        return {DIRECT_IN_FLIGHT: float(self.direct_in_flight),
                BATCH_OCCUPANCY: self.occupancy.take()}

    def where(self) -> str:
        """The Ray node this replica runs on (for operators and placement tests)."""
        return node_id()

    def direct_calls_served(self) -> int:
        return self.direct_calls


@serve.deployment
class DrafterPool(PoolReplica):
    async def __init__(self, args: DrafterArgs) -> None:
        torch.set_num_threads(args.torch_threads)
        self.engine = build_drafter(args.spec())
        await self.start(pb_grpc.add_DrafterServicer_to_server, self.engine.propose_batch,
                         args.max_batch_size, "drafter")

    async def Propose(self, request: pb.ProposeRequest, grpc_context=None) -> pb.ProposeResponse:
        return await self.answer(wire.propose_from_proto, request, wire.block_to_proto,
                                 pb.ProposeResponse, grpc_context)


@serve.deployment
class VerifierPool(PoolReplica):
    async def __init__(self, args: VerifierArgs) -> None:
        torch.set_num_threads(args.torch_threads)
        self.engine = ModelVerifier(load_causal_lm(args.model, args.dtype, args.device),
                                    max_cached_requests=args.max_cached_requests)
        await self.start(pb_grpc.add_VerifierServicer_to_server, self.engine.score_batch,
                         args.max_batch_size, "verifier")

    async def Score(self, request: pb.ScoreRequest, grpc_context=None) -> pb.ScoreResponse:
        return await self.answer(wire.score_from_proto, request, wire.scores_to_proto,
                                 pb.ScoreResponse, grpc_context)

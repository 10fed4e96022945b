"""The drafter and verifier pools: thin Serve deployments serving specserve.proto.

Serve's gRPC proxy calls the method named like the rpc with the decoded request message. A
malformed request answers INVALID_ARGUMENT; a call whose base the replica does not hold
answers status REBUILD (the router resends the whole prefix).
"""

import grpc
import torch
from pydantic import BaseModel, ConfigDict
from ray import serve

from deployments import wire
from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from protos import specserve_pb2 as pb
from speculative.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm
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


class DrafterArgs(PoolArgs):
    model: str = DEMO_DRAFT
    drafter: str = "model"  # "model" or "ngram" (then `model` only names the vocabulary)
    draft_top_k: int = 0  # > 0: ship sparse draft distributions of this many entries
    ngram_min: int = 1
    ngram_max: int = 4


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


def refuse(grpc_context, error: Exception, response):
    if grpc_context is not None:
        grpc_context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
        grpc_context.set_details(str(error))
    return response


def build_drafter_engine(args: DrafterArgs):
    if args.drafter == "ngram":
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(args.model).vocab_size
        return NgramDrafter(vocab_size, min_ngram=args.ngram_min, max_ngram=args.ngram_max,
                            max_cached_requests=args.max_cached_requests)
    if args.drafter != "model":
        raise ValueError(f"drafter must be 'model' or 'ngram', got {args.drafter!r}")
    model = load_causal_lm(args.model, args.dtype, args.device)
    return ModelDrafter(model, max_cached_requests=args.max_cached_requests,
                        draft_top_k=args.draft_top_k)


@serve.deployment
class DrafterPool:
    def __init__(self, args: DrafterArgs) -> None:
        torch.set_num_threads(args.torch_threads)
        self.args = args
        self.engine = build_drafter_engine(args)
        self.replica_id = replica_id()

    async def Propose(self, request: pb.ProposeRequest, grpc_context=None) -> pb.ProposeResponse:
        try:
            call = wire.propose_from_proto(request)
            block = await self.engine.propose(call)
        except StaleBase:
            return pb.ProposeResponse(status=pb.REBUILD, replica_id=self.replica_id)
        except ValueError as error:
            return refuse(grpc_context, error, pb.ProposeResponse(replica_id=self.replica_id))
        response = wire.block_to_proto(block, sparse_k=self.args.draft_top_k)
        response.replica_id = self.replica_id
        return response

    async def Release(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        released = request.request_id in self.engine.sessions
        await self.engine.release(request.request_id)
        return pb.ReleaseResponse(released=released)

    def where(self) -> str:
        """The Ray node this replica runs on (for operators and placement tests)."""
        return node_id()


@serve.deployment
class VerifierPool:
    def __init__(self, args: VerifierArgs) -> None:
        torch.set_num_threads(args.torch_threads)
        self.engine = ModelVerifier(load_causal_lm(args.model, args.dtype, args.device),
                                    max_cached_requests=args.max_cached_requests)
        self.replica_id = replica_id()

    async def Score(self, request: pb.ScoreRequest, grpc_context=None) -> pb.ScoreResponse:
        try:
            call = wire.score_from_proto(request)
            scores = await self.engine.score(call)
        except StaleBase:
            return pb.ScoreResponse(status=pb.REBUILD, replica_id=self.replica_id)
        except ValueError as error:
            return refuse(grpc_context, error, pb.ScoreResponse(replica_id=self.replica_id))
        response = wire.scores_to_proto(scores)
        response.replica_id = self.replica_id
        return response

    async def Release(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        released = request.request_id in self.engine.sessions
        await self.engine.release(request.request_id)
        return pb.ReleaseResponse(released=released)

    def where(self) -> str:
        """The Ray node this replica runs on (for operators and placement tests)."""
        return node_id()

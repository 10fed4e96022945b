"""What a pool replica says of itself (its id, where it runs, its load and memory, its
sessions) and how it refuses a call (a gRPC status and its details)."""

import os

import grpc
from ray import serve
from starlette.responses import JSONResponse

from deployments.autoscaling import BATCH_OCCUPANCY, DIRECT_IN_FLIGHT
from deployments.metrics import rss_mb
from deployments.responses import error_body
from protos import specserve_pb2 as pb


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit tests)
        return "local"


def placement(model) -> dict:
    """Where this process runs: its Ray node, the GPUs Ray assigned it (Ray sets
    CUDA_VISIBLE_DEVICES to them) and the device of its model (None: a drafter without one)."""
    import ray

    return {"node": ray.get_runtime_context().get_node_id(),
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device": None if model is None else str(model.device)}


def refuse(grpc_context, error, response,
           code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(str(error))
    return response


def unauthenticated(grpc_context, response):
    return refuse(grpc_context, "this pool serves the router only", response,
                  grpc.StatusCode.UNAUTHENTICATED)


class ReplicaReports:
    """A pool replica's answers to Serve (its autoscaling stats, an HTTP request), to
    operators and to tests (where it runs, its memory and sessions); deployments.pools'
    PoolReplica keeps what they read."""

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Load Serve cannot see (polled when the deployment has an autoscaling_config; the
        policy deployments.autoscaling:direct_aware_policy adds it to Serve's own count), and
        how full the replica's batches have been since the last poll. A coroutine: Serve runs
        it on the replica's event loop, where the batches are counted (a plain method runs on
        Serve's thread pool, and its take() could lose a batch counted meanwhile). The
        direct calls' gauge is set to the count reported."""
        in_flight = self.direct_in_flight
        self.metrics.record_direct_calls(in_flight)
        return {DIRECT_IN_FLIGHT: float(in_flight), BATCH_OCCUPANCY: self.occupancy.take()}

    async def __call__(self, request) -> JSONResponse:
        """An HTTP request to the pool's application (its route_prefix, by which Serve's gRPC
        proxy routes calls too): 404 in OpenAI's error shape, where Serve answered 500 and
        logged a traceback (a pool serves gRPC only). A path, not a model: code null, as
        the router's own 404 for a path (not model_not_found)."""
        body = error_body("a specserve pool serves gRPC only: send HTTP requests to the "
                          "router", 404)
        body["error"]["code"] = None
        return JSONResponse(body, 404)

    def where(self) -> dict:
        """Where this replica runs (`placement`), for operators and placement tests."""
        return placement(getattr(self.engine, "model", None))

    def direct_calls_served(self) -> int:
        return self.direct_calls

    def memory(self) -> dict:
        """This replica's resident memory (MB) and cached sessions (for the soak)."""
        return {"rss_mb": rss_mb(), "sessions": len(self.engine.sessions)}

    def session_ids(self) -> list[str]:
        """The requests whose caches this replica holds (for operators and tests)."""
        return list(self.engine.sessions)


class Unserved:
    """specserve.proto's rpcs, each UNIMPLEMENTED unless the class serves it itself (a
    pool's own rpcs are its subclass's methods). Serve's gRPC proxy routes every rpc of the
    .proto to the application the call's `application` metadata names, by the rpc's name: a
    Score sent to the drafter (or any rpc to the router) found no such method, and the proxy
    answered INTERNAL with the replica's traceback, to any caller (before the pool key is
    read). A replica's own port serves its pool's service only."""

    serves = "this application"  # what the refusal names

    def unserved(self, grpc_context, rpc: str, response):
        return refuse(grpc_context, f"{self.serves} does not serve {rpc}: name the application "
                      "that does in the call's `application` metadata", response,
                      grpc.StatusCode.UNIMPLEMENTED)

    async def Propose(self, request, grpc_context=None) -> pb.ProposeResponse:
        return self.unserved(grpc_context, "Propose", pb.ProposeResponse())

    async def Score(self, request, grpc_context=None) -> pb.ScoreResponse:
        return self.unserved(grpc_context, "Score", pb.ScoreResponse())

    async def PromptLogprobs(self, request, grpc_context=None) -> pb.PromptLogprobsResponse:
        return self.unserved(grpc_context, "PromptLogprobs", pb.PromptLogprobsResponse())

    async def Release(self, request, grpc_context=None) -> pb.ReleaseResponse:
        return self.unserved(grpc_context, "Release", pb.ReleaseResponse())

    async def ProposeStream(self, batches, grpc_context=None):
        self.unserved(grpc_context, "ProposeStream", None)
        yield pb.ProposeAnswers()  # the proxy applies a context's status with a message only

    async def ScoreStream(self, batches, grpc_context=None):
        self.unserved(grpc_context, "ScoreStream", None)
        yield pb.ScoreAnswers()  # the proxy applies a context's status with a message only

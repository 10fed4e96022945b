"""What a pool replica says of itself (its id, where it runs) and how it refuses a call
(a gRPC status and its details)."""

import os

import grpc
from ray import serve


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

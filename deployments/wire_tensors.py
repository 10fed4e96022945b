"""Tensors and draft distributions as specserve.proto's Tensor and Distributions messages
(deployments.wire's parts that carry torch tensors), checked as they are decoded."""

import numpy as np
import torch

from protos import specserve_pb2 as pb
from speculative.types import DraftDists

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def tensor_to_proto(tensor: torch.Tensor) -> pb.Tensor:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype on the wire: {tensor.dtype}")
    # view as bytes: works for bfloat16, which numpy cannot represent (a 0-dim tensor has no
    # byte view: it is viewed as one element; a reshape of every tensor costs a microsecond)
    flat = tensor if tensor.dim() else tensor.reshape(1)
    data = flat.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return pb.Tensor(data=data, dtype=DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape))


def tensor_from_proto(message: pb.Tensor) -> torch.Tensor:
    if message.dtype not in DTYPES:
        raise ValueError(f"unsupported tensor dtype {message.dtype!r}")
    dtype = DTYPES[message.dtype]
    shape = tuple(message.shape)
    expected = torch.Size(shape).numel() * dtype.itemsize
    if len(message.data) != expected:
        raise ValueError(f"tensor of shape {shape} and dtype {message.dtype} needs "
                         f"{expected} bytes, got {len(message.data)}")
    if not expected:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(message.data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def dists_to_proto(dists: DraftDists) -> pb.Distributions:
    """q as the drafter shipped it: its weights (float32 or float16) and, when sparse, its ids,
    bit for bit (the drafter chose the smaller form; a router forwards what it received)."""
    weights = dists.weights
    if weights.dtype not in (torch.float32, torch.float16):
        weights = weights.float()
    message = pb.Distributions(probs=tensor_to_proto(weights), vocab_size=dists.vocab_size)
    if dists.ids is not None:
        message.ids.CopyFrom(tensor_to_proto(dists.ids.to(torch.int32)))
    return message


def dists_from_proto(message: pb.Distributions) -> DraftDists:
    """The DraftDists a message carries, checked (finite, non-negative weights; ids in the
    vocabulary and shaped like the weights) and left in its form: nothing is densified."""
    weights = tensor_from_proto(message.probs)
    if weights.dtype not in (torch.float32, torch.float16) or weights.dim() != 2:
        raise ValueError("distributions must be [positions, entries] float32 or float16")
    # checked through numpy's view of the same memory: a few dozen entries cost numpy about
    # 1 us an operation against torch's 5-10 (measured: the whole decode 53 -> 23 us)
    values = weights.numpy()
    if not (np.isfinite(values).all() and (values >= 0).all()):
        raise ValueError("draft probabilities must be finite and non-negative")
    ids = None
    if message.HasField("ids"):
        ids = tensor_from_proto(message.ids)
        if ids.dtype not in (torch.int32, torch.int64) or ids.shape != weights.shape or (
                ids.numel() and not 0 <= ids.numpy().min() <= ids.numpy().max()
                < message.vocab_size):
            raise ValueError("sparse distribution ids out of range or shaped unlike probs")
    return DraftDists(weights, ids, message.vocab_size)

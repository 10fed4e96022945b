"""Edges of the tensors on the wire (deployments.wire_tensors): a Tensor whose bytes are more
than its shape and dtype need is refused as one with too few is."""

import pytest
import torch

from deployments.wire_tensors import tensor_from_proto, tensor_to_proto


@pytest.mark.parametrize("extra", [-4, 4])
def test_a_tensors_bytes_must_be_exactly_what_its_shape_needs(extra):
    message = tensor_to_proto(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    message.data = message.data[:extra] if extra < 0 else message.data + bytes(extra)
    with pytest.raises(ValueError, match="needs 24 bytes"):
        tensor_from_proto(message)

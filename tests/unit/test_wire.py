"""Round trips between the loop's dataclasses and the protobuf messages."""

import pytest
import torch

from deployments import wire
from protos import specserve_pb2 as pb
from speculative.sampling import SamplingParams, truncate_top_k
from speculative.types import DraftBlock, PrefixSync, ProposeCall, ScoreCall, TargetScores


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_tensors_round_trip_bit_exactly(dtype):
    tensor = (torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    back = wire.tensor_from_proto(pb.Tensor.FromString(wire.tensor_to_proto(tensor).SerializeToString()))
    assert back.dtype == dtype and torch.equal(back, tensor)


def test_a_tensor_whose_bytes_do_not_match_its_shape_is_rejected():
    with pytest.raises(ValueError, match="needs 24 bytes"):
        wire.tensor_from_proto(pb.Tensor(data=b"\0" * 8, dtype="float32", shape=[2, 3]))
    with pytest.raises(ValueError, match="dtype"):
        wire.tensor_from_proto(pb.Tensor(data=b"", dtype="complex64", shape=[0]))


def test_truncated_distributions_travel_sparse_and_full_ones_dense():
    probs = truncate_top_k(torch.softmax(torch.randn(4, 100), -1), 8)
    message = wire.dists_to_proto(probs)
    assert message.HasField("ids") and list(message.probs.shape) == [4, 8]
    torch.testing.assert_close(wire.dists_from_proto(message), probs)
    one_hot = torch.nn.functional.one_hot(torch.tensor([3, 7]), 128_000).float()
    message = wire.dists_to_proto(one_hot)
    assert message.ByteSize() < 100 and torch.equal(wire.dists_from_proto(message), one_hot)
    full = torch.softmax(torch.randn(2, 100), -1)
    message = wire.dists_to_proto(full)
    assert not message.HasField("ids") and torch.equal(wire.dists_from_proto(message), full)


def test_calls_and_results_round_trip():
    sampling = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    sync = PrefixSync(3, 12345678901234567890, (4, 5))
    propose = ProposeCall("r1", sync, 4, sampling, seed=2**62)
    message = pb.ProposeRequest.FromString(wire.propose_to_proto(propose).SerializeToString())
    assert wire.propose_from_proto(message) == propose
    score = ScoreCall("r1", sync, (1, 2, 3), sampling)
    assert wire.score_from_proto(wire.score_to_proto(score)) == score
    q = truncate_top_k(torch.softmax(torch.randn(3, 50), -1), 4)
    back = wire.score_from_proto(wire.score_to_proto(ScoreCall("r", sync, (1, 2, 3), sampling, q, 9)))
    assert back.seed == 9 and torch.equal(back.draft_probs, q)

    block = DraftBlock((1, 2), torch.softmax(torch.randn(2, 10), -1))
    back = wire.block_from_proto(wire.block_to_proto(block))
    assert back.token_ids == block.token_ids and torch.equal(back.draft_probs, block.draft_probs)
    greedy = TargetScores(target_token_ids=(3, 4, 5))
    assert wire.scores_from_proto(wire.scores_to_proto(greedy)) == greedy
    drawn = TargetScores(draft_target_probs=(0.5, 0.25), recovered_token_ids=(7, 0),
                         bonus_token_id=0)
    assert wire.scores_from_proto(wire.scores_to_proto(drawn)) == drawn


def test_invalid_sampling_on_the_wire_is_a_value_error():
    with pytest.raises(ValueError, match="temperature"):
        wire.sampling_from_proto(pb.SamplingParams(temperature=-1, top_p=1))


def test_half_precision_distributions_travel_bit_exactly_and_sparse_when_smaller():
    from speculative.sampling import truncate_mass

    probs = torch.softmax(3 * torch.randn(3, 4096, generator=torch.Generator().manual_seed(1)), -1)
    half = truncate_mass(probs, 0.9).half()
    message = wire.dists_to_proto(half)
    assert message.HasField("ids") and message.probs.dtype == "float16"
    back = wire.dists_from_proto(pb.Distributions.FromString(message.SerializeToString()))
    assert back.dtype == torch.float16 and torch.equal(back, half)
    assert message.ByteSize() < 6.5 * int((half > 0).sum(-1).max()) * 3 + 100
    dense = probs.half()  # every entry non-zero: 2 bytes an entry beats 6
    message = wire.dists_to_proto(dense)
    assert not message.HasField("ids") and torch.equal(wire.dists_from_proto(message), dense)

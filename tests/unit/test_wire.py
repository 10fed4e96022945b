"""Round trips between the loop's dataclasses and the protobuf messages."""

import pytest
import torch

from deployments import wire, wire_tensors
from protos import specserve_pb2 as pb
from speculative.accept import accept
from speculative.draft_truncation import kept_entries
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.sampling import SamplingParams
from speculative.types import (
    DraftBlock,
    DraftDists,
    PrefixSync,
    ProposeCall,
    ScoreCall,
    StaleBase,
    TargetScores,
)


def truncated_q(positions: int, vocab_size: int, top_k: int = 0, mass: float = 1.0,
                dtype=torch.float32, seed: int = 0) -> DraftDists:
    """q as a truncating drafter ships it: kept entries per position, sparse."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(positions, vocab_size, generator=generator), -1)
    rows = [kept_entries(row, top_k, mass) for row in probs]
    return DraftDists.stack([((v / v.sum()).to(dtype), ids) for v, ids in rows], vocab_size)


def same_q(a: DraftDists, b: DraftDists) -> bool:
    """The same form, ids and weights, bit for bit."""
    same_ids = a.ids is None and b.ids is None or a.ids is not None and b.ids is not None \
        and torch.equal(a.ids.long(), b.ids.long())
    return same_ids and a.vocab_size == b.vocab_size and a.weights.dtype == b.weights.dtype \
        and torch.equal(a.weights, b.weights)


@pytest.mark.parametrize("shape", [(3, 5), ()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_tensors_round_trip_bit_exactly(dtype, shape):
    tensor = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    sent = wire_tensors.tensor_to_proto(tensor).SerializeToString()
    back = wire_tensors.tensor_from_proto(pb.Tensor.FromString(sent))
    assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(back, tensor)


def test_a_tensor_whose_bytes_do_not_match_its_shape_is_rejected():
    with pytest.raises(ValueError, match="needs 24 bytes"):
        wire_tensors.tensor_from_proto(pb.Tensor(data=b"\0" * 8, dtype="float32", shape=[2, 3]))
    with pytest.raises(ValueError, match="needs 24 bytes"):  # more than it needs, as refused
        wire_tensors.tensor_from_proto(pb.Tensor(data=b"\0" * 28, dtype="float32", shape=[2, 3]))
    with pytest.raises(ValueError, match="dtype"):
        wire_tensors.tensor_from_proto(pb.Tensor(data=b"", dtype="complex64", shape=[0]))


def test_an_empty_tensor_keeps_its_shape_and_a_dtype_the_wire_lacks_is_a_value_error():
    """A tensor of no elements travels as no bytes in its own shape; one of a dtype the wire
    has no name for is refused as it is sent, a ValueError naming it."""
    back = wire_tensors.tensor_from_proto(wire_tensors.tensor_to_proto(torch.ones(0, 4)))
    assert back.shape == (0, 4) and back.dtype == torch.float32
    with pytest.raises(ValueError, match="unsupported dtype on the wire"):
        wire_tensors.tensor_to_proto(torch.zeros(2, dtype=torch.uint8))


def test_distributions_travel_in_the_form_they_were_shipped_in():
    q = truncated_q(4, 100, top_k=8)
    message = wire_tensors.dists_to_proto(q)
    assert message.HasField("ids") and list(message.probs.shape) == [4, 8]
    assert same_q(wire_tensors.dists_from_proto(message), q)
    one_hot = DraftDists(torch.ones(2, 1), torch.tensor([[3], [7]]), 128_000)  # n-gram q
    message = wire_tensors.dists_to_proto(one_hot)
    assert message.ByteSize() < 100 and same_q(wire_tensors.dists_from_proto(message), one_hot)
    full = DraftDists.from_dense(torch.softmax(torch.randn(2, 100), -1))
    message = wire_tensors.dists_to_proto(full)
    assert not message.HasField("ids") and same_q(wire_tensors.dists_from_proto(message), full)


def test_a_received_q_is_checked_and_stays_sparse():
    q = truncated_q(3, 50, top_k=4)
    back = wire_tensors.dists_from_proto(wire_tensors.dists_to_proto(q))
    assert back.weights.shape == (3, 4) and back.ids.shape == (3, 4)
    for name, edit, match in [
        ("id past the vocabulary", lambda m: m.ids.CopyFrom(wire_tensors.tensor_to_proto(
            torch.full((3, 4), 50, dtype=torch.int32))), "ids out of range"),
        ("negative weight", lambda m: m.probs.CopyFrom(wire_tensors.tensor_to_proto(
            -torch.ones(3, 4))), "non-negative"),
        ("NaN weight", lambda m: m.probs.CopyFrom(wire_tensors.tensor_to_proto(
            torch.full((3, 4), float("nan")))), "finite"),
        ("ids unlike weights", lambda m: m.ids.CopyFrom(wire_tensors.tensor_to_proto(
            torch.zeros(3, 5, dtype=torch.int32))), "shaped unlike"),
        ("float ids", lambda m: m.ids.CopyFrom(wire_tensors.tensor_to_proto(
            torch.zeros(3, 4))), "ids out of range"),
        ("dense row too short", lambda m: m.ClearField("ids"), "entries per position"),
    ]:
        message = wire_tensors.dists_to_proto(q)
        edit(message)
        with pytest.raises(ValueError, match=match):
            wire_tensors.dists_from_proto(message)


def test_a_bfloat16_q_travels_as_float32_an_empty_sparse_q_passes_and_inf_is_refused():
    """q's weights go as float32 unless float16 (bfloat16 weights, which a receiver refuses,
    a ValueError); ids as int32 or int64; a q of no positions with ids passes (no range to
    read); an infinite weight is refused."""
    q = truncated_q(2, 50, top_k=4, dtype=torch.bfloat16)
    message = wire_tensors.dists_to_proto(q)
    assert message.probs.dtype == "float32"
    assert torch.equal(wire_tensors.dists_from_proto(message).weights, q.weights.float())
    wide = wire_tensors.dists_to_proto(q)
    wide.ids.CopyFrom(wire_tensors.tensor_to_proto(q.ids.long()))  # int64 ids: taken too
    assert wire_tensors.dists_from_proto(wide).ids.dtype == torch.int64
    empty = DraftDists(torch.ones(0, 4), torch.zeros(0, 4, dtype=torch.int32), 50)
    assert same_q(wire_tensors.dists_from_proto(wire_tensors.dists_to_proto(empty)), empty)
    message.probs.CopyFrom(wire_tensors.tensor_to_proto(torch.full((2, 4), float("inf"))))
    with pytest.raises(ValueError, match="finite"):
        wire_tensors.dists_from_proto(message)
    message.probs.CopyFrom(wire_tensors.tensor_to_proto(q.weights))  # sent as bfloat16
    with pytest.raises(ValueError, match="float32 or float16"):
        wire_tensors.dists_from_proto(message)


def test_the_router_forwards_q_without_building_a_dense_one(monkeypatch):
    """Drafter -> router -> verifier: the ids and values the drafter wrote reach the verifier
    bit for bit, and the router reads q_i(x_i) by gathering: no [K, V] tensor on its path."""
    def no_dense(self, device=None):
        raise AssertionError("the router built a dense q")

    q = truncated_q(4, 128_000, mass=0.9, dtype=torch.float16, seed=3)
    drafted = tuple(int(ids[0]) for ids in q.ids)
    proposed = pb.ProposeResponse.FromString(
        wire.block_to_proto(DraftBlock(drafted, q)).SerializeToString())
    monkeypatch.setattr(DraftDists, "dense", no_dense)
    block = wire.block_from_proto(proposed)  # the router's side
    sync = PrefixSync(0, 0, (1, 2))
    score = wire.score_to_proto(ScoreCall("r", sync, drafted, SamplingParams(),
                                          block.draft_probs, seed=1))
    scores = TargetScores(draft_target_probs=(1.0,) * 4, recovered_token_ids=(0,) * 4,
                          bonus_token_id=5)
    outcome, _ = accept(block, scores, False, torch.Generator().manual_seed(0))
    assert outcome.num_accepted == 4  # p = 1 >= q everywhere
    assert block.draft_probs.weights.shape == q.weights.shape
    assert score.draft_probs.ids.data == proposed.draft_probs.ids.data
    assert score.draft_probs.probs == proposed.draft_probs.probs
    assert same_q(wire.score_from_proto(score).draft_probs, q)


def test_calls_and_results_round_trip():
    sampling = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
                              presence_penalty=0.5, frequency_penalty=-0.25,
                              repetition_penalty=1.2, logit_bias=((2, -1.5), (7, 3.0)),
                              min_tokens=3, min_tokens_end_ids=(0, 5), cache_salt="t-a")
    sync = PrefixSync(3, 12345678901234567890, (4, 5))
    propose = ProposeCall("r1", sync, 4, sampling, seed=2**62)
    message = pb.ProposeRequest.FromString(wire.propose_to_proto(propose).SerializeToString())
    # a call within a session leaves the sampling parameters to the session's
    assert not message.HasField("sampling")
    assert wire.propose_from_proto(message, sampling) == propose
    start = ProposeCall("r1", PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3)), 4, sampling, seed=1)
    message = pb.ProposeRequest.FromString(wire.propose_to_proto(start).SerializeToString())
    assert message.HasField("sampling") and wire.propose_from_proto(message) == start
    score = ScoreCall("r1", sync, (1, 2, 3), sampling)
    assert wire.score_from_proto(wire.score_to_proto(score), sampling) == score
    start = ScoreCall("r1", PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3)), (4,), sampling)
    assert wire.score_from_proto(wire.score_to_proto(start)) == start
    q = truncated_q(3, 50, top_k=4)
    back = wire.score_from_proto(
        wire.score_to_proto(ScoreCall("r", sync, (1, 2, 3), sampling, q, 9)), sampling)
    assert back.seed == 9 and same_q(back.draft_probs, q)

    block = DraftBlock((1, 2), DraftDists.from_dense(torch.softmax(torch.randn(2, 10), -1)))
    back = wire.block_from_proto(wire.block_to_proto(block))
    assert back.token_ids == block.token_ids and same_q(back.draft_probs, block.draft_probs)
    greedy = TargetScores(target_token_ids=(3, 4, 5))
    assert wire.scores_from_proto(wire.scores_to_proto(greedy)) == greedy
    drawn = TargetScores(draft_target_probs=(0.5, 0.25), recovered_token_ids=(7, 0),
                         bonus_token_id=0)
    assert wire.scores_from_proto(wire.scores_to_proto(drawn)) == drawn


def test_invalid_sampling_on_the_wire_is_a_value_error():
    with pytest.raises(ValueError, match="temperature"):
        wire.sampling_from_proto(pb.SamplingParams(temperature=-1, top_p=1))


def test_half_precision_distributions_travel_bit_exactly_in_their_form():
    half = truncated_q(3, 4096, mass=0.9, dtype=torch.float16, seed=1)
    message = wire_tensors.dists_to_proto(half)
    assert message.HasField("ids") and message.probs.dtype == "float16"
    back = wire_tensors.dists_from_proto(pb.Distributions.FromString(message.SerializeToString()))
    assert same_q(back, half) and back.weights.dtype == torch.float16
    assert message.ByteSize() < 6 * half.weights.numel() + 100  # 4 bytes an id, 2 a weight
    dense = DraftDists.from_dense(torch.softmax(torch.randn(3, 4096), -1).half())
    message = wire_tensors.dists_to_proto(dense)
    assert not message.HasField("ids") and same_q(wire_tensors.dists_from_proto(message), dense)


def test_a_session_keeps_its_sampling_parameters_and_forgets_the_oldest():
    held = wire.SessionSampling(capacity=2)
    start = wire.score_to_proto(ScoreCall("a", PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2)), (),
                                          SamplingParams(temperature=0.5, top_k=3)))
    later = wire.score_to_proto(ScoreCall("a", PrefixSync(2, 7, ()), (3,),
                                          SamplingParams(temperature=0.5, top_k=3)))
    assert not later.HasField("sampling")
    with pytest.raises(StaleBase):  # never started here: the router resends the prefix
        held.of(later)
    assert held.of(start) == SamplingParams(temperature=0.5, top_k=3)
    assert held.of(later) == SamplingParams(temperature=0.5, top_k=3)
    for other in ("b", "c"):  # two newer sessions: "a" is the least recently used
        held.of(pb.ScoreRequest(request_id=other, sampling=pb.SamplingParams()))
    with pytest.raises(StaleBase):
        held.of(later)
    held.forget("c")
    assert len(held) == 1
    with pytest.raises(ValueError):  # validated when they arrive
        held.of(pb.ScoreRequest(request_id="d", sampling=pb.SamplingParams(temperature=-1)))


def test_draft_trees_round_trip():
    """A tree's width, parents, per-node q rows and sampled scores cross the wire; a chain
    stays a chain (no parents), and parents that make no tree are refused."""
    sampling = SamplingParams(temperature=1.0)
    sync = PrefixSync(0, 0, (4, 5))
    propose = ProposeCall("r1", sync, 2, sampling, seed=3, tree_width=3, tree_nodes=5)
    assert wire.propose_from_proto(pb.ProposeRequest.FromString(
        wire.propose_to_proto(propose).SerializeToString())) == propose
    chain = ProposeCall("r1", sync, 2, sampling, seed=3)
    assert wire.propose_from_proto(wire.propose_to_proto(chain)).tree_width == 1
    q = DraftDists.from_dense(torch.full((4, 8), 0.125))
    block = DraftBlock((1, 2, 3, 4), q, parents=(-1, 0, -1, -1))
    back = wire.block_from_proto(pb.ProposeResponse.FromString(
        wire.block_to_proto(block).SerializeToString()))
    assert (back.token_ids, back.parents) == (block.token_ids, block.parents)
    assert wire.block_from_proto(wire.block_to_proto(DraftBlock((1, 2), None))).parents is None
    score = ScoreCall("r1", sync, block.token_ids, sampling, q, seed=5,
                      draft_parents=block.parents)
    assert wire.score_from_proto(wire.score_to_proto(score)).draft_parents == block.parents
    scores = TargetScores(accept_probs=(0.5, 1.0, 0.25, 0.0), recovered_token_ids=(7,) * 5)
    got = wire.scores_from_proto(wire.scores_to_proto(scores))
    assert (got.accept_probs, got.recovered_token_ids, got.bonus_token_id) == \
        (scores.accept_probs, scores.recovered_token_ids, None)
    with pytest.raises(ValueError, match="parent"):
        wire.block_from_proto(wire.block_to_proto(DraftBlock((1, 2), None, parents=(-1, 1))))


@pytest.mark.parametrize("cut", [None, 0.0, 0.25])
def test_a_draft_confidence_and_the_reported_confidences_round_trip(cut):
    """Unset stays unset (the pool's own), 0 stays 0 (no cut); confidences travel as float32."""
    call = ProposeCall("r1", PrefixSync(0, 0, (4, 5)), 3, SamplingParams(), seed=1,
                       draft_confidence=cut)
    assert wire.propose_from_proto(pb.ProposeRequest.FromString(
        wire.propose_to_proto(call).SerializeToString())) == call
    block = DraftBlock((1, 2, 3), None, confidences=(0.5, 0.25, 0.125))
    back = wire.block_from_proto(pb.ProposeResponse.FromString(
        wire.block_to_proto(block).SerializeToString()))
    assert back.confidences == block.confidences
    assert wire.block_from_proto(wire.block_to_proto(DraftBlock((1,), None))).confidences is None


@pytest.mark.parametrize("full", [False, True])
def test_a_full_draft_context_is_said_on_the_wire(full):
    """The drafter's word that its context is full reaches the router (which then stops
    calling it for the request: test_draft_fallback)."""
    back = wire.block_from_proto(pb.ProposeResponse.FromString(
        wire.block_to_proto(DraftBlock((), None, context_full=full)).SerializeToString()))
    assert back.context_full is full


@pytest.mark.parametrize("bad", [(0.5,), (0.5, 0.25, 0.1, 0.05), (0.5, float("nan"), 0.1),
                                 (0.5, 1.5, 0.1)])
def test_reported_confidences_that_do_not_fit_the_chain_are_refused(bad):
    message = wire.block_to_proto(DraftBlock((1, 2, 3), None, confidences=bad))
    with pytest.raises(ValueError, match="confidence"):
        wire.block_from_proto(message)
    tree = DraftBlock((1, 2, 3), None, parents=(-1, 0, -1), confidences=(0.5, 0.25))
    assert wire.block_from_proto(wire.block_to_proto(tree)).confidences == (0.5, 0.25)


def test_calls_of_several_steps_round_trip():
    sync = PrefixSync(3, 12345678901234567890, (4, 5))
    call = ScoreCall("r1", sync, (), SamplingParams(), seed=3, steps=6, stop_token_ids=(2, 9))
    assert wire.score_from_proto(wire.score_to_proto(call), SamplingParams()) == call
    one = ScoreCall("r1", sync, (), SamplingParams(), stop_token_ids=(2,))
    message = wire.score_to_proto(one)  # one step: neither field on the wire
    assert message.steps == 0 and not message.stop_token_ids
    assert wire.score_from_proto(message, SamplingParams()).steps == 1
    for scores in (TargetScores(target_token_ids=(3,), continued_token_ids=(4, 5)),
                   TargetScores(recovered_token_ids=(), bonus_token_id=7,
                                continued_token_ids=(1,))):
        assert wire.scores_from_proto(wire.scores_to_proto(scores)) == scores


def test_a_pool_call_is_refused_exactly_past_its_context_and_k():
    """deployments.limits: a prefix plus draft of the whole context and K at its bound are
    taken; one token more, one draft token more or K one more are INVALID_ARGUMENT."""
    from deployments.limits import Limits, check_request

    limits = Limits(vocab_size=16, context=8, max_speculative_tokens=3)

    def check(committed: int, drafted: int, k: int) -> None:
        check_request("r", pb.PrefixSync(new_token_ids=[1] * committed), [2] * drafted, k,
                      limits)

    check(5, 3, 3)
    for committed, drafted, k in ((6, 3, 3), (4, 4, 3), (4, 0, 4)):
        with pytest.raises(ValueError):
            check(committed, drafted, k)


def test_the_first_calls_of_choices_sharing_a_prompt_make_its_message_once(monkeypatch):
    """Calls whose whole-prefix syncs share one tuple (a request's choices: their prompt)
    copy one message of its ids, made once, instead of making it each (128 choices of a
    128k-token prompt, two calls each: 1.1 s of the router's loop); every message is the
    one made from scratch, byte for byte. A tuple of equal ids, or a sync that builds on a
    known prefix, gets its own."""
    made = []
    real = pb.PrefixSync

    def counting(*args, **fields):
        made.append(len(fields.get("new_token_ids", ())))
        return real(*args, **fields)

    monkeypatch.setattr(wire, "SHARED_SYNCS", wire.SharedSyncs())
    prompt = tuple(range(1, 5001))
    sync = PrefixSync(0, EMPTY_PREFIX_HASH, prompt)
    monkeypatch.setattr(pb, "PrefixSync", counting)
    messages = []
    for index in range(4):
        greedy = SamplingParams(temperature=0.0)
        messages.append(wire.propose_to_proto(ProposeCall(f"r-{index}", sync, 0, greedy, 0)))
        messages.append(wire.score_to_proto(ScoreCall(f"r-{index}", sync, (), greedy, None, 0,
                                                      len(prompt))))
    assert sum(n for n in made if n == len(prompt)) == len(prompt)  # once, not 8 times
    monkeypatch.setattr(pb, "PrefixSync", real)
    whole = real(known_len=0, known_hash=EMPTY_PREFIX_HASH, new_token_ids=prompt)
    for message in messages:
        assert message.sync.SerializeToString() == whole.SerializeToString()
    assert wire.sync_from_proto(messages[-1].sync) == sync
    built_on = PrefixSync(5, 123, prompt)
    assert wire.sync_to_proto(built_on) == real(known_len=5, known_hash=123,
                                                new_token_ids=prompt)
    assert wire.SHARED_SYNCS.ids(tuple(prompt[:-1]) + prompt[-1:]) is not \
        wire.SHARED_SYNCS.ids(prompt)


def test_shared_syncs_hold_the_last_few_long_prompts_only():
    shared = wire.SharedSyncs(capacity=2, min_tokens=3)
    assert shared.ids((1, 2)) is None  # short: made in place
    prompts = [(i, 2, 3) for i in range(3)]
    first = shared.ids(prompts[0])
    assert shared.ids(prompts[0]) is first
    shared.ids(prompts[1]), shared.ids(prompts[2])
    assert len(shared.held) == 2 and shared.ids(prompts[0]) is not first
    assert list(shared.ids(prompts[2]).new_token_ids) == [2, 2, 3]


def test_both_pools_see_one_admission_stamp_for_a_request_rebuilds_included():
    """Each pool numbering its own admissions, two requests could get opposite orders in the
    two pools, and each pool keep for the newer what the other's older waited for (under KV
    pressure an idle session gives its units only to older requests): the router stamps a
    request once, and every sync of both its views carries the stamp, a rebuild's too."""
    from speculative.state import Request, RequestState

    state = RequestState(Request("r", (5, 6, 7), SamplingParams(max_tokens=4)))
    views = (state.drafter_view, state.verifier_view)
    first = [wire.sync_from_proto(wire.sync_to_proto(view.prefix_sync([5, 6, 7], (5, 6, 7))))
             for view in views]
    assert first[0].admitted_at == first[1].admitted_at > 0
    views[0].confirm(3, 1)
    later = views[0].prefix_sync([5, 6, 7, 8])
    views[0].forget()  # a rebuild resends the whole prefix, with the same stamp
    assert later.admitted_at == views[0].prefix_sync([5, 6, 7, 8]).admitted_at \
        == first[0].admitted_at

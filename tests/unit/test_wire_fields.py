"""Fields the round trips of test_wire leave at their defaults, and the checks a decoded
answer must pass: each would otherwise be lost, or let through, without a test noticing."""

import pytest
import torch

from deployments import wire
from protos import specserve_pb2 as pb
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.sampling import SamplingParams, draft_law
from speculative.types import (
    DraftBlock,
    DraftDists,
    PositionLogprobs,
    PrefixSync,
    ProposeCall,
    TargetScores,
)


def through_the_wire(message):
    return type(message).FromString(message.SerializeToString())


def test_a_pre_drafts_assumed_tokens_reach_the_drafter():
    """Lost, the drafter drafts after the committed prefix: tokens for other positions."""
    call = ProposeCall("r", PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2)), 3,
                       SamplingParams(temperature=1.0), seed=4, assumed_token_ids=(7, 8))
    assert wire.propose_from_proto(through_the_wire(wire.propose_to_proto(call))) == call


def test_the_bonus_law_travels_with_the_sampled_scores():
    """p(K+1) a call asked for is what the router tests its pre-drafted token against."""
    bonus = DraftDists.of_row(torch.tensor([0.0, 0.25, 0.0, 0.75] + [0.0] * 12))
    scores = TargetScores(draft_target_probs=(0.5,), recovered_token_ids=(2, 0),
                          bonus_token_id=3, bonus_probs=bonus)
    back = wire.scores_from_proto(through_the_wire(wire.scores_to_proto(scores)))
    assert back.bonus_token_id == 3 and back.bonus_probs is not None
    assert torch.equal(back.bonus_probs.dense(), bonus.dense())


def test_bonus_probs_of_two_rows_are_refused():
    two = DraftDists.from_dense(torch.full((2, 4), 0.25))
    scores = TargetScores(draft_target_probs=(0.5,), recovered_token_ids=(2, 0),
                          bonus_token_id=3, bonus_probs=two)
    with pytest.raises(ValueError, match="one row"):
        wire.scores_from_proto(wire.scores_to_proto(scores))


@pytest.mark.parametrize("draws", [(1, 2), (1,)])
def test_a_trees_scores_without_one_draw_per_row_are_refused(draws):
    message = wire.scores_to_proto(TargetScores(accept_probs=(0.5, 0.25),
                                                recovered_token_ids=(1, 2, 3)))
    del message.sampled.recovered_token_ids[:]
    message.sampled.recovered_token_ids.extend(draws)
    with pytest.raises(ValueError, match="one draw per row"):
        wire.scores_from_proto(message)


def test_logprobs_of_several_positions_keep_each_positions_top_n():
    # float32 on the wire: values it holds exactly
    top = (((1, -0.5), (2, -2.0)), ((3, -0.25), (4, -3.0)), ((5, -0.125), (6, -4.0)))
    logprobs = PositionLogprobs((-0.5, -1.5), (-0.5, -0.25, -0.125), top)
    scores = TargetScores(target_token_ids=(1, 3, 5), logprobs=logprobs)
    assert wire.scores_from_proto(wire.scores_to_proto(scores)).logprobs == logprobs


@pytest.mark.parametrize("token_ids, rows", [((1, 10), 2), ((1, 2), 3)])
def test_a_block_whose_q_does_not_fit_its_tokens_is_refused(token_ids, rows):
    """A token past q's vocabulary, or q with a row no token was drawn from."""
    q = DraftDists.from_dense(torch.full((rows, 10), 0.1))
    with pytest.raises(ValueError, match="unlike"):
        wire.block_from_proto(wire.block_to_proto(DraftBlock(token_ids, q)))


def test_infinite_weights_are_refused_as_they_arrive():
    message = wire.block_to_proto(DraftBlock((1,), DraftDists.from_dense(
        torch.tensor([[1.0, float("inf"), 0.0]]))))
    with pytest.raises(ValueError, match="finite"):
        wire.block_from_proto(message)


def test_bfloat16_weights_travel_as_the_law_they_stand_for():
    """bfloat16 goes as float32 (exact); as float16 an entry below its range would vanish,
    and a token drawn there would reach the router with q = 0."""
    weights = torch.tensor([[1e-9, 1.0, 0.5]], dtype=torch.bfloat16)
    back = wire.block_from_proto(wire.block_to_proto(
        DraftBlock((0,), DraftDists.from_dense(weights))))
    assert back.draft_probs.at([0]) == draft_law(weights).squeeze(0)[:1].tolist()
    assert back.draft_probs.at([0])[0] > 0


def test_a_held_sync_whose_tuple_is_gone_is_not_given_to_the_tuple_that_took_its_id():
    """id() is reused once a tuple dies: the entry is only its own tuple's."""
    syncs = wire.SharedSyncs(min_tokens=2)
    old, new = (1, 2, 3), (4, 5, 6)
    syncs.held[id(new)] = (old, pb.PrefixSync(new_token_ids=old))  # as if old's id were new's
    assert tuple(syncs.ids(new).new_token_ids) == new

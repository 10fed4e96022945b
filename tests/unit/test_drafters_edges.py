"""The model-free drafters' contracts at their edges (drafter.ngram, drafter.suffix,
drafter.registry, deployments.predictions): the q a sampled proposal reports, what a request
with a grammar gets without the grammar's tokenizer, the options the drafters and the
registry check and pass, and a prediction's limits and usage counts."""

from dataclasses import replace

import pytest
import torch

from deployments.ingress import BadRequest
from deployments.predictions import accepted_prediction_tokens, predicted_ids, prediction_usage
from drafter.ngram import NgramDrafter
from drafter.registry import DrafterSpec, build_drafter
from drafter.suffix import SuffixDrafter, SuffixIndex
from engine.checkpoint import Checkpoint
from engine.models import DEMO_TARGET
from speculative.prefixes import prefix_hash
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, ProposeCall
from tests.unit.test_engines_edges import proposal


GREEDY = SamplingParams(temperature=0)


def sampled_call(request_id: str, context: tuple[int, ...], k: int = 4,
                 **sampling) -> ProposeCall:
    return proposal(request_id, context, k, SamplingParams(temperature=1.0, **sampling),
                    prompt_len=1)


@pytest.mark.parametrize("drafter", [NgramDrafter(16), SuffixDrafter(16, max_spec_factor=2)],
                         ids=["ngram", "suffix"])
def test_a_sampled_proposal_reports_a_one_hot_q_at_each_proposed_id(drafter):
    """A deterministic proposal's q_i is x_i alone: the rejection sampler then accepts x_i
    with probability p(x_i), which keeps the output the target's (a q elsewhere breaks it)."""
    block = drafter.propose_now(sampled_call("r", (9, 1, 2, 3, 4, 1, 2)))
    assert block.token_ids[:2] == (3, 4) and block.draft_probs is not None
    q = block.draft_probs.dense()
    assert q.shape == (len(block.token_ids), 16)
    expected = torch.zeros_like(q)
    expected[range(len(block.token_ids)), list(block.token_ids)] = 1.0
    torch.testing.assert_close(q, expected)


def test_a_request_with_a_grammar_gets_no_proposal_without_the_grammars_tokenizer():
    """No tokenizer to read the grammar with: no proposal, rather than ids it may forbid;
    the same context without a grammar proposes."""
    drafter, context = NgramDrafter(16), (9, 1, 2, 3, 1, 2)
    constrained = sampled_call("g", context, grammar='start: "a"')
    assert drafter.propose_now(constrained).token_ids == ()
    assert drafter.propose_now(sampled_call("plain", context)).token_ids[:1] == (3,)


@pytest.mark.parametrize("low, high", [(0, 4), (3, 2)])
def test_prompt_lookup_refuses_ngram_lengths_out_of_order_or_below_one(low, high):
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(16, min_ngram=low, max_ngram=high)


def test_a_prompt_longer_than_the_context_is_refused_before_the_session_moves():
    drafter = NgramDrafter(16)
    beyond = proposal("p", (1, 2, 3), 4, GREEDY, prompt_len=4)
    with pytest.raises(ValueError, match="prompt_len"):
        drafter.propose_now(beyond)
    assert len(drafter.sessions) == 0


def test_a_suffix_continuation_at_exactly_min_token_prob_is_proposed():
    """The continuation goes on while its probability stays at or above min_token_prob:
    after 1, 3 and 4 came once each (1/2), and 3 1 4 then each followed once."""
    index = SuffixIndex(8)
    index.add([1, 3, 1, 4])
    tokens, score = index.propose([1], 4, min_token_prob=0.5, max_spec_factor=4)
    assert tokens == [3, 1, 4] and score == pytest.approx(1.5)
    assert index.propose([1], 4, min_token_prob=0.51, max_spec_factor=4)[0] == []


@pytest.mark.parametrize("option", [{"max_depth": 1}, {"max_spec_factor": 0},
                                    {"min_token_prob": 1.5}, {"max_global_outputs": -1},
                                    {"max_global_tokens": -1}])
def test_suffix_decoding_refuses_options_out_of_range(option):
    with pytest.raises(ValueError, match="suffix drafting needs"):
        SuffixDrafter(16, **option)


@pytest.fixture(scope="module")
def target():
    return Checkpoint.load(DEMO_TARGET)


def test_the_registry_passes_the_ngram_lengths_and_session_bounds(target):
    """A pool's --ngram-min/--ngram-max and its session bounds reach the drafter it builds,
    for either kind without a model."""
    spec = DrafterSpec(kind="ngram", target=DEMO_TARGET, ngram_min=2, ngram_max=3,
                       max_cached_requests=7, max_cached_tokens=500, session_ttl_s=30.0)
    ngram = build_drafter(spec, target)
    assert (ngram.min_ngram, ngram.max_ngram) == (2, 3)
    for drafter in (ngram, build_drafter(replace(spec, kind="suffix"), target)):
        sessions = drafter.sessions
        assert (sessions.capacity, sessions.max_tokens, sessions.ttl_s) == (7, 500, 30.0)


@pytest.mark.parametrize("option, refusal", [
    ({"kind": "eagle"}, r"drafter must be one of \['model', 'ngram', 'suffix'\]"),
    ({"draft_top_k": -1}, "draft_top_k"), ({"draft_q_mass": 0.0}, "draft_q_mass"),
    ({"draft_q_dtype": "bfloat16"}, "draft_q_dtype")])
def test_the_registry_refuses_an_unknown_kind_or_q_option_before_building(option, refusal):
    spec = replace(DrafterSpec(kind="ngram", target=DEMO_TARGET), **option)
    with pytest.raises(ValueError, match=refusal):
        build_drafter(spec)


def byte_tokenizer(text: str, **options) -> dict:
    """A stand-in tokenizer: one id a UTF-8 byte."""
    return {"input_ids": list(text.encode())}


def test_a_prediction_is_refused_past_its_byte_limit_and_taken_at_its_limits():
    """A 400 naming `prediction` beyond max_bytes (counted in UTF-8) or max_tokens; a
    prediction of exactly either limit is taken."""
    assert predicted_ids(byte_tokenizer, "é" * 3, 6, 6) == tuple("é".encode() * 3)
    for max_bytes, max_tokens, limit in ((5, 6, "5"), (6, 5, "5 (the context)")):
        with pytest.raises(BadRequest) as refused:
            predicted_ids(byte_tokenizer, "é" * 3, max_bytes, max_tokens)
        assert refused.value.status == 400 and refused.value.param == "prediction"
        assert str(refused.value).endswith(f"the limit is {limit}")


def test_the_usage_never_counts_more_of_a_prediction_than_it_holds():
    """An output that repeats the whole prediction and more: its common start and end
    overlap, each predicted id counted once (none rejected, never a negative count)."""
    assert accepted_prediction_tokens((1, 1), [1, 1, 1]) == 2
    assert accepted_prediction_tokens((1, 2, 1), [1, 2, 1, 9, 2, 1]) == 3
    assert prediction_usage((1, 2, 1), [[1, 2, 1, 9, 2, 1], [1]]) == {
        "accepted_prediction_tokens": 4, "rejected_prediction_tokens": 2}


def test_a_batch_answers_a_refused_call_with_its_error_and_drafts_the_others():
    """propose_batch (a pool's batch): each call on its own, a refusal its answer alone."""
    drafter = NgramDrafter(16)
    beyond = proposal("bad", (1, 2), 4, GREEDY, prompt_len=3)
    refused, block = drafter.propose_batch([beyond, sampled_call("ok", (9, 1, 2, 3, 1, 2))])
    assert isinstance(refused, ValueError) and "prompt_len" in str(refused)
    assert block.token_ids[:1] == (3,)


def test_a_suffix_drafters_own_index_holds_a_rounds_single_new_token_at_once():
    """A round that commits one token (its first drafted one rejected): the next proposal
    already counts it, here the run 4 4 that proposes 4 again."""
    drafter = SuffixDrafter(16, max_spec_factor=2)
    assert drafter.propose_now(proposal("r", (1, 2, 4), 4, GREEDY)).token_ids == ()
    then = ProposeCall("r", PrefixSync(3, prefix_hash([1, 2, 4]), (4,)), 4, GREEDY, seed=0)
    assert drafter.propose_now(then).token_ids == (4,)


def test_a_short_diff_counts_a_run_of_a_frequent_id_exactly():
    """Within MAX_EXACT_DIFF the diff has no junk heuristic: an id frequent in the output
    (past 1 % of 200 or more ids, such as an indent's) still matches, here a run of ten
    between rewritten text."""
    prediction = (*range(1000, 1100), *[0] * 10, *range(2000, 2100))
    output = [*range(3000, 3100), *[0] * 10, *range(4000, 4100)]
    assert accepted_prediction_tokens(prediction, output) == 10


def test_a_pre_draft_at_the_outputs_start_goes_on_after_its_assumed_predicted_ids():
    """A pre-draft beside the first verify assumes the first block (the prediction's start):
    its proposal goes on after those ids, not from the prediction's start again."""
    call = proposal("p", (1, 2), 3, GREEDY, prompt_len=2, assumed_token_ids=(20, 21),
                    prediction_token_ids=tuple(range(20, 40)))
    assert NgramDrafter(64).propose_now(call).token_ids == (22, 23, 24)


def test_a_pre_draft_asking_for_a_tree_gets_a_chain_with_its_one_hot_q():
    """A tree is drafted only from the committed tokens: a call with assumed ids (a
    pre-draft) gets the most frequent continuation alone."""
    drafter = SuffixDrafter(16, max_spec_factor=2)
    for output in ([9, 7, 1, 2], [9, 7, 4, 5]):
        drafter.remember(str(output), output)
    call = proposal("c", (8, 9), 2, SamplingParams(temperature=1.0), tree_width=3,
                    assumed_token_ids=(7,))
    block = drafter.propose_now(call)
    assert block.parents is None and block.token_ids in ((1, 2), (4, 5))
    assert block.draft_probs.at(block.token_ids) == [1.0, 1.0]


def test_a_tree_holds_at_most_width_continuations_at_a_node():
    """Width 2: the main chain's token and one other at each node, however many followed
    and whatever the node budget allows."""
    index = SuffixIndex(8)
    for output in ([7, 1], [7, 1], [7, 2], [7, 3]):
        index.add(output)
    tokens, parents, _ = index.propose_tree([9, 7], 1, 2, 8, 0.1, 2.0)
    assert tokens[0] == 1 and len(tokens) == 2 and tokens[1] in (2, 3)
    assert parents == (-1, -1)

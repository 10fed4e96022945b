"""The engines' answers at their edges (mutation-found gaps): a call of several steps keeps
a newer call's progress, sums its steps' time and averages their batches; a call ending at
the context's last position is scored; a tree's answer reports its nodes; a pre-draft's
shaping counts its assumed tokens; a prefix hit is reported once; each shaped call of a
batch gets its own shaping. Then: a call is refused alone for its largest shaping id or a
prompt_len past its prefix; a failed draft forward or a release forgets the request; a draft
fills the drafter's context to its last position (a tree too) and a block goes on at its
threshold; a call drafting nothing only feeds; the host transfer puts each value in its
place and type, and fails a call whose first draw is index V."""

import asyncio

import pytest
import torch

from drafter.model import ModelDrafter
from engine.batch import UNFINISHED
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.sampling import SamplingParams
from speculative.types import (LAWLESS, BatchLoad, DraftBlock, PrefixSync, ProposeCall,
                               ScoreCall, StaleBase, TargetScores)
from tests.tiny import tiny_llama
from tests.unit.test_prefix_cache import PROMPT as BLOCKS_PROMPT
from tests.unit.test_prefix_cache import served, sync
from verifier import engine as verifier_engine
from verifier import host
from verifier.engine import ModelVerifier

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(7)


def stepped(request_id: str, prompt: tuple[int, ...], steps: int) -> ScoreCall:
    return ScoreCall(request_id, PrefixSync(0, EMPTY_PREFIX_HASH, prompt), (), GREEDY,
                     steps=steps)


def proposal(request_id: str, prompt: tuple[int, ...], k: int = 2,
             sampling: SamplingParams = GREEDY, seed: int = 0, **fields) -> ProposeCall:
    """The request's first call: draft k tokens after `prompt`."""
    return ProposeCall(request_id, sync([], prompt), k, sampling, seed=seed, **fields)


def drafted(drafter: ModelDrafter, request_id: str, length: int, **fields) -> DraftBlock:
    """A greedy block of 4 after a prompt of `length` tokens."""
    return drafter.propose_now(proposal(request_id, (3,) * length, 4, **fields))


def finished(verifier: ModelVerifier, calls: list[ScoreCall]) -> tuple[list, int]:
    """The calls' answers once every one has run its steps, and the batches it took."""
    batches = 0
    while True:
        answers = verifier.score_batch(calls)
        batches += 1
        if UNFINISHED not in answers:
            return answers, batches


def test_a_newer_call_of_several_steps_keeps_its_progress_beside_the_one_it_ends(target):
    """A retried call of three steps, batched before the call of four it replaces (between
    two of that one's steps): the older answers the steps it ran, and the newer goes on with
    its own steps, answering after its third (not restarted)."""
    verifier = ModelVerifier(target)
    older, newer = stepped("r", (1, 2, 3), 4), stepped("r", (1, 2, 3), 3)
    assert verifier.score_batch([older]) == [UNFINISHED]
    first, cut = verifier.score_batch([newer, older])
    assert first is UNFINISHED and len(cut.continued_token_ids) == 1
    assert verifier.score_batch([newer]) == [UNFINISHED]
    [answer] = verifier.score_batch([newer])  # its third step
    assert len(answer.continued_token_ids) == 2 and not verifier.steps.running
    alone, _ = finished(ModelVerifier(target), [stepped("r", (1, 2, 3), 3)])
    assert answer.target_token_ids + answer.continued_token_ids == \
        alone[0].target_token_ids + alone[0].continued_token_ids


def test_a_call_of_several_steps_answers_all_its_steps_time_and_their_mean_batch(
        target, monkeypatch):
    """compute_seconds sums the steps' batches (each 1 s on a clock that ticks a second a
    read), and the load is the steps' mean: two calls of three steps side by side."""
    class Ticking:
        now = 0.0

        @classmethod
        def perf_counter(cls) -> float:
            cls.now += 1.0
            return cls.now

    monkeypatch.setattr(verifier_engine, "time", Ticking)
    calls = [stepped("a", (1, 2, 3), 3), stepped("b", (4, 5, 6), 3)]
    answers, batches = finished(ModelVerifier(target), calls)
    assert batches == 3
    for answer in answers:
        assert len(answer.continued_token_ids) == 2
        assert answer.compute_seconds == pytest.approx(3.0)
        # fed: both prompts (6 tokens), then one token each twice
        assert answer.load == BatchLoad(2, round((6 + 2 + 2) / 3))


def test_a_call_that_ends_exactly_at_the_context_is_scored(target):
    """committed + K = max_position_embeddings fits: the last drafted token sits at the
    context's last position (only one past it is refused: test_verifier_answers)."""
    limit = target.config.max_position_embeddings
    prompt = (3,) * (limit - 3)
    call = ScoreCall("c", PrefixSync(0, EMPTY_PREFIX_HASH, prompt), (4, 5, 6), GREEDY)
    assert len(ModelVerifier(target).score_now(call).target_token_ids) == 4


@pytest.mark.parametrize("law", [GREEDY, SamplingParams(temperature=1.0)],
                         ids=["greedy", "matched"])
def test_a_scored_tree_reports_its_nodes_and_a_chain_none(target, law):
    """tree_nodes tells the router the call was scored as a tree (speculative.accept refuses
    a tree answer without it, as a verifier that scored a chain); a chain's stays 0."""
    verifier = ModelVerifier(target)
    prefix = PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3))
    tree = verifier.score_now(ScoreCall("t", prefix, (4, 5, 6), law, draft_parents=(-1, 0, 0)))
    assert tree.tree_nodes == 3 and len(tree.target_token_ids) == 4
    chain = verifier.score_now(ScoreCall("c", prefix, (4, 5), GREEDY))
    assert chain.tree_nodes == 0


def test_a_pre_draft_counts_its_assumed_tokens_as_output(target):
    """A call drafting after assumed tokens (a pre-draft) shapes its steps as one whose
    prefix committed them: the penalties count them as output, in its tokens and its q."""
    prompt, law = (1, 2, 3), SamplingParams(temperature=1.0, frequency_penalty=2.0)
    assumed = (7, 7, 9)
    after = proposal("a", prompt, 4, law, seed=1, prompt_len=3, assumed_token_ids=assumed)
    committed = proposal("c", prompt + assumed, 4, law, seed=1, prompt_len=3)
    drafter = ModelDrafter(target)
    pre, plain = drafter.propose_now(after), drafter.propose_now(committed)
    assert pre.token_ids == plain.token_ids
    torch.testing.assert_close(pre.draft_probs.dense(), plain.draft_probs.dense(),
                               atol=1e-5, rtol=0)


def test_a_prefix_hit_is_reported_by_the_call_that_took_it_only():
    """cached_tokens is the hit's, on the call whose prefill took it: the request's next
    call (its cache already its own) reports none, so usage does not count the hit twice."""
    verifier = ModelVerifier(served("paged"))
    prompt = BLOCKS_PROMPT + [9]  # two full blocks of 16, and 9 more
    verifier.score_now(ScoreCall("a", sync([], BLOCKS_PROMPT), (3,), GREEDY))
    verifier.score_now(ScoreCall("a", sync(BLOCKS_PROMPT, [3]), (5,), GREEDY))  # publishes
    hit = verifier.score_now(ScoreCall("b", sync([], prompt), (1,), GREEDY, prompt_len=41))
    next_call = verifier.score_now(ScoreCall("b", sync(prompt, [1]), (2,), GREEDY,
                                             prompt_len=41))
    assert hit.cached_tokens == 32 and next_call.cached_tokens == 0


def test_each_shaped_call_of_a_batch_is_shaped_by_its_own_bias(target):
    """Shaped calls' rows are shaped together (one shape_batch): each call's logit_bias
    reaches its own rows, here a bias that makes one id every row's argmax."""
    calls = [ScoreCall(f"s{token}", PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3)), (4, 5),
                       SamplingParams(temperature=0, logit_bias=((token, 100.0),)))
             for token in (10, 20, 30)]
    answers = ModelVerifier(target).score_batch(calls)
    assert [answer.target_token_ids for answer in answers] == \
        [(10,) * 3, (20,) * 3, (30,) * 3]


def test_a_drafter_refuses_alone_a_call_whose_largest_shaping_id_is_outside(target):
    """logit_bias naming an id in range and one past the vocabulary (a call straight from
    the wire; the router answers such a request 400 first): check_call reads the largest id,
    so that call is refused and its batch-mate drafted, not the whole batch failed."""
    drafter = ModelDrafter(target)
    bad = SamplingParams(temperature=0, logit_bias=((1, 1.0), (drafter.vocab_size, 1.0)))
    calls = [proposal(name, (1, 2, 3), 3, sampling, prompt_len=3)
             for name, sampling in (("bad", bad), ("good", GREEDY))]
    refused, block = drafter.propose_batch(calls)
    assert isinstance(refused, ValueError) and "out of range" in str(refused)
    assert isinstance(block, DraftBlock) and len(block.token_ids) == 3
    assert "bad" not in drafter.sessions


def test_a_verifier_refuses_alone_a_call_whose_largest_shaping_id_is_outside(target):
    vocab = target.config.vocab_size
    bad = SamplingParams(temperature=0, logit_bias=((1, 1.0), (vocab, 1.0)))
    calls = [ScoreCall(name, PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3)), (4,), sampling)
             for name, sampling in (("bad", bad), ("good", GREEDY))]
    refused, answered = ModelVerifier(target).score_batch(calls)
    assert isinstance(refused, ValueError) and "out of range" in str(refused)
    assert len(answered.target_token_ids) == 2


def test_a_drafter_refuses_a_prompt_longer_than_the_committed_prefix(target):
    drafter = ModelDrafter(target)
    beyond = proposal("p", (1, 2, 3), prompt_len=4)
    with pytest.raises(ValueError, match="prompt_len"):
        drafter.propose_now(beyond)
    assert len(drafter.sessions) == 0


def test_a_failed_draft_forward_forgets_its_requests_cache(target, monkeypatch):
    """A forward that raises leaves the batch's caches unknown: the request's session is
    dropped, so its next call (from the prefix it had) answers StaleBase (a rebuild)."""
    drafter = ModelDrafter(target)
    drafter.propose_now(proposal("r", (1, 2, 3)))
    after = ProposeCall("r", sync([1, 2, 3], [4]), 2, GREEDY, seed=0)

    def broken(segments):
        raise RuntimeError("device lost")

    with monkeypatch.context() as patched:
        patched.setattr(drafter.runner, "forward", broken)
        with pytest.raises(RuntimeError, match="device lost"):
            drafter.propose_now(after)
    assert "r" not in drafter.sessions
    with pytest.raises(StaleBase):
        drafter.propose_now(after)


def test_a_released_request_leaves_the_drafter(target):
    drafter = ModelDrafter(target)
    drafter.propose_now(proposal("r", (1, 2, 3)))
    asyncio.run(drafter.release("r"))
    assert "r" not in drafter.sessions


def test_a_draft_fills_the_drafters_context_to_its_last_position_and_no_further(target):
    """committed + drafted - 1 (the last drafted token is never fed) may reach the context:
    two tokens short of it a block of 4 holds 3; past it the call drafts nothing and says its
    context is full."""
    limit = target.config.max_position_embeddings
    drafter = ModelDrafter(target)
    near = drafted(drafter, "near", limit - 2)
    assert len(near.token_ids) == 3 and not near.context_full
    full = drafted(drafter, "full", limit + 1)
    assert full.token_ids == () and full.context_full


def test_a_tree_reaching_the_drafters_last_position_stays_a_tree(target):
    """committed + tree_nodes = the context fits (the tree's nodes end at its last position);
    one more committed token and the call drafts a chain instead."""
    limit = target.config.max_position_embeddings
    drafter, tree_fields = ModelDrafter(target), {"tree_width": 3, "tree_nodes": 7}
    tree = drafted(drafter, "tree", limit - 7, **tree_fields)
    assert len(tree.token_ids) == 7 and tree.parents[:4] == (-1, 0, 1, 2)
    chain = drafted(drafter, "chain", limit - 6, **tree_fields)
    assert len(chain.token_ids) == 4 and chain.parents is None


def test_a_block_whose_confidence_equals_the_threshold_goes_on(target, monkeypatch):
    """A block ends once its confidence falls below the threshold, not at it: each token
    drawn with probability 1/2 under a threshold of 1/4 gives 1/2, 1/4 (goes on), 1/8."""
    drafter = ModelDrafter(target)
    monkeypatch.setattr(drafter, "drafted_probs",
                        lambda drafts, lines, tokens: [0.5] * len(drafts))
    block = drafter.propose_now(proposal("r", (1, 2, 3), 6, draft_confidence=0.25))
    assert len(block.token_ids) == 3 and block.confidences == (0.5, 0.25, 0.125)


def test_one_transfer_defers_only_within_its_block():
    """Outside it (after a batch, even one that failed) a lone call's answers are host
    values again."""
    assert not host.deferred()
    with pytest.raises(RuntimeError):
        with host.one_transfer():
            assert host.deferred()
            raise RuntimeError("a failed batch")
    assert not host.deferred()


def test_to_host_puts_each_calls_values_back_in_their_fields_and_types():
    """Parts of one block (two calls' rows) and plain device tensors, a 0-d one a scalar:
    ids come back ints, probabilities floats, each call's own; common()'s fields reach every
    answer, and a refusal stays as it is."""
    block = torch.tensor([[3.0, 5.0, 9.0, 0.25, 0.5], [4.0, 6.0, 8.0, 0.75, 1.0]],
                         dtype=torch.float64)
    parted = [TargetScores(recovered_token_ids=host.Part(block, row, 0, 2),
                           bonus_token_id=host.Part(block, row, 2, 3, scalar=True),
                           draft_target_probs=host.Part(block, row, 3, 5)) for row in (0, 1)]
    plain = TargetScores(target_token_ids=torch.tensor([7, 2]), bonus_token_id=torch.tensor(11),
                         draft_target_probs=torch.tensor([0.5]))
    first, second, third, refused = host.to_host(
        [*parted, plain, ValueError("refused")], lambda: {"compute_seconds": 1.0})
    assert (first.recovered_token_ids, first.bonus_token_id, first.draft_target_probs) == \
        ((3, 5), 9, (0.25, 0.5))
    assert (second.recovered_token_ids, second.bonus_token_id) == ((4, 6), 8)
    assert (third.target_token_ids, third.bonus_token_id, third.draft_target_probs) == \
        ((7, 2), 11, (0.5,))
    assert all(type(token) is int for token in (*first.recovered_token_ids,
                                                third.bonus_token_id))
    assert first.compute_seconds == 1.0 and isinstance(refused, ValueError)


@pytest.mark.parametrize("scores", [
    TargetScores(target_token_ids=(64, 3)),
    TargetScores(recovered_token_ids=(64, 3), bonus_token_id=5, draft_target_probs=(0.5, 0.5)),
    TargetScores(bonus_token_id=64)], ids=["greedy", "recovered", "no draft"])
def test_a_first_rows_draw_of_index_v_fails_the_call(scores):
    """The first row's draw is output for sure (a call without a draft outputs its bonus):
    the call fails, never marked LAWLESS for a later round to meet."""
    [answer] = host.refusing_lawless([scores], 64)
    assert isinstance(answer, RuntimeError) and "not finite" in str(answer)


def test_a_bonus_draw_of_index_v_alone_is_marked_lawless():
    """Every drafted row lawful, the bonus drawn from a NaN row: the bonus alone is marked."""
    scores = TargetScores(recovered_token_ids=(3, 4), bonus_token_id=64,
                          draft_target_probs=(0.5, 0.5))
    [marked] = host.refusing_lawless([scores], 64)
    assert marked.recovered_token_ids == (3, 4) and marked.bonus_token_id == LAWLESS


@pytest.mark.parametrize("k, sampling", [(0, GREEDY), (3, SamplingParams(
    temperature=0, grammar='start: "a"'))], ids=["no K", "grammar unread"])
def test_a_call_that_drafts_nothing_only_feeds_its_prefix(target, k, sampling):
    """K = 0, or a grammar the drafter has no tokenizer for: the call feeds its prefix (for
    its next call) and answers an empty block, never a token drawn from that feed."""
    drafter = ModelDrafter(target)
    assert drafter.propose_now(proposal("r", (1, 2, 3), k, sampling)).token_ids == ()
    assert drafter.sessions.get("r").cached_ids == [1, 2, 3]

"""The engines' answers at their edges (mutation-found gaps): a call of several steps keeps
a newer call's progress, sums its steps' time and averages their batches; a call ending at
the context's last position is scored; a tree's answer reports its nodes; a pre-draft's
shaping counts its assumed tokens; a prefix hit is reported once; each shaped call of a
batch gets its own shaping."""

import pytest
import torch

from drafter.model import ModelDrafter
from engine.batch import UNFINISHED
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.sampling import SamplingParams
from speculative.types import BatchLoad, PrefixSync, ProposeCall, ScoreCall
from tests.tiny import tiny_llama
from tests.unit.test_prefix_cache import PROMPT as BLOCKS_PROMPT
from tests.unit.test_prefix_cache import served, sync
from verifier import engine as verifier_engine
from verifier.engine import ModelVerifier

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(7)


def stepped(request_id: str, prompt: tuple[int, ...], steps: int) -> ScoreCall:
    return ScoreCall(request_id, PrefixSync(0, EMPTY_PREFIX_HASH, prompt), (), GREEDY,
                     steps=steps)


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
    after = ProposeCall("a", PrefixSync(0, EMPTY_PREFIX_HASH, prompt), 4, law, seed=1,
                        prompt_len=3, assumed_token_ids=assumed)
    committed = ProposeCall("c", PrefixSync(0, EMPTY_PREFIX_HASH, prompt + assumed), 4, law,
                            seed=1, prompt_len=3)
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

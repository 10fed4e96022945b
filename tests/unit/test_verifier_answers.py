"""The verifier's answers, each the target's own for its call, checked against a fresh forward
of the target (mutation-found gaps): a batch's bonus laws, p at each drafted position, the
residual draws' q, greedy argmaxes over the whole vocabulary, LAWLESS marking, and the
refusals at the context's edge, of a prompt's top n and of a shaped tree."""

import pytest
import torch

from speculative.sampling import SamplingParams
from speculative.types import LAWLESS, DraftDists, ScoreCall, TargetScores
from tests.tiny import tiny_llama
from tests.unit.test_batch import full_logits, sync
from verifier import host
from verifier.engine import ModelVerifier
from verifier.prompt_scores import prompt_logprobs


def uniform_q(rows: int, vocab: int) -> DraftDists:
    return DraftDists.from_dense(torch.full((rows, vocab), 1.0 / vocab))


@pytest.fixture(scope="module")
def target():
    """One tiny target for the tests that only read it (the greedy test permutes its own)."""
    return tiny_llama(1)


def test_each_sampled_call_of_a_batch_gets_its_own_bonus_law(target):
    """Three sampled chains of one law and K (one group, one softmax over their rows) with
    return_bonus_probs: each call's bonus_probs is softmax of the target's logits after its
    own prompt and draft."""
    vocab = target.config.vocab_size
    law = SamplingParams(temperature=1.0)
    prompts = [[2, 3, 5], [9, 4, 1], [7, 7, 8]]
    drafted = [(6, 7), (11, 12), (20, 21)]
    calls = [ScoreCall(f"b{i}", sync([], prompt), draft, law, seed=3 + i,
                       draft_probs=uniform_q(2, vocab),
                       return_bonus_probs=True)
             for i, (prompt, draft) in enumerate(zip(prompts, drafted))]
    answers = ModelVerifier(target).score_batch(calls)
    for prompt, draft, answer in zip(prompts, drafted, answers):
        assert not isinstance(answer, Exception), answer
        expected = full_logits(target, prompt + list(draft))[-1].softmax(-1)
        torch.testing.assert_close(answer.bonus_probs.dense()[0], expected, atol=1e-5, rtol=0)


def test_a_chains_drafted_tokens_carry_p_at_their_own_position(target):
    """draft_target_probs[i] is p_i(x_i): the target's law at drafted position i (after the
    prompt and x_1..x_{i-1}), read at x_i, not the next position's law."""
    vocab = target.config.vocab_size
    prompt, draft = [2, 3, 5], (6, 7, 8)
    call = ScoreCall("p", sync([], prompt), draft, SamplingParams(temperature=1.0), seed=1,
                     draft_probs=uniform_q(3, vocab))
    scores = ModelVerifier(target).score_now(call)
    probs = full_logits(target, prompt + list(draft))[len(prompt) - 1:].softmax(-1)
    expected = [probs[i, token].item() for i, token in enumerate(draft)]
    torch.testing.assert_close(torch.tensor(scores.draft_target_probs, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=0)


def test_a_recovered_token_is_never_one_the_residual_excludes(target):
    """A recovered token is drawn from the residual (p - q)+, so a token whose q is 1 has no
    mass there and is never drawn, whatever the seed: here the target's own favourite at the
    first position, which a draw from p (the residual skipped) or from another call's q would
    pick often."""
    vocab = target.config.vocab_size
    prompt = [2, 3, 5]
    favourite = int(full_logits(target, prompt)[-1].argmax())
    one_hot = torch.zeros((1, vocab))
    one_hot[0, favourite] = 1.0
    # the batch interleaves calls of a uniform q: each call's residual is its own q's
    calls = [ScoreCall(f"r{seed}", sync([], prompt), (favourite,),
                       SamplingParams(temperature=1.0), seed=seed,
                       draft_probs=uniform_q(1, vocab) if seed % 2 == 0
                       else DraftDists.from_dense(one_hot))
             for seed in range(128)]
    answers = ModelVerifier(target).score_batch(calls)
    assert all(answer.recovered_token_ids[0] != favourite for answer in answers[1::2])


def test_greedy_answers_reach_the_last_vocabulary_id():
    """A greedy call's target ids are the argmax over the whole vocabulary: the target's lm
    head is permuted so that its favourite at the bonus position is the last id, V - 1."""
    target = tiny_llama(1)
    vocab = target.config.vocab_size
    prompt, draft = [2, 3, 5], (6, 7)
    favourite = int(full_logits(target, prompt + list(draft))[-1].argmax())
    with torch.no_grad():  # swap the two ids' rows of the lm head
        head = target.lm_head.weight
        head[[favourite, vocab - 1]] = head[[vocab - 1, favourite]]
    expected = full_logits(target, prompt + list(draft))[len(prompt) - 1:].argmax(-1).tolist()
    assert expected[-1] == vocab - 1
    call = ScoreCall("g", sync([], prompt), draft, SamplingParams(temperature=0.0), seed=0)
    assert list(ModelVerifier(target).score_now(call).target_token_ids) == expected


def test_a_call_one_token_past_the_context_is_refused(target):
    """committed + K one past max_position_embeddings is refused (a ValueError), not scored
    at a position the target was never trained on."""
    limit = target.config.max_position_embeddings
    prompt = [3] * (limit - 2)
    call = ScoreCall("c", sync([], prompt), (4, 5, 6), SamplingParams(temperature=0.0), seed=0)
    with pytest.raises(ValueError, match="exceed the target's context"):
        ModelVerifier(target).score_now(call)


def test_a_later_rows_draw_of_index_v_is_marked_lawless_in_every_field():
    """A NaN row's draw is exactly V (speculative.sampling.inverted): past the first row it is
    marked LAWLESS wherever it sits (a recovered id, a greedy/matched target id, the bonus),
    never left as an id the vocabulary lacks."""
    vocab = 64
    sampled = TargetScores(recovered_token_ids=(3, vocab), bonus_token_id=vocab,
                           draft_target_probs=(0.5, 0.5))
    matched = TargetScores(target_token_ids=(3, vocab, 4))
    marked, target_marked = host.refusing_lawless([sampled, matched], vocab)
    assert marked.recovered_token_ids == (3, LAWLESS) and marked.bonus_token_id == LAWLESS
    assert target_marked.target_token_ids == (3, LAWLESS, 4)


def test_a_prompt_of_exactly_the_context_is_scored(target):
    """A prompt of max_positions tokens fits (only one past it is refused)."""
    answer = prompt_logprobs(target, [2, 3, 5, 7], 1, max_positions=4)
    assert len(answer.entries) == 3
    with pytest.raises(ValueError, match="exceed the target's context"):
        prompt_logprobs(target, [2, 3, 5, 7, 9], 1, max_positions=4)


def test_a_prompts_top_n_may_be_the_whole_vocabulary(target):
    """top_n = V lists every id at each position (only past V is refused)."""
    vocab = target.config.vocab_size
    answer = prompt_logprobs(target, [2, 3, 5], vocab)
    assert all(sorted(token for token, _ in entry.top) == list(range(vocab))
               for entry in answer.entries)


def test_a_draft_tree_with_logit_shaping_is_refused(target):
    """A tree's rows are no one chain, so logit_bias (shaping) cannot follow them: the call is
    refused (a ValueError), not scored with the bias applied along the wrong tokens."""
    call = ScoreCall("t", sync([], [2, 3, 5]), (6, 7, 8),
                     SamplingParams(temperature=0.0, logit_bias=((6, 5.0),)), seed=0,
                     draft_parents=(-1, -1, 0))
    with pytest.raises(ValueError, match="draft tree does not combine"):
        ModelVerifier(target).score_now(call)

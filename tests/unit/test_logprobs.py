"""Logprobs under speculation: each output token's log-probability and its position's top n
are the target's own (raw: before temperature and penalties), whichever K, drafter or
pipelining produced the token, and equal K = 0's. They travel the wire, are refused past the
vocabulary by their call alone, and are cut with the tokens a stop cuts. Their API shapes and
streams: test_logprobs_api."""

import pytest
import torch

from deployments.wire import scores_from_proto, scores_to_proto
from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.sampling import SamplingParams
from speculative.types import (
    PositionLogprobs,
    PrefixSync,
    ScoreCall,
    TargetScores,
    TokenLogprob,
)
from tests.tiny import noisy_copy, run, tiny_llama
from verifier.engine import ModelVerifier

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [3, 9, 3], [11]]
TOP_N = 3


@pytest.fixture(scope="module")
def target():
    return tiny_llama(7)


@torch.no_grad()
def reference(model, prompt: list[int], output: list[int]) -> list[TokenLogprob]:
    """Each output token's raw logprob and top n, from one forward over the whole sequence."""
    logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    logprobs = torch.log_softmax(logits.float(), -1)
    values, ids = torch.topk(logprobs, TOP_N, dim=-1)
    return [TokenLogprob(token, float(logprobs[i, token]),
                         tuple(zip(ids[i].tolist(), values[i].tolist())))
            for i, token in enumerate(output)]


def assert_close(got: list[TokenLogprob], expected: list[TokenLogprob], tolerance=1e-4):
    assert [g.token_id for g in got] == [e.token_id for e in expected]
    for g, e in zip(got, expected):
        assert abs(g.logprob - e.logprob) < tolerance, (g, e)
        assert [t for t, _ in g.top] == [t for t, _ in e.top]
        assert all(abs(a - b) < tolerance for (_, a), (_, b) in zip(g.top, e.top))


DRAFTERS = {
    "noisy": lambda target: ModelDrafter(noisy_copy(target, 0.01, seed=1)),
    "far": lambda target: ModelDrafter(noisy_copy(target, 0.3, seed=2)),
    "ngram": lambda target: NgramDrafter(64),
}
CASES = [("noisy", 3, False), ("noisy", "auto", False), ("noisy", 2, True),
         ("far", 4, False), ("ngram", 3, False)]
MODES = {"greedy": SamplingParams(temperature=0, max_tokens=20, logprobs=TOP_N),
         "sampled": SamplingParams(temperature=1.0, max_tokens=20, seed=5, logprobs=TOP_N),
         "penalised": SamplingParams(temperature=0.8, max_tokens=20, seed=6, logprobs=TOP_N,
                                     presence_penalty=1.0, repetition_penalty=1.3)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind, k, pipelined", CASES,
                         ids=[f"{kind}-K{k}-{'pipelined' if p else 'sequential'}"
                              for kind, k, p in CASES])
def test_each_token_carries_the_targets_own_logprobs(target, mode, kind, k, pipelined):
    """Accepted drafted tokens, recovered and bonus tokens all get the target's raw logprob
    at their position (a mutant reading the target's own token's logprob at an accepted
    drafted position fails this in sampled mode, where the two differ)."""
    params = MODES[mode]
    drafter, verifier = DRAFTERS[kind](target), ModelVerifier(target)
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        out, state = run(drafter, verifier, prompt, params, k, request_id=f"r{i}",
                         pipelined=pipelined)
        assert_close(state.logprobs, reference(target, prompt, out))
        accepted += state.stats.num_accepted_tokens
        if mode == "greedy":  # the same tokens and logprobs as the target alone
            alone, alone_state = run(drafter, verifier, prompt, params, 0, request_id=f"a{i}")
            assert alone == out
            assert_close(state.logprobs, alone_state.logprobs, 1e-3)
    # drafted tokens were committed, so their logprobs were checked (sampled tokens seldom
    # repeat an n-gram: there the n-gram drafter's case checks the target's own tokens)
    assert accepted > 0 or kind == "ngram" and mode != "greedy"


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_draft_trees_tokens_carry_the_targets_own_logprobs(target, mode):
    """Tree rounds (width 3, 8 nodes, K = 4): the logprobs are taken along the accepted path,
    each drafted node's at its parent's row, also where the path leaves the main chain."""
    drafter, verifier = ModelDrafter(noisy_copy(target, 0.3, seed=2)), ModelVerifier(target)
    siblings = 0
    for i, prompt in enumerate(PROMPTS):
        out, state = run(drafter, verifier, prompt, MODES[mode], 4, request_id=f"t{i}",
                         tree_width=3, tree_nodes=8)
        assert_close(state.logprobs, reference(target, prompt, out))
        siblings += state.stats.sibling_rounds
    assert siblings > 0  # a path off the main chain was taken, and its logprobs checked


def test_logprobs_travel_the_wire_and_zero_top_is_the_token_only():
    logprobs = PositionLogprobs((-0.5,), (-0.1, -2.0), (((3, -0.1), (4, -0.2)),
                                                         ((1, -0.3), (3, -0.9))))
    scores = TargetScores(target_token_ids=(3, 1), logprobs=logprobs)
    back = scores_from_proto(scores_to_proto(scores)).logprobs
    assert back.drafted == pytest.approx(logprobs.drafted)
    assert back.chosen == pytest.approx(logprobs.chosen)
    assert [[t for t, _ in row] for row in back.top] == [[3, 4], [1, 3]]
    bare = PositionLogprobs((), (-0.25,), ((),))
    assert scores_from_proto(scores_to_proto(TargetScores((7,), logprobs=bare))).logprobs == bare


def test_more_logprobs_than_the_vocabulary_refuse_their_call_not_its_batch():
    verifier = ModelVerifier(tiny_llama(3, vocab_size=16))
    sync = PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3))
    good, bad = (ScoreCall(name, sync, (), SamplingParams(temperature=0, logprobs=n))
                 for name, n in (("good", 16), ("bad", 17)))
    scores, refusal = verifier.score_batch([good, bad])
    assert len(scores.logprobs.top[0]) == 16 and "vocabulary of 16" in str(refusal)
    assert isinstance(refusal, ValueError) and "good" in verifier.sessions


def test_stop_tokens_cut_the_logprobs_with_the_tokens(target):
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=0)
    drafter, verifier = DRAFTERS["noisy"](target), ModelVerifier(target)
    full, _ = run(drafter, verifier, PROMPTS[1], params, 3, request_id="full")
    stop = full[5]
    out, state = run(drafter, verifier, PROMPTS[1], params, 3, request_id="cut", stop=(stop,))
    assert out[-1] == stop and len(state.logprobs) == len(out) < len(full)
    assert all(entry.top == () for entry in state.logprobs)


def test_a_cut_round_keeps_the_logprobs_of_the_tokens_it_keeps():
    """A round's output cut by a stop token mid-block or by max_tokens, or later by a stop
    string (stop_after), keeps one logprob per output token, each the token's own (the
    test above leaves where its stop token falls in a round to the run)."""
    from speculative.state import Request, RequestState

    params = SamplingParams(temperature=0, max_tokens=3, logprobs=0)
    block = (4, 7, 5, 6)
    entries = [TokenLogprob(token, -0.5 * (i + 1)) for i, token in enumerate(block)]
    stopped = RequestState(Request("r", (1,), params, stop_token_ids=(7,)))
    assert stopped.commit(block, entries) == [4, 7] and stopped.finish_reason == "stop"
    assert stopped.logprobs == entries[:2]
    full = RequestState(Request("r", (1,), params))
    assert full.commit(block, entries) == [4, 7, 5] and full.logprobs == entries[:3]
    full.stop_after(2)  # a stop string completed by the second token
    assert full.output_token_ids == [4, 7] and full.logprobs == entries[:2]

"""The pools' batches: a verifier's score_batch and a drafter's propose_batch answer each call
as it is answered alone (greedy, sampled, shaped, of several laws and lengths), refusals stay
with their call, a prefill call reserves its prompt, and batched requests that join, leave and
are evicted decode the target's greedy output. The packed forward below them: test_batch."""

import pytest
import torch

from drafter.model import ModelDrafter
from engine.scheduler import KVCacheTooSmall
from speculative.prefixes import prefix_hash
from speculative.sampling import SamplingParams
from speculative.types import DraftDists, PrefixSync, ProposeCall, ScoreCall, StaleBase
from tests.tiny import Batched, hf_greedy, noisy_copy, run_concurrently, tiny_llama
from tests.unit.test_batch import full_logits, sync
from verifier.engine import ModelVerifier

GREEDY = SamplingParams(temperature=0.0)


def test_refusals_stay_with_their_call_and_a_repeated_request_waits_for_the_next_forward():
    model = tiny_llama(1)
    verifier, alone = ModelVerifier(model), ModelVerifier(model)
    calls = [ScoreCall("a", sync([], [1, 2, 3]), (4, 5), GREEDY),
             ScoreCall("bad", sync([], [1, 99]), (), GREEDY),  # outside the vocabulary
             ScoreCall("gone", sync([1, 2], [3]), (4,), GREEDY),  # a base never seen here
             ScoreCall("b", sync([], [6, 7]), (8, 9, 10), GREEDY),
             ScoreCall("a", sync([1, 2, 3], [4, 5, 6]), (7,), GREEDY)]  # a's next round
    results = verifier.score_batch(calls)
    assert isinstance(results[1], ValueError) and isinstance(results[2], StaleBase)
    for index in (0, 3, 4):
        assert results[index].target_token_ids == alone.score_now(calls[index]).target_token_ids
    assert results[0].load.batch_size == 2 and results[4].load.batch_size == 1
    assert results[3].load.batch_tokens == 2 + 3 + 2 + 3  # a's 3 + 2 and b's 2 + 3 fed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafting_in_a_batch_equals_drafting_alone(temperature):
    draft = tiny_llama(4)
    batch_drafter, alone = ModelDrafter(draft, draft_q_mass=0.99), \
        ModelDrafter(draft, draft_q_mass=0.99)
    params = SamplingParams(temperature=temperature)
    calls = [ProposeCall(f"r{i}", sync([], list(range(1 + i, 4 + 3 * i))), k, params,
                         seed=100 + i, assumed_token_ids=tuple(range(i)))
             for i, k in enumerate([1, 4, 2, 6])]
    together = batch_drafter.propose_batch(calls)
    for call, block in zip(calls, together):
        single = alone.propose_now(call)
        assert block.token_ids == single.token_ids
        assert len(block.token_ids) == call.num_speculative_tokens
        if temperature:  # the same q up to float reassociation (each ships what it drew from)
            torch.testing.assert_close(block.draft_probs.dense(), single.draft_probs.dense(),
                                       atol=1e-5, rtol=0)
    assert together[0].load.batch_size == 4


def test_a_call_of_no_tokens_prefills_and_the_first_draft_finds_the_prompt_cached():
    """A request's first call asks for 0 tokens beside the target's first verify: the
    drafter feeds the prompt then, and the draft after it feeds only what was committed
    since, drafting the block a cold draft does."""
    greedy = SamplingParams(temperature=0)
    prompt = tuple((7 * i) % 60 + 1 for i in range(50))
    blocks = {}
    for prefilled in (False, True):
        drafter, fed = ModelDrafter(tiny_llama(4)), []
        forward = drafter.runner.forward
        drafter.runner.forward = lambda segments: (
            fed.append([len(s.token_ids) for s in segments]), forward(segments))[1]
        if prefilled:
            empty = drafter.propose_batch([ProposeCall("r", PrefixSync(0, prefix_hash([]),
                                                                       prompt), 0, greedy, 0)])
            assert empty[0].token_ids == () and fed == [[50]]
            sync = PrefixSync(len(prompt), prefix_hash(list(prompt)), (5,))
        else:
            sync = PrefixSync(0, prefix_hash([]), prompt + (5,))
        [blocks[prefilled]] = drafter.propose_batch([ProposeCall("r", sync, 3, greedy, 0)])
        assert fed[-3][0] == (1 if prefilled else 51)  # the first draft step's feed
    assert blocks[True].token_ids == blocks[False].token_ids


def test_a_call_of_no_tokens_reserves_its_whole_prompt_before_its_forward():
    """A prefill's blocks are reserved for every position it feeds, so a prompt one position
    past the pool is refused at admission (its call alone) and its batch-mate drafts,
    instead of the pool running out inside the batch's forward."""
    greedy = SamplingParams(temperature=0)
    drafter = ModelDrafter(tiny_llama(4), kv_cache_tokens=64)  # four blocks of 16
    too_long = tuple((7 * i) % 60 + 1 for i in range(65))
    short = (3, 1, 4, 1, 5)
    refused, block = drafter.propose_batch([
        ProposeCall("long", PrefixSync(0, prefix_hash([]), too_long), 0, greedy, 0),
        ProposeCall("short", PrefixSync(0, prefix_hash([]), short), 3, greedy, 0)])
    assert isinstance(refused, KVCacheTooSmall) and "65 positions" in str(refused)
    assert list(block.token_ids) == hf_greedy(drafter.model, list(short), 3)


@pytest.mark.parametrize("engine", ["auto", "transformers"])
def test_greedy_drafts_are_the_draft_models_own_continuation_across_rollbacks(engine):
    """Each greedy block is what the draft model generates alone from the committed prefix,
    round after round, for two requests drafted together: rounds that accept part of a
    block and commit a token of their own (the draft's cache rolls back), and rounds that
    accept it whole (the block's last token, never fed, is fed with the next)."""
    draft = tiny_llama(4)
    drafter = ModelDrafter(draft, engine=engine)
    params = SamplingParams(temperature=0.0)
    committed = {"a": [3, 1, 4, 1, 5], "b": [2, 7, 1, 8, 2, 8, 1, 8]}
    known = {request_id: [] for request_id in committed}
    accepted = iter([0, 4, 2, 4, 1, 3, 4, 0, 2, 4, 4, 1] * 2)
    for round_ in range(12):
        calls = [ProposeCall(request_id, sync(known[request_id], ids[len(known[request_id]):]),
                             4, params, seed=0) for request_id, ids in committed.items()]
        for call, block in zip(calls, drafter.propose_batch(calls)):
            ids = committed[call.request_id]
            assert list(block.token_ids) == hf_greedy(draft, ids, 4), (round_, call.request_id)
            known[call.request_id] = ids
            committed[call.request_id] = ids + list(block.token_ids[:next(accepted)]) + \
                [(7 * round_ + len(ids)) % 64]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shaped_drafts_in_a_batch_equal_drafting_alone(temperature):
    """Drafts under penalties, a bias and min_tokens, beside a plain one: shaped together in
    each step, the sampled ones drawn with the drafts of their law (q cut to its top 3), they
    draw the tokens and ship the q each draws alone. The bias bans the first token the last
    call drafts unshaped, so the shaping shows."""
    draft = tiny_llama(4)
    batch_drafter, alone = ModelDrafter(draft, draft_top_k=3), ModelDrafter(draft, draft_top_k=3)
    plain = SamplingParams(temperature=temperature)

    def call(i: int, k: int, params: SamplingParams) -> ProposeCall:
        return ProposeCall(f"r{i}", sync([], list(range(1 + i, 4 + 3 * i))), k, params,
                           seed=100 + i, assumed_token_ids=tuple(range(i)), prompt_len=2)

    unshaped = ModelDrafter(draft, draft_top_k=3).propose_now(call(3, 5, plain))
    shaped = SamplingParams(temperature=temperature, presence_penalty=1.0, repetition_penalty=1.3,
                            logit_bias=((unshaped.token_ids[0], -100.0), (7, 2.0)), min_tokens=4,
                            min_tokens_end_ids=(5,))
    calls = [call(i, k, params)
             for i, (k, params) in enumerate([(3, shaped), (4, plain), (2, shaped), (5, shaped)])]
    together = batch_drafter.propose_batch(calls)
    for one, block in zip(calls, together):
        single = alone.propose_now(one)
        assert block.token_ids == single.token_ids
        if temperature:
            torch.testing.assert_close(block.draft_probs.dense(), single.draft_probs.dense(),
                                       atol=1e-5, rtol=0)
    assert together[3].token_ids[0] != unshaped.token_ids[0]


@pytest.mark.parametrize("pipelined", [False, True])
def test_greedy_oracle_with_requests_joining_and_leaving_batches(pipelined):
    """Eight requests of different prompt and output lengths decode at once through batched
    pools (each finishes, and leaves its batches, at its own time); every one's output is the
    target's own greedy decoding."""
    target = tiny_llama(1)
    draft = noisy_copy(target, 0.02, seed=5)
    verifier, drafter = Batched(ModelVerifier(target)), Batched(ModelDrafter(draft))
    prompts = [[(3 * i + j) % 60 + 1 for j in range(2 + 3 * i)] for i in range(8)]
    lengths = [6 + 5 * (i % 4) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=max(lengths))
    outputs = run_concurrently(drafter, verifier, prompts, params, 3, lengths, pipelined)
    for prompt, length, output in zip(prompts, lengths, outputs):
        assert output == hf_greedy(target, prompt, length)
    assert max(verifier.batch_sizes) >= 6 and min(verifier.batch_sizes) < 6  # joined and left
    assert max(drafter.batch_sizes) >= 6


def test_a_request_evicted_while_its_batch_mates_run_is_rebuilt_exactly():
    """Pools that hold only 3 caches serve 6 concurrent requests: caches are evicted under
    running requests round after round, and each is rebuilt from its prefix."""
    target = tiny_llama(1)
    draft = noisy_copy(target, 0.02, seed=6)
    verifier = Batched(ModelVerifier(target, max_cached_requests=3))
    drafter = Batched(ModelDrafter(draft, max_cached_requests=3))
    prompts = [[i + 1, i + 2, i + 3] for i in range(6)]
    outputs = run_concurrently(drafter, verifier, prompts, SamplingParams(temperature=0.0,
                               max_tokens=12), 3)
    assert verifier.engine.sessions.stats.evictions > 0
    for prompt, output in zip(prompts, outputs):
        assert output == hf_greedy(target, prompt, 12)


def test_a_verify_batch_moves_its_answers_to_the_host_once(monkeypatch):
    """Greedy picks and sampled draws of every call of a batch stay on the device until one
    transfer (on a GPU, one synchronisation per batch, not one per call); the answers equal
    each call's alone."""
    target = tiny_llama(1)
    vocab = target.config.vocab_size
    q = torch.full((2, vocab), 1.0 / vocab)
    calls = [ScoreCall(f"g{i}", sync([], [1 + i, 2, 3]), (4, 5), GREEDY) for i in range(3)]
    calls += [ScoreCall(f"s{i}", sync([], [2 + i, 3]), (6, 7), SamplingParams(temperature=1.0),
                        seed=10 + i, draft_probs=DraftDists.from_dense(q)) for i in range(3)]
    transfers = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: transfers.append(1) or tolist(self))
    together = ModelVerifier(target).score_batch(calls)
    assert len(transfers) == 1
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    for call, answer in zip(calls, together):
        alone = ModelVerifier(target).score_now(call)
        assert (answer.target_token_ids, answer.recovered_token_ids, answer.bonus_token_id) == \
            (alone.target_token_ids, alone.recovered_token_ids, alone.bonus_token_id)
        assert answer.draft_target_probs == pytest.approx(alone.draft_target_probs, abs=1e-6)


def test_a_pools_batch_runs_in_inference_mode():
    """The verifier's and the drafter's batches, from their calls' checks to their answers,
    run under torch.inference_mode (no autograd bookkeeping on their many small operations:
    docs/engine.md); outside a batch the mode is off again."""
    target = tiny_llama(1)
    verifier, drafter = ModelVerifier(target), ModelDrafter(noisy_copy(target, 0.02, seed=5))
    modes = []

    def spied(method):
        return lambda *args: modes.append(torch.is_inference_mode_enabled()) or method(*args)

    verifier.prepare = spied(verifier.prepare)
    drafter.draft_together = spied(drafter.draft_together)
    sampled = SamplingParams(temperature=1.0)
    block = drafter.propose_now(ProposeCall("r", sync([], [1, 2, 3]), 2, sampled, seed=1))
    verifier.score_now(ScoreCall("r", sync([], [1, 2, 3]), block.token_ids, sampled, seed=2,
                                 draft_probs=block.draft_probs))
    assert modes == [True, True] and not torch.is_inference_mode_enabled()


def test_greedy_and_sampled_drafts_of_several_laws_in_one_batch_each_draw_their_own():
    """A step's tokens come back to the drafts they were drawn for when greedy and sampled
    drafts (of two laws) interleave in the batch: each block is the one its call drafts
    alone, its tokens drawn from the q it ships."""
    draft = tiny_llama(4)
    batch_drafter, alone = ModelDrafter(draft, draft_top_k=4), ModelDrafter(draft, draft_top_k=4)
    laws = [SamplingParams(temperature=1.0), GREEDY, SamplingParams(temperature=0.7), GREEDY,
            SamplingParams(temperature=1.0)]
    calls = [ProposeCall(f"r{i}", sync([], [1 + i, 2 + 2 * i, 3]), 3, params, seed=50 + i)
             for i, params in enumerate(laws)]
    for call, block in zip(calls, batch_drafter.propose_batch(calls)):
        single = alone.propose_now(call)
        assert block.token_ids == single.token_ids, call.request_id
        if block.draft_probs is not None:  # each token is one its own q can draw
            dense = block.draft_probs.dense()
            assert all(dense[i, token] > 0 for i, token in enumerate(block.token_ids))


def test_sampled_chains_of_different_lengths_share_a_verify_batch():
    """Requests at different K (an adaptive K, a request's end) in one batch: each answer is
    the call's alone, none takes the batch down."""
    target = tiny_llama(1)
    vocab = target.config.vocab_size
    sampled = SamplingParams(temperature=1.0)
    calls = [ScoreCall(f"s{k}", sync([], [2 + k, 3, 5]), tuple(range(6, 6 + k)), sampled,
                       seed=10 + k, draft_probs=DraftDists.from_dense(
                           torch.full((k, vocab), 1.0 / vocab)) if k else None)
             for k in (1, 3, 0, 2)]
    together = ModelVerifier(target).score_batch(calls)
    for call, answer in zip(calls, together):
        assert not isinstance(answer, Exception), answer
        alone = ModelVerifier(target).score_now(call)
        assert (answer.recovered_token_ids, answer.bonus_token_id) == \
            (alone.recovered_token_ids, alone.bonus_token_id)
        assert answer.draft_target_probs == pytest.approx(alone.draft_target_probs, abs=1e-6)


def test_the_bonus_law_returned_is_the_position_after_the_draft():
    """return_bonus_probs gives p(K+1), the target's law after the drafted tokens (what a
    pre-drafted y1 is tested against), not a drafted position's."""
    target = tiny_llama(1)
    vocab = target.config.vocab_size
    prompt, drafted = [2, 3, 5], (6, 7)
    call = ScoreCall("b", sync([], prompt), drafted, SamplingParams(temperature=1.0), seed=3,
                     draft_probs=DraftDists.from_dense(torch.full((2, vocab), 1.0 / vocab)),
                     return_bonus_probs=True)
    scores = ModelVerifier(target).score_now(call)
    expected = full_logits(target, prompt + list(drafted))[-1].softmax(-1)
    torch.testing.assert_close(scores.bonus_probs.dense()[0], expected, atol=1e-5, rtol=0)

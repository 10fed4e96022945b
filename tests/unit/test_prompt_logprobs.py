"""Prompt logprobs (vLLM's prompt_logprobs): the verifier's forward of a prompt
(verifier.prompt_scores), its wire and its pool's rpc. The router's answers with them and
the completions API's echo: test_prompt_answers."""

import asyncio

import grpc
import pytest
import torch

from deployments import auth, wire
from deployments.limits import Limits, check_prompt_logprobs
from deployments.pool_args import VerifierArgs
from deployments.pools import VerifierPool
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from speculative.types import PromptLogprobs
from tests.tiny import tiny_llama, tiny_sliding
from tests.unit.test_pool_replica import direct, local_replica
from verifier import prompt_scores
from verifier.prompt_scores import PromptScoring, prompt_logprobs

PROMPT = [1, 5, 9, 3, 7, 2, 8, 11, 4, 60]


def reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("chunk_tokens", [1, 3, None])
def test_a_prompts_logprobs_are_the_targets_own_whatever_its_chunks(chunk_tokens):
    """Each token after the first: its logprob under the target given the tokens before it,
    its rank (the tokens at least as likely, as vLLM's) and its position's top n, as one
    forward of the whole prompt gives them, fed in chunks of any size."""
    model = tiny_llama(0)
    scoring = PromptScoring(model, PROMPT, 4, None, chunk_tokens)
    steps = 0
    while not scoring.done:
        scoring.step()
        steps += 1
    got = scoring.result()
    assert steps == -(-(len(PROMPT) - 1) // (chunk_tokens or len(PROMPT)))
    full = reference(model, PROMPT)
    assert [entry.token_id for entry in got.entries] == PROMPT[1:]
    for row, (entry, rank) in enumerate(zip(got.entries, got.ranks)):
        token = PROMPT[row + 1]
        assert entry.logprob == pytest.approx(full[row, token].item(), abs=1e-5)
        assert rank == int((full[row] >= full[row, token]).sum())
        values, ids = torch.topk(full[row], 4)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-5)


def test_a_one_token_prompt_has_no_rows_and_a_chunk_keeps_its_logits_bounded(monkeypatch):
    model = tiny_llama(0)
    assert prompt_logprobs(model, [5], 3) == PromptLogprobs((), ())
    monkeypatch.setattr(prompt_scores, "CHUNK_LOGITS_BYTES", 2 * 4 * 64)  # two rows of 64
    assert PromptScoring(model, PROMPT, 0, None).chunk == 2


def test_a_token_tied_with_the_top_n_yet_not_among_them_ranks_past_them():
    """vLLM's rank (the tokens at least as likely, itself among them): a prompt token tied
    with its row's likeliest, which topk did not list, ranks 2, not 1 beside the listed
    one's 1 (a bfloat16 model's rows tie often); a NaN row's token still ranks 1."""
    logits = torch.tensor([[2.0, 2.0, 0.0, -1.0], [float("nan")] * 4])
    unlisted = 1 - int(torch.topk(logits[0], 1).indices)
    entries, ranks = prompt_scores.read_rows(logits, torch.tensor([unlisted, 2]), 1)
    assert [token for token, _ in entries[0].top] == [1 - unlisted]
    assert ranks == [2, 1]


@pytest.mark.parametrize("mixed", [False, True])
def test_a_sliding_window_models_prompt_keeps_its_window_not_the_whole_prompt(mixed):
    """A sliding layer's cache records its past (for a session's rollback): each chunk's
    end trims it back to the window, the logprobs still the model's own forward's."""
    model = tiny_sliding(0, window=4, mixed=mixed)
    ids = PROMPT + [33, 21, 17, 13]
    scoring = PromptScoring(model, ids, 2, None, 3)
    while not scoring.done:
        scoring.step()
        assert all(layer.keys.shape[-2] <= 3 for layer in scoring.cache.layers
                   if getattr(layer, "is_sliding", False))
    full = reference(model, ids)
    assert [entry.logprob for entry in scoring.result().entries] == pytest.approx(
        [full[row, token].item() for row, token in enumerate(ids[1:])], abs=1e-5)


@pytest.mark.parametrize("ids, top_n, limit, message", [
    ([1, 64], 1, None, "out of range"), ([1, 2, 3], 1, 2, "exceed the target's context"),
    ([1, 2], 65, None, "vocabulary of 64"), ([1, 2], -1, None, "vocabulary of 64")])
def test_a_bad_prompt_is_refused_before_the_model_runs(ids, top_n, limit, message):
    with pytest.raises(ValueError, match=message):
        PromptScoring(tiny_llama(0), ids, top_n, limit)


def test_prompt_logprobs_cross_the_wire_and_a_misshapen_answer_is_refused():
    scores = prompt_logprobs(tiny_llama(0), PROMPT, 3)
    message = pb.PromptLogprobsResponse.FromString(
        wire.prompt_logprobs_to_proto(scores, 3).SerializeToString())
    back = wire.prompt_logprobs_from_proto(message, PROMPT)
    assert back.ranks == scores.ranks
    assert [e.token_id for e in back.entries] == PROMPT[1:]
    for got, sent in zip(back.entries, scores.entries):
        assert got.logprob == pytest.approx(sent.logprob)  # float32 on the wire
        assert [t for t, _ in got.top] == [t for t, _ in sent.top]
    with pytest.raises(ValueError, match="rows"):
        wire.prompt_logprobs_from_proto(message, PROMPT[:-1])


@pytest.mark.parametrize("fields, message", [
    ({"token_ids": []}, "at least one token"), ({"token_ids": [1], "top_n": 21}, "at most 20"),
    ({"token_ids": [1] * 33}, "exceed the context"), ({"token_ids": [64]}, "out of range"),
    ({"token_ids": [1], "request_id": ""}, "request_id")])
def test_a_pool_checks_a_prompt_logprobs_call_before_it_decodes_it(fields, message):
    request = pb.PromptLogprobsRequest(**{"request_id": "r", **fields})
    with pytest.raises(ValueError, match=message):
        check_prompt_logprobs(request, Limits(64, 32))
    check_prompt_logprobs(pb.PromptLogprobsRequest(request_id="r", token_ids=[1], top_n=20),
                          Limits(64, 32))


def test_the_limits_leave_room_for_a_whole_contexts_prompt_logprobs():
    limits = Limits(64, 100_000)
    assert limits.message_bytes() >= 100_000 * (9 + 9 * 20)


@pytest.fixture
def pool_secret(monkeypatch):
    monkeypatch.setenv(auth.ENV, "test-secret")
    monkeypatch.setattr(auth, "_secret", None)


def test_a_verifier_replica_answers_a_prompts_logprobs_over_its_port(pool_secret):
    """The rpc on a replica's own port (Serve's proxy calls the same method): the target's
    logprobs, as the model gives them; a bad call INVALID_ARGUMENT; no secret,
    UNAUTHENTICATED; the replica holds no session after it."""
    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs(max_batch_tokens=16))
        expected = prompt_logprobs(replica.engine.model, list(range(1, 41)), 2)
        async with direct(replica, pb_grpc.VerifierStub) as stub:
            answer = await stub.PromptLogprobs(pb.PromptLogprobsRequest(
                request_id="p", token_ids=range(1, 41), top_n=2), metadata=auth.metadata())
            codes = []
            for request, metadata in (
                    (pb.PromptLogprobsRequest(request_id="p", token_ids=[1], top_n=21),
                     auth.metadata()),
                    (pb.PromptLogprobsRequest(request_id="p", token_ids=[1]), None)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.PromptLogprobs(request, metadata=metadata)
                codes.append(refused.value.code())
        return answer, expected, codes, replica.session_ids()

    answer, expected, codes, sessions = asyncio.run(main())
    got = wire.prompt_logprobs_from_proto(answer, list(range(1, 41)))
    assert got.ranks == expected.ranks
    assert [e.logprob for e in got.entries] == pytest.approx(
        [e.logprob for e in expected.entries], abs=1e-5)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED]
    assert sessions == []


def test_a_replica_scores_one_prompt_at_a_time(pool_secret, monkeypatch):
    """Each prompt's scoring holds its whole prompt's cache, outside the KV pool's budget: a
    replica runs one at a time (a batch of 128 prompts, or many requests', held them all
    at once, chunk by chunk), each as the model gives it."""
    live, most = set(), []
    step = PromptScoring.step

    def tracked(scoring):
        live.add(id(scoring))
        most.append(len(live))
        step(scoring)
        if scoring.done:
            live.discard(id(scoring))

    monkeypatch.setattr(PromptScoring, "step", tracked)

    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs(max_batch_tokens=16))
        prompts = [list(range(start, start + 40)) for start in (1, 2, 3)]
        answers = await asyncio.gather(*(replica.PromptLogprobs(pb.PromptLogprobsRequest(
            request_id=f"p{i}", token_ids=ids, top_n=1)) for i, ids in enumerate(prompts)))
        await replica.server.stop(None)
        return replica.engine.model, prompts, answers

    model, prompts, answers = asyncio.run(main())
    assert max(most) == 1
    for ids, answer in zip(prompts, answers):
        expected = prompt_logprobs(model, ids, 1)
        assert wire.prompt_logprobs_from_proto(answer, ids).ranks == expected.ranks

"""A pool replica's own gRPC port: it serves only callers with the secret, listens on
loopback by default, and refuses hostile messages fast, before any allocation."""

import asyncio
import math

import grpc
import pytest
import torch

from deployments import auth, wire_tensors
from deployments.pool_args import VerifierArgs
from deployments.pools import VerifierPool
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from tests.unit.test_pool_replica import KEY, direct, local_drafter, local_replica, propose


@pytest.fixture(autouse=True)
def pool_secret(monkeypatch):
    monkeypatch.setenv(auth.ENV, "test-secret")
    monkeypatch.setattr(auth, "_secret", None)


def score(request_id: str, **fields) -> pb.ScoreRequest:
    fields = {"draft_token_ids": [8, 9], **fields}
    return pb.ScoreRequest(request_id=request_id, sync=pb.PrefixSync(new_token_ids=[5, 6, 7]),
                           sampling=pb.SamplingParams(temperature=1), seed=1, **fields)


def q(rows: int, vocab: int, value: float = 0.5, token: int = 0) -> pb.Distributions:
    """A sparse q of one entry per row, as a truncating drafter ships it."""
    probs = torch.full((rows, 1), value)
    ids = torch.full((rows, 1), token, dtype=torch.int32)
    return pb.Distributions(ids=wire_tensors.tensor_to_proto(ids),
                            probs=wire_tensors.tensor_to_proto(probs), vocab_size=vocab)


def test_pools_serve_only_callers_with_the_secret():
    async def main():
        replica = await local_drafter()
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            for metadata in [None, ((auth.METADATA_KEY, "guess"),)]:
                for call in (stub.Propose(propose("a"), metadata=metadata),
                             stub.Release(pb.ReleaseRequest(request_id="a"), metadata=metadata)):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert len(replica.engine.sessions) == 0  # nothing reached the engine
            answer = await stub.Propose(propose("a"), metadata=KEY())
            assert len(answer.token_ids) == 3

    asyncio.run(main())


def test_the_direct_port_listens_on_loopback_by_default():
    async def main():
        replica = await local_drafter()
        assert replica.address.startswith("127.0.0.1:")
        await replica.server.stop(None)

    asyncio.run(main())


def test_hostile_messages_are_refused_fast_before_any_allocation():
    """Each answers INVALID_ARGUMENT within seconds (a 2^24-entry vocabulary once made the
    verifier allocate ~17 GB), and the replica answers a good call afterwards."""
    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs())
        vocab = replica.limits.vocab_size
        async with direct(replica, pb_grpc.VerifierStub) as stub:
            long_prefix = score("long")
            long_prefix.sync.new_token_ids[:] = [1] * 300_000
            many_drafts = score("many")
            many_drafts.draft_token_ids[:] = [1] * 100_000
            bad = {
                "huge vocabulary": score("v", draft_probs=q(2, 2**24)),
                "300k-token prefix": long_prefix,
                "K = 100000": many_drafts,
                "NaN q": score("nan", draft_probs=q(2, vocab, math.nan)),
                "negative q": score("neg", draft_probs=q(2, vocab, -0.5)),
                "q rows unlike the draft": score("rows", draft_probs=q(5, vocab)),
                "q id outside the vocabulary": score("qid", draft_probs=q(2, vocab, token=vocab)),
                "unknown id": score("id", draft_token_ids=[vocab + 1]),
                "no request id": score(""),
            }
            for name, message in bad.items():
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Score(message, metadata=KEY())
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                # refused before any allocation: no session, no KV block taken
                assert len(replica.engine.sessions) == 0, name
            good = await stub.Score(score("good", draft_probs=q(2, vocab, 1.0)), metadata=KEY())
            assert len(good.sampled.draft_target_probs) == 2

    asyncio.run(main())

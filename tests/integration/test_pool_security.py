"""Only the router can drive the pools: a call without the pool secret gets UNAUTHENTICATED
through Serve's gRPC proxy and on a replica's own port, an HTTP request a 404; hostile input
gets INVALID_ARGUMENT fast, and the pool keeps serving."""

import time

import grpc
import pytest
import requests
import torch

from deployments import auth, wire_tensors
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc


def score(request_id: str, temperature: float = 1, **fields) -> pb.ScoreRequest:
    fields = {"draft_token_ids": [8, 9], **fields}
    return pb.ScoreRequest(request_id=request_id, sync=pb.PrefixSync(new_token_ids=[5, 6, 7]),
                           sampling=pb.SamplingParams(temperature=temperature, top_p=1),
                           seed=1, **fields)


def routed(request_id: str, key: bool = True):
    return (("application", "verifier"), ("session_id", request_id),
            *(auth.metadata() if key else ()))


def test_unauthenticated_calls_are_refused_on_both_paths(cluster):
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        for metadata in (routed("u", key=False),
                         routed("u", key=False) + ((auth.METADATA_KEY, "guess"),)):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Score(score("u"), metadata=metadata, timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = stub.Score(score("u", 0), metadata=routed("u"), timeout=30)
        stub.Release(pb.ReleaseRequest(request_id="u"), metadata=routed("u"), timeout=30)
    assert answer.direct_address.startswith("127.0.0.1:")  # loopback in the embedded config
    with grpc.insecure_channel(answer.direct_address) as direct:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.VerifierStub(direct).Score(score("d"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.VerifierStub(direct).Release(pb.ReleaseRequest(request_id="d"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_http_requests_to_the_pools_apps_are_404_not_500(cluster):
    """The pools' applications have route prefixes (Serve's gRPC proxy routes calls by
    them), so Serve's HTTP proxy passes them requests too: Serve answered 500 there."""
    for path in ("/drafter", "/verifier/v1/completions"):
        answer = requests.post(cluster.base_url + path, json={}, timeout=30)
        assert answer.status_code == 404, (path, answer.text)
        assert "gRPC only" in answer.json()["error"]["message"]


def sparse_q(rows: int, vocab: int, value: float) -> pb.Distributions:
    ids = torch.zeros(rows, 1, dtype=torch.int32)
    return pb.Distributions(ids=wire_tensors.tensor_to_proto(ids),
                            probs=wire_tensors.tensor_to_proto(torch.full((rows, 1), value)),
                            vocab_size=vocab)


def test_hostile_pool_input_is_refused_fast_and_the_pool_stays_healthy(cluster):
    long_prefix = score("long")
    long_prefix.sync.new_token_ids[:] = [1] * 300_000
    many = score("many")
    many.draft_token_ids[:] = [1] * 100_000
    hostile = {"a 2^24-token vocabulary in a sparse q": score("v", draft_probs=sparse_q(2, 2**24, 0.5)),
               "a 300k-token prefix": long_prefix, "K = 100000": many,
               "NaN probabilities": score("nan", draft_probs=sparse_q(2, 4096, float("nan")))}
    seconds = {}
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        for name, message in hostile.items():
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                stub.Score(message, metadata=routed(message.request_id), timeout=30)
            seconds[name] = round(time.monotonic() - started, 3)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    print(f"\nhostile pool input, seconds to INVALID_ARGUMENT: {seconds}")
    # refused before any work: the verifier holds no session of theirs (a call that got as
    # far as a cache would have left one)
    from ray import serve

    held = serve.get_deployment_handle("VerifierPool", "verifier").session_ids.remote().result()
    assert not set(held) & {m.request_id for m in hostile.values()}, held
    response = cluster.post("/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert response.status_code == 200

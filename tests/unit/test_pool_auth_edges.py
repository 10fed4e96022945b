"""Edges of the pool credentials: a call without a gRPC context (a Ray handle's) is trusted,
one over gRPC needs the secret exactly, and the generated secret is put once and read by every
process (the first put wins: a later process must not replace it)."""

from types import SimpleNamespace

import pytest
from ray.experimental import internal_kv

from deployments import auth


@pytest.fixture(autouse=True)
def pool_secret(monkeypatch):
    monkeypatch.setenv(auth.ENV, "test-secret")
    monkeypatch.setattr(auth, "_secret", None)


def context(metadata) -> SimpleNamespace:
    return SimpleNamespace(invocation_metadata=lambda: metadata)


def test_a_call_needs_the_secret_exactly_unless_it_has_no_grpc_context():
    assert auth.authorized(None)  # a Ray handle's call, or this process's
    assert auth.authorized(context(auth.metadata()))
    for sent in [(), ((auth.METADATA_KEY, ""),), ((auth.METADATA_KEY, "test"),),
                 ((auth.METADATA_KEY, "test-secret!"),), (("other-key", "test-secret"),)]:
        assert not auth.authorized(context(sent)), sent


def test_the_generated_secret_is_the_first_processs_for_every_process(monkeypatch):
    """Two processes generate two secrets; both read the one put first (put if absent), so
    the router's calls carry the secret the pools compare with."""
    store: dict[bytes, bytes] = {}

    def put(key, value, overwrite=False):
        if overwrite or key not in store:
            store[key] = value

    monkeypatch.setattr(internal_kv, "_internal_kv_put", put)
    monkeypatch.setattr(internal_kv, "_internal_kv_get", store.get)
    first = auth.shared_through_ray()
    assert len(first) == 64 and auth.shared_through_ray() == first
    monkeypatch.delenv(auth.ENV)
    assert auth.pool_secret() == first  # without the operator's secret, the shared one

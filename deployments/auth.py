"""Pool credentials: only the router may drive the pools.

Every pool rpc (Propose, Score, Release), over Serve's gRPC proxy or a replica's own port,
carries the metadata `x-specserve-pool-key`; a pool compares it with its secret in constant
time and answers UNAUTHENTICATED otherwise. The secret is the environment variable
SPECSERVE_POOL_SECRET when the operator sets it (the same in every process of the cluster);
otherwise the first process that asks generates one and stores it in Ray's internal key-value
store, where the router and the other pools find it. It is never written to a config file, so
`serve run cluster/config.yaml` stays one command.
"""

import hmac
import os
import secrets

ENV = "SPECSERVE_POOL_SECRET"
METADATA_KEY = "x-specserve-pool-key"
KV_KEY = b"specserve/pool-secret"

_secret: str | None = None


def pool_secret() -> str:
    global _secret
    if _secret is None:
        _secret = os.environ.get(ENV) or shared_through_ray()
    return _secret


def shared_through_ray() -> str:
    """The cluster's generated secret: put if absent, then read (the apps start in
    different processes; whichever puts first wins, and all read the same)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(KV_KEY, secrets.token_hex(32).encode(), overwrite=False)
    return internal_kv._internal_kv_get(KV_KEY).decode()


def metadata() -> tuple[tuple[str, str], ...]:
    """What a pool client sends with every call."""
    return ((METADATA_KEY, pool_secret()),)


def authorized(grpc_context) -> bool:
    """Whether a call carries the pool secret. A call without a gRPC context comes from a
    Ray handle or from this process: whoever can do that already controls the cluster."""
    if grpc_context is None:
        return True
    sent = dict(grpc_context.invocation_metadata()).get(METADATA_KEY, "")
    return hmac.compare_digest(sent.encode(), pool_secret().encode())

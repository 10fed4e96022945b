"""Serve application builders named in the configs under cluster/ (`import_path`).

Each deployment names its class by import path, which the replica imports: a build imports
only Ray Serve and the apps' args (pydantic models, no torch or transformers), as each app's
build is a process of its own. The replicas still import everything they serve."""

from ray import serve
from ray.serve import Application

from deployments.pool_args import DrafterArgs, VerifierArgs
from deployments.router_args import RouterArgs

# Deployments of the classes of the same names (deployments.pools, deployments.router), which
# only their replicas import
DrafterPool = serve.deployment(name="DrafterPool")("deployments.pools.DrafterPool")
VerifierPool = serve.deployment(name="VerifierPool")("deployments.pools.VerifierPool")
Router = serve.deployment(name="Router")("deployments.router.Router")


def drafter_app(args: DrafterArgs) -> Application:
    return DrafterPool.bind(args)


def verifier_app(args: VerifierArgs) -> Application:
    return VerifierPool.bind(args)


def router_app(args: RouterArgs) -> Application:
    return Router.bind(args)

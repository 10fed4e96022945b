"""Serve application builders named in the configs under cluster/ (`import_path`)."""

from ray.serve import Application

from deployments.pool_args import DrafterArgs, VerifierArgs
from deployments.pools import DrafterPool, VerifierPool
from deployments.router import Router
from deployments.router_args import RouterArgs


def drafter_app(args: DrafterArgs) -> Application:
    return DrafterPool.bind(args)


def verifier_app(args: VerifierArgs) -> Application:
    return VerifierPool.bind(args)


def router_app(args: RouterArgs) -> Application:
    return Router.bind(args)

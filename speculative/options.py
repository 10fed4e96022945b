"""What a request may ask of speculation, and the router's and the CLI's defaults for it:
plain values, no torch, so that the router's args (deployments.router_args) import them
without the engine (a Serve app build imports only its args)."""

from dataclasses import dataclass
from typing import Literal

from speculative.policy import KBounds

MAX_SPECULATIVE_TOKENS = 64  # K, and a draft tree's nodes
MAX_PLAIN_STEPS = 64  # the tokens a call without a draft may ask for (verifier.steps)
MAX_TREE_WIDTH = 8  # a draft tree's children at a node

NumSpeculativeTokens = int | Literal["auto"]
PipelinedDrafting = Literal["off", "greedy", "on"]


@dataclass(frozen=True)
class TreeShape:
    """A draft tree per round (speculative.tree): `width` children at each node of the main
    chain, `depth` nodes deep (None: the request's K; at most MAX_SPECULATIVE_TOKENS nodes
    in all). Width 1 is a chain."""

    width: int = 1
    depth: int | None = None
    nodes: int | None = None  # in all (the main chain's included); None: width x depth
    # the adaptive K chooses per round between its chain and a tree of as many nodes, by
    # their measured yield (AdaptiveK.round_shape; sequential requests: a pipelined round
    # continues a chain); width, depth and nodes are then unused
    auto: bool = False


@dataclass(frozen=True)
class SpeculationDefaults:
    """What a request gets for the fields it leaves unset (the router's args, the CLI's flags)."""

    # K drafted per round, or "auto": the K in adaptive_bounds the request's acceptance and
    # the measured costs say is fastest
    num_speculative_tokens: NumSpeculativeTokens = "auto"
    adaptive_bounds: KBounds = KBounds()
    # the K of a seeded sampled request that asks for "auto": an adaptive K follows timings
    # and load, and the same seed must give the same tokens (greedy output is the same
    # whatever the K)
    seeded_num_speculative_tokens: int = 4
    # draft the next block while the verifier scores this one: "greedy" for greedy requests
    # only, "on" or "off"
    pipelined_drafting: PipelinedDrafting = "on"
    busy_wait_s: float = 0.0  # how long a request waits out a full verifier (state.Request)
    tree: TreeShape = TreeShape()  # a draft tree per round (width 1: chains)
    # the draft calls' draft_confidence (a model drafter's block ends once its confidence
    # falls below it): a number, "auto" (learnt per router from acceptance and costs, with
    # an adaptive K: speculative.confidence) or None (the drafter pool's own)
    draft_confidence: float | Literal["auto"] | None = None
    plain_steps: int = 4  # the tokens a round without a draft asks for (state.Request)

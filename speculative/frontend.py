"""The request front end: what the router and the CLI do with a user's request around the
round loop, in one place, so that they cannot disagree.

Before the loop, from the fields a user sets (sampling parameters with the request's seed, n,
K or "auto", pipelined or not, stop token ids) it plans the request: n choices, each its own
speculative request (id, seed derived from the request's) with its own K policy. After the
loop it merges usage and statistics across the choices. Tokenizing, HTTP and the pools are
the callers' business (the tokenizer lives in the router and the CLI).
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from speculative.driver import Generation
from speculative.prefixes import GrowingPrefixHash
from speculative.state import Request
from speculative.costs import CostModel
from speculative.fixed_k import KPolicy
from speculative.options import (
    MAX_SPECULATIVE_TOKENS,
    NumSpeculativeTokens,
    SpeculationDefaults,
    TreeShape,
)
from speculative.policy import k_policy
from speculative.sampling import SamplingParams, derive_seeds
from speculative.stats import SpecStats


@dataclass(frozen=True)
class Choice:
    """One of a request's n choices: its own speculative request and K policy."""

    request: Request  # id "<request id>-<index>", the choice's derived seed
    policy: KPolicy


@dataclass(frozen=True)
class RequestPlan:
    """What the round loop runs for one user request: its choices, and how they draft."""

    request_id: str
    choices: tuple[Choice, ...]
    num_speculative_tokens: NumSpeculativeTokens  # after the seeded rule
    pipelined: bool
    drafter_kind: str | None  # keys the shared costs (the router: None for its pool's model)
    n: int = 1  # choices per prompt (a completions batch: the prompts' n choices in turn)
    # the answer's id where it is not request_id (vLLM's "chatcmpl-<the client's
    # request_id>"; request_id keys the pools' sessions, never the client's)
    answer_id: str = ""
    # vLLM's return_prompt_text: a chat's rendered prompt, answered as it is (None: unasked)
    prompt_text: str | None = None

    def prompt_requests(self) -> list[Request]:
        """Each prompt's request: its first choice's (a completions batch's prompts in
        turn)."""
        return [self.choices[i].request for i in range(0, len(self.choices), self.n)]

    def prompt_tokens(self, index: int) -> int:
        """Choice `index`'s share of the prompt tokens: its prompt's, counted with the first
        of the prompt's n choices (as usage counts each prompt once)."""
        if index % self.n:
            return 0
        return len(self.choices[index].request.prompt_token_ids)

    def usage(self, done: Sequence[Generation]) -> dict:
        """OpenAI's usage: each prompt counted once, the completion tokens of every choice."""
        starts = range(0, len(self.choices), self.n)
        prompt_tokens = sum(self.prompt_tokens(i) for i in starts)
        completion_tokens = sum(len(generation.token_ids) for generation in done)
        cached = sum(max((g.stats.cached_tokens for g in done[i:i + self.n]), default=0)
                     for i in starts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def merged_stats(self, done: Sequence[Generation]) -> SpecStats:
        """The choices' speculative statistics added up."""
        total = SpecStats()
        for generation in done:
            total.add(generation.stats)
        return total


def joined(request_id: str, plans: Sequence[RequestPlan]) -> RequestPlan:
    """One request's plans for several prompts (a completions batch, each planned on its
    own) as one: the first prompt's n choices, then the next's (vLLM's choice indices)."""
    return dataclasses.replace(plans[0], request_id=request_id,
                               choices=tuple(c for plan in plans for c in plan.choices))


class RequestFrontEnd:
    """Plans requests under one set of defaults; the adaptive K policies of its requests learn
    into cost models it shares between them, one per (drafter kind, greedy or not)."""

    def __init__(self, defaults: SpeculationDefaults = SpeculationDefaults()) -> None:
        self.defaults = defaults
        self.costs: dict[tuple[str | None, bool], CostModel] = {}

    def plan(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
             n: int = 1, stop_token_ids: Sequence[int] = (), *,
             num_speculative_tokens: NumSpeculativeTokens | None = None,
             pipelined: bool | None = None, drafter_kind: str | None = None,
             tree: TreeShape | None = None, context_limit: int | None = None,
             plain_steps: int | None = None, running: int = 0,
             cache_key: str = "", free_in_reasoning: Sequence[int] = (),
             prediction_token_ids: Sequence[int] = ()) -> RequestPlan:
        """n choices of the request; sampling carries the request's seed, from which each
        choice's is derived. None for K, pipelined, tree or plain_steps: the defaults.
        running: the choices of other requests running now (an adaptive K starts at the
        load they and the n choices make). cache_key: OpenAI's prompt_cache_key, which
        places the request's first calls with those of its key and cache salt (Request).
        free_in_reasoning: the stop ids its reasoning ignores (Request's).
        prediction_token_ids: its predicted output, shared by the choices (Request's)."""
        steps = plain_steps or self.defaults.plain_steps
        # what a round without a draft really makes (speculative.round_steps.plain_steps: one token
        # with logprobs), for the K policy's rate of K = 0
        policy_steps = 1 if sampling.logprobs is not None else steps
        k = self.num_speculative_tokens(num_speculative_tokens, sampling)
        pipelined = self.pipelined(pipelined, sampling)
        width, k, nodes = self.tree(tree, sampling, k, num_speculative_tokens)
        pipelined = pipelined and width == 1  # a pre-draft continues one chain
        # prompt lookup proposes chains only (suffix decoding and the model draft trees)
        trees = (tree or self.defaults.tree).auto and tree_allowed(sampling) and \
            drafter_kind != "ngram"
        # the prompt copied and hashed once for all the choices, which share both
        # (RequestState, PoolView.prefix_sync): not once a choice on the router's loop
        prompt, prediction = tuple(prompt_token_ids), tuple(prediction_token_ids)
        hashed = GrowingPrefixHash()
        hashed.of(prompt)
        # prompt lookup over a prediction accepts far more than over the context alone: its
        # own costs and acceptance prior (another drafter does not read the prediction)
        learnt = "ngram+prediction" if prediction and drafter_kind == "ngram" else drafter_kind
        choices = tuple(
            Choice(Request(f"{request_id}-{index}", prompt,
                           dataclasses.replace(sampling, seed=seed), tuple(stop_token_ids),
                           self.defaults.busy_wait_s, width, nodes, context_limit,
                           placement=request_id, plain_steps=steps, prompt_hash=hashed,
                           cache_key=cache_key and f"{sampling.cache_salt}\0{cache_key}",
                           free_in_reasoning=tuple(free_in_reasoning),
                           prediction_token_ids=prediction),
                   self.k_policy(k, pipelined, sampling.greedy, learnt, trees,
                                 running + n, policy_steps))
            for index, seed in enumerate(derive_seeds(sampling.seed, n)))
        return RequestPlan(request_id, choices, k, pipelined, drafter_kind, n)

    def num_speculative_tokens(self, requested: NumSpeculativeTokens | None,
                               sampling: SamplingParams) -> NumSpeculativeTokens:
        k = self.defaults.num_speculative_tokens if requested is None else requested
        if k == "auto" and sampling.seeded:
            return self.defaults.seeded_num_speculative_tokens  # reproducible: not from timings
        return k

    def tree(self, requested: TreeShape | None, sampling: SamplingParams,
             k: NumSpeculativeTokens, requested_k: NumSpeculativeTokens | None
             ) -> tuple[int, NumSpeculativeTokens, int]:
        """(tree width, K, tree nodes): the requested shape or the default. A tree's depth is
        its K: the requested shape's, else the request's own K, else the default shape's,
        else the router's K (an adaptive K is a chain's: then the seeded default). K = 0, a
        grammar or logit shaping (which follow one chain of drafted tokens): width 1.
        ValueError for a requested tree with no node beside its main chain."""
        shape = requested or self.defaults.tree
        if shape.auto or shape.width <= 1 or k == 0 or not tree_allowed(sampling):
            return 1, k, 0
        own_k = requested_k if isinstance(requested_k, int) else None
        depth = (requested.depth if requested else None) or own_k or shape.depth or \
            (k if k != "auto" else self.defaults.seeded_num_speculative_tokens)
        nodes = min(shape.nodes or shape.width * depth, MAX_SPECULATIVE_TOKENS)
        if nodes <= depth and requested is not None:  # asked for, a chain would not answer it
            raise ValueError(f"speculative_tree: {nodes} nodes leave none beside a main chain "
                             f"of {depth} (its depth, else num_speculative_tokens): give "
                             f"nodes above the depth, or a depth below {nodes}")
        if nodes <= depth:  # the default tree, no room beside the request's K: a chain
            return 1, k, 0
        return shape.width, depth, nodes

    def pipelined(self, requested: bool | None, sampling: SamplingParams) -> bool:
        if requested is not None:
            return requested
        mode = self.defaults.pipelined_drafting
        return mode == "on" or mode == "greedy" and sampling.greedy

    def k_policy(self, k: NumSpeculativeTokens, pipelined: bool, greedy: bool,
                 drafter_kind: str | None, trees: bool = False,
                 load: float = 1.0, plain_steps: int = 1) -> KPolicy:
        costs = self.costs.get((drafter_kind, greedy)) if k == "auto" else None
        if k == "auto" and costs is None:
            # a drafter a request names is one the router runs itself (model-free: the
            # request's `drafter`); None (and the CLI's "model") is a draft model's
            costs = self.costs[drafter_kind, greedy] = CostModel(
                router_side=drafter_kind not in (None, "model"))
        return k_policy(k, pipelined, greedy, self.defaults.adaptive_bounds, costs,
                        self.defaults.draft_confidence, trees, load, plain_steps)


def tree_allowed(sampling: SamplingParams) -> bool:
    """Whether a request may draft trees: not under a grammar or logit shaping, which
    follow one chain of drafted tokens."""
    return sampling.grammar is None and not sampling.shapes_logits

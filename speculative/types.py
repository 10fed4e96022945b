"""The two interfaces the round loop is written against, and the values that cross them.

These mirror the messages of protos/specserve.proto one to one, so the in-process engines and
the gRPC clients of the deployments are interchangeable behind the same loop.
"""

import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from speculative.sampling import SamplingParams, draft_law


@dataclass(frozen=True)
class PrefixSync:
    """How a pool brings its copy of a request to the committed prefix.

    The pool already knows the first `known_len` committed tokens (their fingerprint is
    `known_hash`: speculative.prefixes.prefix_hash); `new_token_ids` are the tokens committed
    since. known_len == 0 carries the whole prefix, which any pool can rebuild from.
    """

    known_len: int
    known_hash: int
    new_token_ids: tuple[int, ...]
    # when the router admitted the request (time.time()), the same in both pools: their
    # order under KV pressure (engine.kv.SessionStore.evictable); 0: a pool's own clock at
    # the session's start
    admitted_at: float = 0.0

    @property
    def committed_len(self) -> int:
        return self.known_len + len(self.new_token_ids)


@dataclass(frozen=True)
class ProposeCall:
    request_id: str
    sync: PrefixSync
    num_speculative_tokens: int
    sampling: SamplingParams
    seed: int  # seeds this call's draft sampling, so a retried call draws the same tokens
    # a pre-draft: tokens after the committed prefix, still being verified, to draft after
    assumed_token_ids: tuple[int, ...] = ()
    prompt_len: int = 0  # the committed prefix's first tokens that are the prompt (penalties)
    # > 1: a draft tree, up to that many children at each node of the main chain
    # (DraftBlock), tree_nodes nodes in all (0: tree_width at every node)
    tree_width: int = 1
    tree_nodes: int = 0
    # a model drafter's block ends once its confidence (the drafted tokens' probabilities
    # multiplied) falls below this (0: never); None: the pool's own `draft_confidence`. Set,
    # the block reports each drafted token's confidence (DraftBlock.confidences), from which
    # the router learns the next call's (speculative.confidence)
    draft_confidence: float | None = None
    # what a call carrying a whole short prompt is placed by, beside the calls of the other
    # choices of its HTTP request (deployments.placement.prefix_route_key); not on the wire
    placement: str = ""
    cache_key: str = ""  # what a call carrying a whole prompt is placed by (Request's)
    # the request's predicted output (Request's), which prompt lookup searches; not on the
    # wire (the router's own drafters read it: deployments.local_drafters)
    prediction_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class DraftDists:
    """The draft distributions q1..qK in their wire form: per position, weights over ids.

    weights: [K, m] float32 or float16; row i's q_i is weights[i] / its sum (`draft_law`): the
    drafter drew x_i from these very (rounded) weights. ids: [K, m] integer token ids of the
    weights (sparse: an id not listed has q = 0; one listed twice, the sum of its weights), or
    None when dense (m == vocab_size, column j is id j). Consumers read q_i(x_i) with `at`, a
    gather over m entries; only the verifier, which needs whole rows for its residuals,
    builds the dense [K, V] q, once.
    """

    weights: torch.Tensor
    ids: torch.Tensor | None
    vocab_size: int

    def __post_init__(self) -> None:
        shape = tuple(self.weights.shape)
        if len(shape) != 2:
            raise ValueError(f"draft weights must be [positions, entries], got {list(shape)}")
        if self.ids is None and shape[1] != self.vocab_size:
            raise ValueError(f"dense draft weights must have {self.vocab_size} entries per "
                             f"position, got {shape[1]}")
        if self.ids is not None and (tuple(self.ids.shape) != shape
                                     or self.ids.dtype not in (torch.int32, torch.int64)):
            raise ValueError("draft ids must be integers shaped like the draft weights")

    @classmethod
    def from_dense(cls, weights: torch.Tensor) -> "DraftDists":
        """[K, V] weights (one-hot rows, full or truncated q) as the dense form."""
        return cls(weights, None, weights.shape[-1])

    @classmethod
    def stack(cls, rows: list[tuple[torch.Tensor, torch.Tensor | None]],
              vocab_size: int) -> "DraftDists":
        """One (weights [m_i], ids [m_i] or None: dense [V]) per position; sparse rows are
        padded to the widest with zero weights, which change no q."""
        if all(ids is None for _, ids in rows):
            return cls(torch.stack([weights for weights, _ in rows]), None, vocab_size)
        if len({len(weights) for weights, _ in rows}) == 1:  # nothing to pad (top-k's rows)
            return cls(torch.stack([weights for weights, _ in rows]),
                       torch.stack([ids for _, ids in rows]), vocab_size)
        pad = torch.nn.utils.rnn.pad_sequence
        return cls(pad([weights for weights, _ in rows], batch_first=True),
                   pad([ids for _, ids in rows], batch_first=True), vocab_size)

    def __len__(self) -> int:
        return self.weights.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """(K, V): the shape of the dense q this stands for."""
        return len(self), self.vocab_size

    def at(self, token_ids) -> list[float]:
        """[q_1(x_1), .., q_K(x_K)] for token_ids x_1..x_K, gathered from the m entries per
        row (never densified); 0 for an id the row does not list."""
        tokens = list(token_ids)
        if len(tokens) != len(self) or not all(0 <= t < self.vocab_size for t in tokens):
            raise ValueError(f"need {len(self)} token ids in [0, {self.vocab_size}), got "
                             f"{tokens[:8]}")
        law = draft_law(self.weights)  # [K, m], checked
        tokens = torch.tensor(tokens, dtype=torch.long, device=law.device)[:, None]  # [K, 1]
        if self.ids is None:
            return law.gather(1, tokens).squeeze(1).tolist()
        return (law * (self.ids == tokens)).sum(1).tolist()

    def dense(self, device=None) -> torch.Tensor:
        """[K, V] float32 q (on `device`): each row over its sum; ValueError for weights no
        sampler could have drawn from (not finite, negative, a row summing to 0)."""
        law = draft_law(self.weights).to(device)  # [K, m], checked where it arrived
        if self.ids is None:
            return law
        dense = torch.zeros(len(self), self.vocab_size, device=law.device)
        return dense.scatter_add_(1, self.ids.to(law.device, torch.long), law)

    @classmethod
    def of_row(cls, probs: torch.Tensor) -> "DraftDists":
        """One [V] distribution as a one-row DraftDists, sparse (its nonzero entries) when
        that takes fewer bytes than dense (a top-k or top-p law), bit for bit either way."""
        probs = probs.float()
        ids = probs.nonzero().squeeze(1)
        if len(ids) * 8 < probs.numel() * 4:
            return cls(probs[ids][None], ids.to(torch.int32)[None], probs.numel())
        return cls.from_dense(probs[None])

    def rows(self, start: int, stop: int | None = None) -> "DraftDists":
        """Positions start..stop - 1 (a pre-draft's rest, once its first token is settled)."""
        ids = None if self.ids is None else self.ids[start:stop]
        return DraftDists(self.weights[start:stop], ids, self.vocab_size)

    def to(self, device) -> "DraftDists":
        ids = None if self.ids is None else self.ids.to(device)
        return DraftDists(self.weights.to(device), ids, self.vocab_size)

    def compact(self) -> "DraftDists":
        """The same weights, bit for bit, in whichever form takes fewer bytes on the wire
        (an id costs 4): a flat q keeps so many entries that dense is smaller."""
        entry = self.weights.element_size()
        if self.ids is None or self.weights.shape[1] * (4 + entry) < self.vocab_size * entry:
            return self
        dense = torch.zeros(len(self), self.vocab_size, dtype=self.weights.dtype,
                            device=self.weights.device)
        return DraftDists.from_dense(dense.scatter_add_(1, self.ids.long(), self.weights))


@dataclass(frozen=True)
class DraftBlock:
    """Candidate tokens x1..xK and the distributions q1..qK they were drawn from.

    draft_probs is None for greedy, where only the ids matter. A drafter may return fewer than
    the K tokens asked for (the n-gram drafter without a match).
    """

    token_ids: tuple[int, ...]
    draft_probs: DraftDists | None
    compute_seconds: float = 0.0  # the drafter's own time on the call, transport excluded
    wire_bytes: int = 0  # the call's request and response as serialised (0 in-process)
    load: "BatchLoad | None" = None  # the batch the call was drafted in
    # a draft tree (speculative.tree): node i follows parents[i] (-1: the committed prefix),
    # and draft_probs' row i is the law its parent's children were drawn from; None: a chain
    parents: tuple[int, ...] | None = None
    # the main chain's confidence after each of its tokens (the call's draft_confidence was
    # set); None: not reported
    confidences: tuple[float, ...] | None = None
    # the draft model's context holds no token after the call's committed prefix: this
    # request's later calls would draft nothing (a target with a longer context)
    context_full: bool = False


NO_DRAFT = DraftBlock((), None)  # a round without candidates


@dataclass(frozen=True)
class ScoreCall:
    request_id: str
    sync: PrefixSync
    draft_token_ids: tuple[int, ...]
    sampling: SamplingParams
    draft_probs: DraftDists | None = None  # sampling: q1..qK, for the residuals
    seed: int = 0  # seeds the residual and bonus draws, so a retried call draws the same
    prompt_len: int = 0  # the committed prefix's first tokens that are the prompt (penalties)
    # sampling: return p(K+1) itself (TargetScores.bonus_probs), against which the router
    # tests a token pre-drafted for that position beside this call
    return_bonus_probs: bool = False
    draft_parents: tuple[int, ...] | None = None  # a draft tree's (DraftBlock.parents)
    placement: str = ""  # as ProposeCall's: router-side, not on the wire
    cache_key: str = ""  # as ProposeCall's
    # a call without a draft may ask for several tokens (verifier.steps): the verifier feeds
    # each token it draws and draws the next, up to `steps` tokens or a stop id
    steps: int = 1
    stop_token_ids: tuple[int, ...] = ()


# a verifier's draw from a row whose law holds NaN (the target's logits NaN or inf there),
# which no token stands for: the router fails the round that reaches it (speculative.accept)
LAWLESS = -1


@dataclass(frozen=True)
class TargetScores:
    """The target's verdict on x1..xK plus the position after them (K + 1 positions).

    Greedy: target_token_ids holds argmax p1..p(K+1).
    Sampling: what accept/reject needs instead of p itself: p_i(x_i) for each drafted token,
    one token drawn from each position's residual norm(max(0, p_i - q_i)), and one bonus token
    drawn from p(K+1), all drawn independently of the router's acceptance coins.
    """

    target_token_ids: tuple[int, ...] = ()
    draft_target_probs: tuple[float, ...] = ()
    recovered_token_ids: tuple[int, ...] = ()
    bonus_token_id: int | None = None
    compute_seconds: float = 0.0  # the verifier's own time on the call, transport excluded
    wire_bytes: int = 0  # the call's request and response as serialised (0 in-process)
    load: "BatchLoad | None" = None  # the batch the call was scored in
    logprobs: "PositionLogprobs | None" = None  # when the request asks for logprobs
    # p(K+1) as one row in DraftDists' wire form, when the call asked for it (sampling)
    bonus_probs: "DraftDists | None" = None
    cached_tokens: int = 0  # prompt tokens the call's new cache took from the prefix cache
    # a sampled tree (speculative.tree.tree_scores): each node's acceptance probability;
    # recovered_token_ids then holds one draw per row (the root's, then each node's)
    accept_probs: tuple[float, ...] = ()
    tree_nodes: int = 0  # the nodes of a draft tree the verifier scored as a tree
    # a call of several steps: the tokens drawn after the call's own position, each fed
    # before the next was drawn (the verifier's committed prefix holds all but the last)
    continued_token_ids: tuple[int, ...] = ()
    # the call's grammar held after SamplingParams.grammar_after (a verifier's echo: one that
    # predates the gate masks from the output's first token; deployments.pool_handles)
    grammar_gated: bool = False
    # the call's grammar also held from SamplingParams.grammar_at (an implicit end: the echo
    # of a verifier that knows them)
    grammar_at_gated: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the target and its position's top n (or
    vLLM's logprob_token_ids': the token's own first, then theirs in their order)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class PromptLogprobs:
    """Each prompt token's raw log-probability under the target given the tokens before it
    (vLLM's prompt_logprobs; the first token has none, so entry i is token i + 1's), its
    rank there (1: the likeliest) and the position's top n."""

    entries: tuple[TokenLogprob, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class PositionLogprobs:
    """The target's log-probabilities at a call's K + 1 positions, as the model gives them
    under the grammar's mask, before logit_bias, penalties and temperature (vLLM's default,
    "raw_logprobs"): of each drafted token, of the target's own token at each position
    (greedy: the argmax; sampled: the residual draw, then the bonus) and each position's
    top n (n may be 0; or those of the request's logprob_token_ids). Only the positions a
    round commits reach the client (`committed`)."""

    drafted: tuple[float, ...]  # K
    chosen: tuple[float, ...]  # K + 1
    top: tuple[tuple[tuple[int, float], ...], ...]  # K + 1 rows of n (id, logprob)

    def along(self, path) -> "PositionLogprobs":
        """A tree's entries (drafted: one per node; chosen and top: the root's row, then each
        node's) along an accepted path of nodes, as a chain's."""
        rows = [0] + [node + 1 for node in path]
        return PositionLogprobs(tuple(self.drafted[node] for node in path),
                                tuple(self.chosen[row] for row in rows),
                                tuple(self.top[row] for row in rows))

    def committed(self, output_token_ids, num_accepted: int) -> list[TokenLogprob]:
        """The entries of a round's output: its first num_accepted tokens are drafted ones,
        a token after them is the target's own at that position."""
        return [TokenLogprob(token, self.drafted[j] if j < num_accepted else self.chosen[j],
                             self.top[j]) for j, token in enumerate(output_token_ids)]


@dataclass(frozen=True)
class BatchLoad:
    """The batch a pool served a call in: how many calls shared its forward(s), and how many
    tokens its (first) forward fed. A call's compute_seconds is then the whole batch's time."""

    batch_size: int = 1
    batch_tokens: int = 0


def timed(work, call):
    """work(call), a DraftBlock or TargetScores, stamped with the seconds it took."""
    started = time.perf_counter()
    result = work(call)
    return replace(result, compute_seconds=time.perf_counter() - started)


class PoolUnavailable(RuntimeError):
    """A pool did not answer a call: unreachable, overloaded, past its deadline or failing.

    A drafter's is survivable (the round goes on without a draft); a verifier's ends the
    request.
    """


class PoolBusy(PoolUnavailable):
    """A pool had no room for the call now (its KV cache, or its calls in flight, full):
    the same call may succeed after a pause, once other requests' calls are done."""


class TreesUnsupported(ValueError):
    """A draft tree sent to a verifier that cannot score one (engine.runner.ModelRunner.
    scores_trees): no wait mends it, so the pool answers OUT_OF_RANGE, and the router a 400
    with the reason, not a 503 to retry, to a request that named a tree (a tree its policy
    chose is verified as a chain instead: speculative.loop.verify_tree_or_chain)."""

    reason = "cannot score a draft tree"  # in the message, which gRPC's details carry


def trees_refused(error: BaseException) -> bool:
    """Whether a verify failed because its verifier scores no draft tree: in-process its
    TreesUnsupported, over gRPC a pool's failure whose details give that reason."""
    return isinstance(error, TreesUnsupported) or \
        isinstance(error, PoolUnavailable) and TreesUnsupported.reason in str(error)


class StaleBase(Exception):
    """A pool cannot reach the base a call builds on (evicted, moved, or never seen).

    The caller resends the call with the whole committed prefix (known_len == 0).
    """


# The interfaces are async so that the same loop drives in-process engines (whose methods
# compute and return) and gRPC clients (whose methods await the network).
class Drafter(Protocol):
    """A drafter may also offer `observe(request_id, token_ids)`, called with a request's
    committed tokens when it ends, before `release`: what its last rounds committed, which
    no later call would bring (suffix decoding indexes a finished request's output)."""

    async def propose(self, call: ProposeCall) -> DraftBlock: ...

    async def release(self, request_id: str) -> None: ...


class Verifier(Protocol):
    async def score(self, call: ScoreCall) -> TargetScores: ...

    async def release(self, request_id: str) -> None: ...

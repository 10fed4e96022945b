"""A request as the round loop runs it: what it asks (`Request`), what the router keeps for it
between rounds (`RequestState`: committed ids, the sampling generator, counters) and what the
router believes each pool knows of its committed prefix (`PoolView`)."""

import secrets
import time
from dataclasses import dataclass, field

import torch

from speculative.busy import DraftBackoff
from speculative.prefixes import EMPTY_PREFIX_HASH, GrowingPrefixHash
from speculative.repetition import RepetitionDetection
from speculative.sampling import SamplingParams
from speculative.stats import SpecStats
from speculative.thinking import ThinkingTracker
from speculative.token_masks import reasoning_end
from speculative.types import (
    PrefixSync,
    StaleBase,
    TokenLogprob,
)


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...] = ()  # e.g. EOS; the stop token is part of the output
    # how long a request retries a verifier that has no room for it (PoolBusy) before it
    # fails (speculative.busy); 0: it fails at once
    busy_wait_s: float = 0.0
    tree_width: int = 1  # > 1: each round drafts a tree of that width (speculative.tree)
    tree_nodes: int = 0  # ...of that many nodes (0: the width at every node)
    context_limit: int | None = None  # the target's context: a tree's nodes stay within it
    # the key the pools place its first calls by (the choices of one HTTP request share it:
    # deployments.clients); empty: its own id
    placement: str = ""
    # what its first calls are placed by instead of its prompt's start, among the calls of
    # the same key (OpenAI's prompt_cache_key, after its cache salt: deployments.placement);
    # empty: its prompt's start
    cache_key: str = ""
    # a round without a draft asks the verifier for up to this many tokens (verifier.steps):
    # it draws and feeds them itself, one forward each, and the round's call and turn are
    # paid once for them all
    plain_steps: int = 1
    # the prompt hashed (its fingerprint's state), shared by the choices of one HTTP request:
    # each choice's state grows a copy (None: it hashes its prompt itself)
    prompt_hash: GrowingPrefixHash | None = field(default=None, compare=False, repr=False)
    # stop ids that stop nothing inside the reasoning of a grammar after it (its sampling's
    # grammar_after): the end tokens under ignore_eos, which vLLM 0.32 samples and ignores
    # there (no grammar holds yet), the grammar keeping them its stops once it holds
    free_in_reasoning: tuple[int, ...] = ()
    # OpenAI's predicted output (`prediction`), tokenized: text the answer is expected to
    # repeat, which prompt lookup searches before the context (drafter.ngram)
    prediction_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        if self.prompt_hash is not None and \
                self.prompt_hash.length != len(self.prompt_token_ids):
            raise ValueError("prompt_hash must be the hash of the prompt")


class PoolView:
    """What the router believes one pool knows of a request's committed prefix."""

    def __init__(self, admitted_at: float = 0.0) -> None:
        self.known_len = 0
        self.known_hash = EMPTY_PREFIX_HASH
        self.admitted_at = admitted_at  # the request's, which every sync carries

    def prefix_sync(self, committed: list[int], prompt: tuple[int, ...] = ()) -> PrefixSync:
        """The sync to `committed`. A pool that knows nothing of a committed prefix that is
        the prompt (committed starts with it) gets the prompt's own tuple: the choices of one
        request share it, and with it the message made of it (deployments.wire), instead of
        a copy each (128 choices of a 128k-token prompt: 0.33 s of copies)."""
        if self.known_len == 0 and prompt and len(committed) == len(prompt):
            return PrefixSync(0, self.known_hash, prompt, self.admitted_at)
        return PrefixSync(self.known_len, self.known_hash, tuple(committed[self.known_len :]),
                          self.admitted_at)

    def confirm(self, committed_len: int, committed_hash: int) -> None:
        self.known_len, self.known_hash = committed_len, committed_hash

    def forget(self) -> None:
        self.known_len, self.known_hash = 0, EMPTY_PREFIX_HASH


class RequestState:
    """Per-request state the router owns: committed ids, sampling RNG, counters."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.committed: list[int] = list(request.prompt_token_ids)
        seed = request.sampling.seed
        self.generator = torch.Generator().manual_seed(
            seed if seed is not None else secrets.randbits(63)
        )
        self.stats = SpecStats()
        self.seeds_drawn, self.seed_low = 0, 0  # the calls' seeds so far (round_steps.draw_seed)
        # a seeded call of several steps that ended before its last (verifier.steps
        # cohort_ends): its next step's seed and the steps left, for the next call
        # (round_steps.round_seed)
        self.held_steps: tuple[int, int] | None = None
        # one admission stamp in both pools: their order under KV pressure agrees (each
        # counting its own, two requests could each hold what the other waited for)
        admitted_at = time.time()
        self.drafter_view, self.verifier_view = PoolView(admitted_at), PoolView(admitted_at)
        self.draft_backoff = DraftBackoff()
        self.drafter_called = False  # the drafter may hold a cache for it: release at the end
        # the draft model's context is full (DraftBlock.context_full): the rounds left are
        # the target's alone, of plain_steps tokens, without a call to the drafter
        self.draft_context_full = False
        # max_tokens 0 (the completions API's echo of the prompt alone): ended before a round
        self.finish_reason: str | None = "length" if request.sampling.max_tokens == 0 else None
        self.logprobs: list[TokenLogprob] = []  # one per output token, when asked for
        self.draft_confidence: float | None = None  # this round's draft calls' (the policy's)
        self.round_tree = 0  # nodes of the tree the policy chose for this round (0: none)
        self._hasher = self._prompt_hasher()
        thinking = request.sampling.thinking_budget
        self.thinking = None if thinking is None else \
            ThinkingTracker(thinking, request.prompt_token_ids)
        self.round_kept = 0  # the last round's ids its commit kept (a thinking budget's cut)
        # where _reasoning_at reads the output on from (the ids before it hold no end of the
        # reasoning); None once it found one
        self.reasoned: int | None = len(request.prompt_token_ids)

    def _prompt_hasher(self) -> GrowingPrefixHash:
        shared = self.request.prompt_hash
        return GrowingPrefixHash() if shared is None else shared.copy()

    @property
    def output_token_ids(self) -> list[int]:
        return self.committed[len(self.request.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        """len(output_token_ids), without the copy (asked several times a round)."""
        return len(self.committed) - len(self.request.prompt_token_ids)

    @property
    def remaining(self) -> int:
        return self.request.sampling.max_tokens - self.num_output_tokens

    def commit(self, token_ids: tuple[int, ...], logprobs: list | None = None) -> list[int]:
        """Append a round's output (and its logprobs), cut at a stop token, max_tokens or a
        repeated pattern (speculative.repetition: each token checked as vLLM's scheduler
        checks it, after the stop ids and the length); returns what was added. Where a
        thinking budget forces its end ids (speculative.thinking), the round is cut there
        and they are committed in its place (self.round_kept: the round's ids kept)."""
        added: list[int] = []
        limit = self.remaining
        detect = self.request.sampling.repetition_detection
        self.round_kept = len(token_ids)
        while len(added) < limit:
            token = self._next(token_ids, len(added))
            if token is None:
                break
            added.append(token)
            self.committed.append(token)
            if self.thinking is not None:
                self.thinking.advance(token)
            if token in self.request.stop_token_ids and not self._reasoning_at(token):
                self.finish_reason = "stop"
                break
            if detect is not None and len(added) < limit and self._repeats(detect):
                self.finish_reason = "repetition"
                break
        if logprobs is not None:
            self.logprobs.extend(logprobs[:min(len(added), self.round_kept)])
        if self.finish_reason is None and self.remaining == 0:
            self.finish_reason = "length"
        return added

    def _reasoning_at(self, token: int) -> bool:
        """Whether the stop id just committed is one the reasoning ignores
        (Request.free_in_reasoning), in the reasoning of a grammar after it: the output
        before it read on from where the last such id left it (self.reasoned), as the masks
        read it (the output's ids alone); read whole at each, 32k end ids took 10 s."""
        sampling, start = self.request.sampling, self.reasoned
        if token not in self.request.free_in_reasoning or not sampling.grammar_after or \
                start is None:
            return False
        # the end ids may begin before `start`, never in the prompt
        low = max(len(self.request.prompt_token_ids), start - len(sampling.grammar_after) + 1)
        window = self.committed[low:-1]
        if reasoning_end(window, start - low, sampling.grammar_after,
                         sampling.grammar_at)[0] is not None:
            self.reasoned = None
            return False
        self.reasoned = len(self.committed) - 1
        return True

    def _next(self, token_ids: tuple[int, ...], at: int) -> int | None:
        """The round's id at `at`, a forced id in its place (the round cut there unless it
        is that id), or None at the round's end (a forced id still goes in after it)."""
        forced = None if self.thinking is None else self.thinking.forced()
        if forced is not None and at < self.round_kept and token_ids[at] != forced:
            self.round_kept = at
        if forced is not None:
            return forced
        return token_ids[at] if at < self.round_kept else None

    def steps_room(self) -> int:
        """The most tokens a call of plain steps may make: within max_tokens and the
        context, and none fed past where a thinking budget may force an id (the pool commits
        what it feeds)."""
        request = self.request
        room = self.remaining if request.context_limit is None else \
            min(self.remaining, request.context_limit - len(self.committed) + 1)
        return room if self.thinking is None else min(room, self.thinking.free() + 1)

    def _repeats(self, detect: RepetitionDetection) -> bool:
        """Whether the output ends in a repeated pattern; not before it holds min_tokens
        tokens (vLLM's order)."""
        length = self.num_output_tokens
        return length >= self.request.sampling.min_tokens and \
            detect.repeats(self.committed, length)

    def stop_after(self, num_output_tokens: int) -> None:
        """End the request after its first num_output_tokens (a stop string ended there)."""
        del self.committed[len(self.request.prompt_token_ids) + num_output_tokens :]
        self._hasher = self._prompt_hasher()
        del self.logprobs[num_output_tokens:]
        self.finish_reason = "stop"

    async def call_pool(self, view: PoolView, call):
        """Run call(sync) against a pool; on StaleBase resend the whole prefix once.

        The pool learns the prefix committed when the call was made, which a call that runs
        beside the verifier (a pre-draft) must not confuse with what is committed when it ends.
        """
        length, fingerprint = len(self.committed), self._hasher.of(self.committed)
        prompt = self.request.prompt_token_ids
        try:
            result = await call(view.prefix_sync(self.committed, prompt))
        except StaleBase:
            self.stats.cache_misses += 1
            view.forget()
            result = await call(view.prefix_sync(self.committed[:length], prompt))
        view.confirm(length, fingerprint)
        return result

    def confirm_fed(self, view: PoolView, fed: int) -> None:
        """The pool fed `fed` committed tokens beyond the prefix its last call named (a call
        of several steps feeds all its tokens but the last)."""
        length = view.known_len + fed
        view.confirm(length, self._hasher.of(self.committed, length))

"""The round loop: draft -> verify -> accept/reject -> commit, for one request.

It knows nothing about tokenization, processes or networks: token ids in, token ids out,
against the Drafter and Verifier interfaces. The request driver (speculative.driver) runs it
over in-process engines for the CLI and over gRPC clients for the router.
"""

import secrets
import statistics
import time
from dataclasses import dataclass, field

import torch

from speculative.policy import KPolicy
from speculative.rejection import RoundOutcome, accept_drawn, accept_greedy
from speculative.sampling import SamplingParams
from speculative.types import (
    EMPTY_PREFIX_HASH,
    DraftBlock,
    Drafter,
    PrefixSync,
    ProposeCall,
    ScoreCall,
    StaleBase,
    TargetScores,
    Verifier,
    prefix_hash,
)


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...] = ()  # e.g. EOS; the stop token is part of the output

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")


@dataclass
class SpecStats:
    """Counters named as vLLM's spec_decode metrics."""

    rounds: int = 0
    num_drafts: int = 0  # rounds that drafted at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # excludes recovered and bonus tokens
    accepted_per_position: list[int] = field(default_factory=list)
    cache_misses: int = 0
    draft_seconds: float = 0.0  # waiting for the drafter (its compute and the transport)
    verify_seconds: float = 0.0  # waiting for the verifier
    round_seconds: float = 0.0  # whole rounds: the rest is the router's own time
    draft_compute_seconds: float = 0.0  # the drafter's own time, as it reports it
    verify_compute_seconds: float = 0.0  # the verifier's own time, as it reports it
    # per round: the round's time less the pools' own (transport plus the router's work)
    overhead_seconds: list[float] = field(default_factory=list)
    wire_bytes: int = 0  # serialised messages of the rounds' pool calls (0 in-process)

    def record(self, num_drafted: int, outcome: RoundOutcome) -> None:
        self.rounds += 1
        self.num_drafts += num_drafted > 0
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += outcome.num_accepted
        missing = num_drafted - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(0, missing))
        for position in range(outcome.num_accepted):
            self.accepted_per_position[position] += 1

    def add(self, other: "SpecStats") -> None:
        """Accumulate another request's counters."""
        missing = len(other.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(0, missing))
        for position, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[position] += count
        for name in ("rounds", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                     "cache_misses", "draft_seconds", "verify_seconds", "round_seconds",
                     "draft_compute_seconds", "verify_compute_seconds", "overhead_seconds",
                     "wire_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def acceptance_rate(self) -> float | None:
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per round, the recovered or bonus token included (vLLM's definition)."""
        if not self.rounds:
            return None
        return (self.num_accepted_tokens + self.rounds) / self.rounds

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_drafts": self.num_drafts,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "cache_misses": self.cache_misses,
            "ms_per_round": self.ms_per_round(),
            "overhead_ms_p50": self.overhead_ms_p50,
            "wire_bytes_per_round": self.wire_bytes / self.rounds if self.wire_bytes else None,
        }

    def phase_seconds(self) -> dict[str, float]:
        """Total time by phase: the drafter's and the verifier's own compute, the transport
        (waiting for a pool beyond its compute: network, serialisation, queues) and the
        router's own work (rejection sampling, bookkeeping, streaming)."""
        waits = self.draft_seconds + self.verify_seconds
        return {"draft": self.draft_compute_seconds, "verify": self.verify_compute_seconds,
                "transport": waits - self.draft_compute_seconds - self.verify_compute_seconds,
                "router": self.round_seconds - waits}

    def ms_per_round(self) -> dict | None:
        """Mean milliseconds per round by phase (see phase_seconds), and in total."""
        if not self.rounds:
            return None
        phases = {**self.phase_seconds(), "total": self.round_seconds}
        return {name: round(1000 * seconds / self.rounds, 3) for name, seconds in phases.items()}

    @property
    def overhead_ms_p50(self) -> float | None:
        """Median over rounds of what a round costs beyond the pools' compute."""
        if not self.overhead_seconds:
            return None
        return round(1000 * statistics.median(self.overhead_seconds), 3)


class PoolView:
    """What the router believes one pool knows of a request's committed prefix."""

    def __init__(self) -> None:
        self.known_len = 0
        self.known_hash = EMPTY_PREFIX_HASH

    def sync(self, committed: list[int]) -> PrefixSync:
        return PrefixSync(self.known_len, self.known_hash, tuple(committed[self.known_len :]))

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
        self.drafter_view, self.verifier_view = PoolView(), PoolView()
        self.finish_reason: str | None = None
        self._hash, self._hashed_len = EMPTY_PREFIX_HASH, 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.committed[len(self.request.prompt_token_ids) :]

    @property
    def remaining(self) -> int:
        return self.request.sampling.max_tokens - len(self.output_token_ids)

    def commit(self, token_ids: tuple[int, ...]) -> list[int]:
        """Append a round's output, cut at a stop token or max_tokens; returns what was added."""
        added: list[int] = []
        for token in token_ids[: self.remaining]:
            added.append(token)
            if token in self.request.stop_token_ids:
                self.finish_reason = "stop"
                break
        self.committed.extend(added)
        if self.finish_reason is None and self.remaining == 0:
            self.finish_reason = "length"
        return added

    def stop_after(self, num_output_tokens: int) -> None:
        """End the request after its first num_output_tokens (a stop string ended there)."""
        del self.committed[len(self.request.prompt_token_ids) + num_output_tokens :]
        self.finish_reason = "stop"

    async def synced(self, view: PoolView, call):
        """Run call(sync) against a pool; on StaleBase resend the whole prefix once."""
        try:
            result = await call(view.sync(self.committed))
        except StaleBase:
            self.stats.cache_misses += 1
            view.forget()
            result = await call(view.sync(self.committed))
        view.confirm(len(self.committed), self._committed_hash())
        return result

    def _committed_hash(self) -> int:
        if self._hashed_len != len(self.committed):  # both pools confirm the same prefix
            self._hash, self._hashed_len = prefix_hash(self.committed), len(self.committed)
        return self._hash


def accept(block: DraftBlock, scores: TargetScores, greedy: bool, generator) -> RoundOutcome:
    if greedy:
        return accept_greedy(block.token_ids, scores.target_token_ids)
    drafted = block.token_ids
    draft_at_draft = block.draft_probs[torch.arange(len(drafted)), list(drafted)] if drafted \
        else ()
    return accept_drawn(drafted, draft_at_draft, scores.draft_target_probs,
                        scores.recovered_token_ids, scores.bonus_token_id, generator)


async def run_round(state: RequestState, drafter: Drafter, verifier: Verifier, policy: KPolicy):
    """One round; returns the newly committed token ids (1 to K + 1 of them)."""
    request = state.request
    started = time.perf_counter()
    k = min(policy.num_speculative_tokens(), state.remaining - 1)
    block = DraftBlock((), None)
    if k > 0:
        draft_seed = int(torch.randint(0, 2**63 - 1, (), generator=state.generator))
        block = await state.synced(
            state.drafter_view,
            lambda sync: drafter.propose(
                ProposeCall(request.request_id, sync, k, request.sampling, draft_seed)
            ),
        )
    drafted = time.perf_counter()
    verify_seed = int(torch.randint(0, 2**63 - 1, (), generator=state.generator))
    scores = await state.synced(
        state.verifier_view,
        lambda sync: verifier.score(
            ScoreCall(request.request_id, sync, block.token_ids, request.sampling,
                      block.draft_probs, verify_seed)
        ),
    )
    verified = time.perf_counter()
    outcome = accept(block, scores, request.sampling.greedy, state.generator)
    policy.update(len(block.token_ids), outcome.num_accepted)
    committed = state.commit(outcome.output_token_ids)
    stats = state.stats
    stats.record(len(block.token_ids), outcome)
    stats.draft_seconds += drafted - started
    stats.verify_seconds += verified - drafted
    stats.draft_compute_seconds += block.compute_seconds
    stats.verify_compute_seconds += scores.compute_seconds
    stats.wire_bytes += block.wire_bytes + scores.wire_bytes
    round_seconds = time.perf_counter() - started
    stats.round_seconds += round_seconds
    stats.overhead_seconds.append(round_seconds - block.compute_seconds - scores.compute_seconds)
    return committed


async def run_rounds(state: RequestState, drafter: Drafter, verifier: Verifier, policy: KPolicy):
    """Run rounds until the request finishes, yielding each round's new token ids.

    Releases both pools' caches when it ends; a caller that stops early closes it with
    contextlib.aclosing so that the release happens at once.
    """
    try:
        while state.finish_reason is None:
            yield await run_round(state, drafter, verifier, policy)
    finally:
        if state.drafter_view.known_len:
            await drafter.release(state.request.request_id)
        await verifier.release(state.request.request_id)

"""Beam search over the target alone, as vLLM's serving layer runs it (its
`OpenAIServing.beam_search`, vllm/entrypoints/openai/engine/serving.py, and its score,
vllm/beam_search.py `get_beam_search_score`).

No speculation: each step asks the verifier, once per live beam, for the next position's top
2 x beam_width raw logprobs (or the answer's top logprobs, where more: vLLM's answers at most
its 2 x beam_width), a call of K = 0, greedy, as a round without a draft. Every
candidate is its beam's cumulative logprob plus its own; an end-of-sequence candidate (the
tokenizer's EOS, unless ignore_eos) retires into the finished beams, and the beam_width best
of the others live on. The search runs max_tokens steps (vLLM's: no early end), then the
finished and live beams are ranked by the length-penalised score and the beam_width best are
the answer. Each beam is a verifier session of its own whose prefix is the prompt plus its
tokens: the first beam continuing a session keeps it (the call then carries one new token),
the others open new ones, which the verifier's prefix cache fills from the common prefix; a
session no beam continues is released at once.
"""

import asyncio
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from speculative.loop import verify
from speculative.sampling import MAX_LOGPROBS, SamplingParams
from speculative.state import Request, RequestState
from speculative.types import NO_DRAFT, TokenLogprob, Verifier

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step asks for 2 x the width (vLLM's bound too)

Row = tuple[tuple[int, float], ...]  # a position's top (token id, raw logprob), best first


@dataclass(frozen=True)
class BeamParams:
    """vLLM's BeamSearchParams (temperature aside: the search reads raw logprobs, which it
    does not change), the tokenizer's EOS id (None: none ends a beam) and the top logprobs
    the answer shows at each position (read beside the search's 2 x beam_width)."""

    beam_width: int
    max_tokens: int
    eos_token_id: int | None
    ignore_eos: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    top_logprobs: int = 0

    @property
    def row_width(self) -> int:
        """The logprobs read at each step: the search's 2 x beam_width, or the answer's."""
        return max(2 * self.beam_width, self.top_logprobs)


@dataclass(frozen=True)
class Beam:
    """A beam: its output tokens, their cumulative logprob and each step's row (an EOS
    beam's row of its end too, though its end token is in `tokens` only with
    include_stop_str_in_output); finish_reason "stop" once ended at EOS."""

    tokens: tuple[int, ...]
    cum_logprob: float
    rows: tuple[Row, ...]
    finish_reason: str | None = None

    def token_logprobs(self, top_n: int) -> list[TokenLogprob]:
        """Each output token's logprob and its position's top top_n (of the row the step
        read: BeamParams.row_width)."""
        return [TokenLogprob(token, dict(row)[token], row[:top_n])
                for token, row in zip(self.tokens, self.rows)]


def beam_score(sequence: Sequence[int], cum_logprob: float, eos_token_id: int | None,
               length_penalty: float) -> float:
    """vLLM's get_beam_search_score: the cumulative logprob over the whole sequence's length
    (the prompt's tokens included, a last EOS not), to the power length_penalty."""
    length = len(sequence) - (sequence[-1] == eos_token_id)
    try:
        scale = float(length) ** length_penalty
    except OverflowError:  # past a float (a length_penalty far above 1): its limit, as
        scale = math.inf  # IEEE division takes it (vLLM's search fails there: a 500)
    if scale == 0.0:  # below the least float (one far below 0): the limit of the quotient
        return -math.inf if cum_logprob < 0 else 0.0
    return cum_logprob / scale


def ranked(prompt: Sequence[int], beams: list[Beam], params: BeamParams) -> list[Beam]:
    """The beam_width best beams by beam_score (stable: ties keep their order)."""
    def score(beam: Beam) -> float:
        return beam_score([*prompt, *beam.tokens], beam.cum_logprob, params.eos_token_id,
                          params.length_penalty)
    return sorted(beams, key=score, reverse=True)[:params.beam_width]


def step(beams: list[Beam], rows: list[Row], params: BeamParams
         ) -> tuple[list[tuple[int, Beam]], list[Beam]]:
    """One step's choice: ((the live beam each new beam extends, the new beam) for the
    beam_width best candidates, the beams that end at EOS now). rows: each live beam's top
    row_width, of which the top 2 x beam_width are candidates."""
    candidates, ended = [], []
    for parent, (beam, row) in enumerate(zip(beams, rows)):
        for token, logprob in row[:2 * params.beam_width]:
            total = beam.cum_logprob + logprob
            if token == params.eos_token_id and not params.ignore_eos:
                kept = (token,) if params.include_stop_str_in_output else ()
                ended.append(Beam(beam.tokens + kept, total, beam.rows + (row,), "stop"))
            else:
                candidates.append((total, parent, token))
    best = sorted(candidates, key=lambda c: -c[0])[:params.beam_width]  # stable
    return [(parent, Beam(beams[parent].tokens + (token,), total,
                          beams[parent].rows + (rows[parent],)))
            for total, parent, token in best], ended


class BeamSearch:
    """One prompt's beam search against the verifier; `run()` returns the answer's beams."""

    def __init__(self, request: Request, params: BeamParams) -> None:
        """request: the prompt's (its id prefixes the sessions'; its prompt, cache salt and
        busy wait are theirs)."""
        self.params, self.prompt = params, request.prompt_token_ids
        sampling = SamplingParams(temperature=0.0, max_tokens=max(1, params.max_tokens),
                                  logprobs=params.row_width,
                                  cache_salt=request.sampling.cache_salt)
        self.session_request = dataclasses.replace(request, sampling=sampling,
                                                   stop_token_ids=(), plain_steps=1)
        self.opened = 0

    def session(self, tokens: Sequence[int]) -> RequestState:
        """A new verifier session at the prompt plus `tokens` (its first call sends them all)."""
        self.opened += 1
        request_id = f"{self.session_request.request_id}-beam-{self.opened}"
        state = RequestState(dataclasses.replace(self.session_request, request_id=request_id))
        state.committed.extend(tokens)
        return state

    async def run(self, verifier: Verifier) -> list[Beam]:
        beams, finished = [Beam((), 0.0, ())], []
        sessions = [self.session(())]
        try:
            for _ in range(self.params.max_tokens):
                rows = await scored(verifier, sessions, self.params.row_width)
                chosen, ended = step(beams, rows, self.params)
                finished.extend(ended)
                beams = [beam for _, beam in chosen]
                sessions = await self.carried(verifier, sessions, chosen)
        finally:
            await released(verifier, sessions)
        return ranked(self.prompt, finished + beams, self.params)

    async def carried(self, verifier: Verifier, sessions: list[RequestState],
                      chosen: list[tuple[int, Beam]]) -> list[RequestState]:
        """The next step's sessions: a parent's first chosen child keeps its session (its
        token committed there), the others open new ones; the sessions left are released."""
        kept, carried = set(), []
        for parent, beam in chosen:
            if parent in kept:
                carried.append(self.session(beam.tokens))
            else:
                kept.add(parent)
                sessions[parent].committed.append(beam.tokens[-1])
                carried.append(sessions[parent])
        await released(verifier, [s for i, s in enumerate(sessions) if i not in kept])
        return carried


async def scored(verifier: Verifier, sessions: list[RequestState], top_n: int) -> list[Row]:
    """Each session's next position's top top_n, all asked at once (one failing cancels the
    others, whose error goes up)."""
    async def row(state: RequestState) -> Row:
        scores = await verify(state, verifier, NO_DRAFT, 0, None)
        if scores.logprobs is None or len(scores.logprobs.top[0]) < top_n:
            raise ValueError(f"the verifier answered no top {top_n} logprobs")
        return scores.logprobs.top[0][:top_n]

    tasks = [asyncio.ensure_future(row(state)) for state in sessions]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def released(verifier: Verifier, sessions: list[RequestState]) -> None:
    """Each session's release, awaited in turn in the caller's own task (a pool client's
    returns at once, its Release sent in the background): tasks of their own, not yet
    started when a repeated cancel of the search reached them, never ran (a leaked
    session)."""
    for state in sessions:
        try:
            await verifier.release(state.request.request_id)
        except Exception:  # best effort, as any release: the pool's LRU and TTL evict it
            pass

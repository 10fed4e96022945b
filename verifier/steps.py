"""Calls of several steps: a call without a draft (K = 0) may ask the verifier for up to
`steps` tokens, which it draws one forward at a time, feeding each before it draws the next.

Why: under batch load a K = 0 round's time beyond its forward (the router's turn, gRPC both
ways, the batcher's wait for the requests of the batch before) is a third of the verifier's
cycle (measured at 16 streams: 5.4 of 16.6 ms). A call of M steps pays it once for M tokens,
as vLLM's multi-step scheduling (`num_scheduler_steps`) did for its own loop.

How: the pool's batcher runs the call again after every step but its last (the step answers
UNFINISHED, as a cut prefill does: engine.batch), and `Steps` turns the call into its next
step, a K = 0 call whose prefix sync carries the token just drawn. Each step is an ordinary
call, in whatever batch the verifier runs next, so the answer is exact as a one-step call's:
greedy, each token is the argmax given the prefix and the tokens before it; sampled, each is
drawn from the target's (shaped, masked) law there with its own seed (step_seed), the
penalties, min_tokens and grammar counting the tokens of the steps before (they are
committed in the verifier's sequence by then).

Calls of several steps end together: when one of them runs its last step, every other in
the batch ends with it (`cohort_ends`), with the tokens it has, so that they come back in
one group and their next calls share batches, where calls out of step had the verifier's
batches carry part of the requests each (docs/engine.md).

The answer is the first step's scores with the later tokens in `continued_token_ids`: the
verifier's committed prefix then holds all but the last, and the router says so in its next
call's sync (speculative.loop). A refusal or failure at any step is the call's: the tokens
drawn so far are dropped, and the router's next call resends what the verifier lacks.
"""

from dataclasses import dataclass, field, replace

from engine.batch import UNFINISHED
from engine.kv import SessionStore
from speculative.options import MAX_PLAIN_STEPS
from speculative.sampling import step_seed
from speculative.types import BatchLoad, PrefixSync, ScoreCall, TargetScores


def check_steps(call: ScoreCall, vocab_size: int) -> None:
    """ValueError unless the call's steps can run: 1 to MAX_PLAIN_STEPS, and beyond one only
    without a draft, logprobs or p(K+1) asked for (those describe one position)."""
    if call.steps == 1:  # (a one-step call's stop ids are not used)
        return
    if not 1 <= call.steps <= MAX_PLAIN_STEPS:
        raise ValueError(f"steps must be in [1, {MAX_PLAIN_STEPS}], got {call.steps}")
    if call.draft_token_ids or call.draft_parents is not None \
            or call.sampling.logprobs is not None or call.return_bonus_probs:
        raise ValueError("a call of several steps scores no draft and asks no logprobs or "
                         "bonus_probs")
    bad = [t for t in call.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop token ids out of range [0, {vocab_size}): {bad[:5]}")


@dataclass
class Progress:
    """A call of several steps between two of them."""

    call: ScoreCall  # as the batcher holds it
    current: ScoreCall  # the step to run next
    first: TargetScores  # the first step's scores (the answer's, with the tokens added)
    tokens: list[int] = field(default_factory=list)
    compute_seconds: float = 0.0
    calls: int = 0  # summed over the steps' batches: their calls and fed tokens
    fed: int = 0


class Steps:
    """The calls of several steps a verifier is running, by request."""

    def __init__(self, sessions: SessionStore) -> None:
        self.sessions = sessions
        self.running: dict[str, Progress] = {}

    def current(self, calls: list[ScoreCall]) -> list[tuple[ScoreCall, Progress | None]]:
        """Each call's step to run now (the call itself for its first) and its progress
        (None for a first step). A call of several steps between two of them goes on
        wherever it stands in the batch; another call of its request (newer) ends its
        steps (verifier.engine: advance answers the steps it ran)."""
        # a call cut short between two steps whose release never came (its router gone)
        # goes with its session (the store's bound, its TTL): nothing else would drop it
        for request_id in [r for r in self.running if r not in self.sessions]:
            del self.running[request_id]
        going_on = {id(call): progress for call in calls
                    if (progress := self.running.get(call.request_id)) is not None
                    and progress.call is call}
        steps = []
        for call in calls:
            progress = going_on.get(id(call))
            if progress is not None:
                steps.append((progress.current, progress))
                continue
            if call.request_id in self.running:
                del self.running[call.request_id]  # a new call of the request
            steps.append((call, None))
        return steps

    def forget(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    @staticmethod
    def cohort_ends(steps: list[tuple[ScoreCall, Progress | None]]) -> bool:
        """Whether a call of several steps in the batch (as `current` gave them) runs its
        last step now: then every such call ends with it (`advance`), so that they all
        come back in one group and their next calls form one batch, not two that take
        turns with the router's (measured: 11.7 calls a batch out of 16 before)."""
        return any(call.steps > 1 and call.steps == 1 + len(progress.tokens if progress
                                                             else ())
                   for call, progress in steps)

    def advance(self, call: ScoreCall, result, progress: Progress | None,
                cohort_ends: bool = False):
        """The call's answer after the step just run (its result; progress as `current`
        gave it): UNFINISHED while steps remain and no other call's steps end in this
        batch (cohort_ends), else the scores of them all; a refusal ends the call, and so
        does a newer call of the request in the same batch (the answer then has the steps
        run so far: each followed the one before)."""
        if call.steps <= 1 or result is UNFINISHED:
            return result
        latest = self.running.get(call.request_id) is progress  # no other call took over
        if latest and progress is not None:
            del self.running[call.request_id]
        if isinstance(result, Exception):
            return result
        if progress is None:
            progress = Progress(call, call, result)
        token = result.target_token_ids[0] if call.sampling.greedy else result.bonus_token_id
        progress.tokens.append(token)
        progress.compute_seconds += result.compute_seconds
        load = result.load or BatchLoad(1, 1)
        progress.calls += load.batch_size
        progress.fed += load.batch_tokens
        steps = len(progress.tokens)
        sequence = self.sessions.get(call.request_id)
        if steps < call.steps and not cohort_ends and token not in call.stop_token_ids \
                and sequence is not None and latest:
            progress.current = replace(
                call, sync=PrefixSync(len(sequence.committed), sequence.committed_hash,
                                      (token,)),
                seed=step_seed(call.seed, steps))
            self.running[call.request_id] = progress
            return UNFINISHED
        return replace(progress.first, continued_token_ids=tuple(progress.tokens[1:]),
                       compute_seconds=progress.compute_seconds,
                       load=BatchLoad(round(progress.calls / steps),
                                      round(progress.fed / steps)))

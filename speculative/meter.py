"""A round's clock: where its time went, into the request's SpecStats and a RoundCost for the
K policy. The round loop marks the steps (drafted, verified) and hands over what the pools
reported; the algorithm itself never reads a clock."""

import time

from speculative.accept import depth
from speculative.costs import RoundCost
from speculative.rejection import RoundOutcome
from speculative.types import NO_DRAFT, DraftBlock, TargetScores


class RoundMeter:
    def __init__(self, state, carried: bool) -> None:
        self.stats = state.stats
        self.carried = carried  # the candidates were pre-drafted during the previous round
        self.first = not state.drafter_called  # the drafter's first call: its prefill
        self.prefill = not state.num_output_tokens  # the verifier's prompt prefill
        self.fell_back = False  # the round asked for a draft and ran without one
        self.predraft_failed = False  # the draft beside its verify failed (or was too late)
        self.predraft: DraftBlock | None = None  # the draft that ran beside the verify
        self.misses = state.stats.cache_misses
        self.busy_seconds = state.stats.busy_seconds  # pauses for a full verifier: not costs
        self.draft_busy = state.stats.draft_busy_seconds  # for a full drafter: neither
        # committed tokens the drafter had not seen when the round began
        self.catch_up = 0 if carried else len(state.committed) - state.drafter_view.known_len
        self.started = time.perf_counter()
        self.drafted_at = self.verified_at = self.started
        self.busy_drafting = 0.0  # pauses for a full drafter before the verify
        self.predraft_wait = 0.0  # after the verify, for the pre-draft beside it

    async def settled(self, predraft) -> DraftBlock:
        """The pre-draft beside the verify, once in hand (the wait is the drafter's)."""
        since = time.perf_counter()
        block = await predraft
        self.predraft_failed = block is None
        self.predraft = block or NO_DRAFT
        self.predraft_wait = time.perf_counter() - since
        return self.predraft

    def drafted(self, block: DraftBlock) -> DraftBlock:
        self.drafted_at = time.perf_counter()
        self.busy_drafting = self.stats.draft_busy_seconds - self.draft_busy
        return block

    def verified(self, scores: TargetScores) -> TargetScores:
        self.verified_at = time.perf_counter()
        return scores

    def finish(self, block: DraftBlock, scores: TargetScores, outcome: RoundOutcome,
               beside: int | None) -> RoundCost:
        """beside: the length of the draft that ran beside a verify of no candidates (None:
        the round verified a drafted or pre-drafted block). Records the round in the
        stats; returns its cost for a K policy."""
        ended, stats, predraft = time.perf_counter(), self.stats, self.predraft
        stats.record(len(block.token_ids), outcome)
        stats.draft_fallback_rounds += self.fell_back
        stats.pipelined_rounds += self.carried
        # waiting for a draft: before the verify, and for the pre-draft after it (the
        # router's own work after the verify, rejection sampling and the commit, is not),
        # less the pauses for a full drafter in either wait; the verify less its own pauses
        verify_paused = stats.busy_seconds - self.busy_seconds
        predraft_paused = min(self.predraft_wait, stats.draft_busy_seconds - self.draft_busy
                              - self.busy_drafting)
        stats.draft_seconds += self.drafted_at - self.started - self.busy_drafting + \
            self.predraft_wait - predraft_paused
        stats.verify_seconds += self.verified_at - self.drafted_at - verify_paused
        paused = verify_paused + self.busy_drafting + predraft_paused
        waited_draft = 0.0 if self.carried else block.compute_seconds
        # the pre-draft's compute that ran on past the verify (it began beside it), as far as
        # the wait for it after the verify shows: the drafter's, not transport
        exposed_predraft = 0.0 if predraft is None else min(
            max(0.0, predraft.compute_seconds - (self.verified_at - self.drafted_at)),
            self.predraft_wait - predraft_paused)
        stats.draft_compute_seconds += waited_draft + exposed_predraft
        # (beside = 0: the drafter's prefill beside a first verify, no draft)
        # (a failed one, answered by no draft, is none)
        stats.predrafts += predraft is not None and not self.predraft_failed and beside != 0
        stats.predraft_compute_seconds += predraft.compute_seconds if predraft else 0.0
        stats.verify_compute_seconds += scores.compute_seconds
        if self.prefill:  # the prompt's prefill only, its chunks' largest (vLLM sets it
            # once, at the first schedule): a later rebuild may take the prompt back from the
            # prefix cache, but the request had computed it already
            stats.cached_tokens = max(stats.cached_tokens, scores.cached_tokens)
        # the drafter's batch: of the draft the round waited for, else of its pre-draft
        waited = not self.carried and block.token_ids
        stats.record_batches(scores.load, block.load if waited else
                             predraft.load if predraft else None)
        stats.wire_bytes += (0 if self.carried else block.wire_bytes) + scores.wire_bytes \
            + (predraft.wire_bytes if predraft else 0)
        round_seconds = ended - self.started - paused
        stats.round_seconds += round_seconds
        stats.overhead_seconds.append(round_seconds - waited_draft - exposed_predraft
                                      - scores.compute_seconds)
        stats.exposed_seconds.append(round_seconds - scores.compute_seconds)
        return self.cost(block, scores, round_seconds, waited_draft, beside,
                         len(outcome.output_token_ids))

    def kind(self, block: DraftBlock, beside: int | None) -> str:
        """How the round ran, as policy.ROUND_KINDS names it; "" for a round that is none
        of them (a first round's prefill beside, a last one without a pre-draft)."""
        if self.carried:
            return "carried" if self.predraft else ""
        if beside is not None:
            return "fresh" if beside > 0 else ""
        return "sequential" if block.token_ids else "plain"

    def cost(self, block: DraftBlock, scores: TargetScores, round_seconds: float,
             waited_draft: float, beside: int | None, tokens: int) -> RoundCost:
        """For a K policy: the draft cost of this round's own draft, else of its pre-draft,
        and the time beyond the compute on the critical path (a pre-draft runs beside the
        verify). A first round's prefills and a rebuilt cache say nothing about a K."""
        predraft, drafted_beside = self.predraft, beside is not None
        unwaited_seconds = round_seconds - waited_draft
        drafted_now = (predraft or NO_DRAFT) if self.carried or drafted_beside else block
        beside_seconds = predraft.compute_seconds if predraft else 0.0
        load = scores.load
        hop = 0.0 if self.carried or not block.token_ids \
            else self.drafted_at - self.started - block.compute_seconds
        comparable = not self.prefill and not (self.first and drafted_beside) and \
            self.stats.cache_misses == self.misses and \
            self.stats.busy_seconds == self.busy_seconds and \
            self.stats.draft_busy_seconds == self.draft_busy
        # a call of several steps (verifier.steps) ran one forward a token: the verify line
        # learns one forward's time, the overhead is the call's once
        forwards = 1 + len(scores.continued_token_ids)
        return RoundCost(len(block.token_ids) + 1, scores.compute_seconds / forwards,
                         depth(drafted_now), drafted_now.compute_seconds,
                         unwaited_seconds - max(scores.compute_seconds, beside_seconds),
                         load.batch_size if load else 1, load.batch_tokens if load else 0,
                         max(0.0, hop), comparable, self.catch_up,
                         self.kind(block, beside), round_seconds, tokens, forwards,
                         drafted_now.load.batch_size if drafted_now.load else 0,
                         self.carried)

"""The round loop: draft -> verify -> accept/reject -> commit, for one request.

It knows nothing about tokenization, processes or networks: token ids in, token ids out,
against the Drafter and Verifier interfaces. The request driver (speculative.driver) runs it
over in-process engines for the CLI and over gRPC clients for the router.
"""

import asyncio
from dataclasses import replace

from speculative.busy import retried_while_busy
from speculative.fixed_k import KPolicy
from speculative.meter import RoundMeter
from speculative.options import MAX_SPECULATIVE_TOKENS
from speculative.accept import accept, depth
from speculative.rejection import RoundOutcome, accept_first_predrafted
from speculative.round_steps import draw_seed, hold_steps, plain_steps, round_seed, seed_steps
from speculative.sampling import SamplingParams
from speculative.state import RequestState
from speculative.tree import main_chain_length
from speculative.types import (
    NO_DRAFT,
    DraftBlock,
    Drafter,
    PoolBusy,
    PoolUnavailable,
    ProposeCall,
    ScoreCall,
    StaleBase,
    TargetScores,
    Verifier,
    trees_refused,
)


async def propose(state: RequestState, drafter: Drafter, k: int, seed: int,
                  assumed: tuple[int, ...] = (), beside: bool = False) -> DraftBlock:
    """K draft tokens after the committed prefix, or after it plus `assumed` (a pre-draft);
    beside: the draft runs beside a verify (a pre-draft, or a fresh draft beside a verify of
    none), whose tokens a later round continues as a chain."""
    request = state.request
    state.drafter_called = True
    return await state.call_pool(
        state.drafter_view,
        lambda sync: drafter.propose(
            ProposeCall(request.request_id, sync, k, request.sampling, seed, assumed,
                        len(request.prompt_token_ids), *tree_shape(state, k, beside),
                        draft_confidence=state.draft_confidence,
                        placement=request.placement, cache_key=request.cache_key,
                        prediction_token_ids=request.prediction_token_ids)),
    )


def tree_shape(state: RequestState, k: int, beside: bool) -> tuple[int, int]:
    """(tree width, nodes) of this call: the request's tree, else the one its policy chose
    for this round (width 2); a chain (1, 0) for a draft beside a verify (its tokens go on
    as the next round's chain: continue_with_predraft), or where the tree would not add a
    node. The verifier's slots (committed + nodes) are kept within the context
    (without a known one, within the output's room, which the context holds)."""
    request = state.request
    width, nodes = request.tree_width, request.tree_nodes
    if width <= 1 and state.round_tree:
        width, nodes = 2, state.round_tree
    if beside or not k or width <= 1:
        return 1, 0
    room = state.remaining if request.context_limit is None else \
        request.context_limit - len(state.committed)
    nodes = min(nodes or width * k, MAX_SPECULATIVE_TOKENS, room - 1)
    return (width, nodes) if nodes > k else (1, 0)


def continue_with_predraft(outcome: RoundOutcome, block: DraftBlock, predraft: DraftBlock,
                           scores: TargetScores, greedy: bool,
                           generator) -> tuple[RoundOutcome, DraftBlock | None]:
    """(the round's outcome, the next round's candidates) once a pre-draft is in hand.

    The pre-draft y1.. was drawn from q given the committed prefix plus the whole block, so it
    continues only a round that accepted the whole block; otherwise it is dropped like any
    rejected suffix. Then y1 stands at the bonus position and meets that position's test:
    - greedy: the ratio test of a one-hot p is y1 == argmax p(K+1), the bonus token the round
      already holds: the bonus is committed either way, and y2.. go on when y1 equals it;
    - sampling: y1 against p(K+1), which the verifier returned (scores.bonus_probs), with the
      rule of every drafted position (rejection.accept_first_predrafted): accepted, it
      replaces the bonus draw and y2.. go on; rejected, a residual draw takes its place and
      the rest is dropped. The bonus position holds one token of p(K+1)'s law either way
      (speculative sampling over K + 1 drafted tokens), so the round stays exact.
    """
    if outcome.num_accepted < len(block.token_ids) or not predraft.token_ids:
        return outcome, None
    y1, output = predraft.token_ids[0], outcome.output_token_ids
    if greedy:
        taken = y1 == output[-1]
    elif scores.bonus_probs is None:
        # p(K+1) not returned (a request with logprobs: the verifier could not give y1's):
        # y1 meets the ordinary test at the bonus position in the next round, and the bonus
        # draw is not used (two tokens cannot hold one position)
        return RoundOutcome(tuple(block.token_ids), outcome.num_accepted), predraft
    else:
        token, taken = accept_first_predrafted(y1, predraft.draft_probs.rows(0, 1),
                                               scores.bonus_probs, generator)
        output = output[:-1] + (token,)
    outcome = RoundOutcome(output, outcome.num_accepted, 1, int(taken))
    if not taken or len(predraft.token_ids) == 1:
        return outcome, None
    rest_probs = None if predraft.draft_probs is None else predraft.draft_probs.rows(1)
    return outcome, DraftBlock(predraft.token_ids[1:], rest_probs, predraft.compute_seconds)


async def draft_or_none(state: RequestState, drafter: Drafter, k: int, seed: int,
                        assumed: tuple[int, ...] = (), beside: bool = False
                        ) -> DraftBlock | None:
    """propose(), or None when the drafter failed: the round goes on without it. A failed
    call leaves the router's view of the drafter's prefix unconfirmed, so the next call
    rebuilds it if the pool moved on (exact either way). A seeded sampled request's tokens
    depend on its drafts: a drafter with no room for its call (PoolBusy) is waited for, as a
    full verifier is, so that load does not change what a seed gives."""
    seeded = state.request.sampling.seeded

    def call():
        return propose(state, drafter, k, seed, assumed, beside)

    try:
        if k > 0 and seeded:
            block = await retried_while_busy(state.request.busy_wait_s, state.stats, call,
                                             counted="draft_busy_seconds")
        else:
            block = await call()
    except (PoolUnavailable, StaleBase) as error:  # StaleBase: the whole prefix refused too
        # a call of 0 tokens (the drafter's prefill beside a first verify) refused for want
        # of room drafted nothing and says nothing of the drafter's health: the next round
        # drafts as it would have (skipped, a seeded request's tokens changed with load)
        if k > 0 or not isinstance(error, PoolBusy):
            state.draft_backoff.failed()
        return None
    state.draft_backoff.succeeded()
    # a call of 0 tokens is not waited for when the pool is busy: had its word that the
    # context is full steered a seeded request, load would change its seeds (the next
    # round drafts none, drawing no draft seed); that round's draft says it instead
    if k > 0 or not seeded:
        state.draft_context_full |= block.context_full
    return block


def draft_beside(state: RequestState, k: int, fresh: bool) -> int | None:
    """The length of the draft a round without candidates asks for beside a verify of none
    (K = 0), or None when it drafts first and then verifies, as a sequential round does.

    `fresh` (a pipelined request whose policy restarts fresh: KPolicy.restarts_fresh): a
    round without pre-drafted candidates (the first, or one after a rejection) is the
    target's alone while the drafter drafts K + 1 tokens from the committed prefix beside
    it: y1 is settled at the round's own position, as a pre-draft is
    (continue_with_predraft), and y2.. are the next candidates, so no round waits for a
    draft. Otherwise a first round asks for 0 tokens beside its verify: the drafter's
    prefill, overlapping the target's instead of adding to it; the rounds after it draft
    first (a pipelined one then pre-drafts the next block beside its verify).
    """
    if k <= 0 or state.draft_backoff.skipping:
        return None
    if fresh and tests_predraft(state.request.sampling):  # no call drafts more than the max
        return min(k + 1, state.remaining - 1, MAX_SPECULATIVE_TOKENS) or None
    return None if state.drafter_called else 0


def tests_predraft(sampling: SamplingParams) -> bool:
    """Whether a pre-drafted y1 can be tested at a round's bonus position: greedy always,
    sampling when the verifier may return p(K+1), that is without logprobs (y1's logprob
    there is unknown to it)."""
    return sampling.greedy or sampling.logprobs is None


async def run_round(state: RequestState, drafter: Drafter, verifier: Verifier, policy: KPolicy,
                    block: DraftBlock | None = None, pipelined: bool = False):
    """One round: draft -> verify -> accept -> commit. Returns the newly committed token ids
    and the next round's candidates when a pre-draft supplied them (else None).

    `block`: candidates pre-drafted during the previous round, else drafted now.
    pipelined: while the verifier scores this block, the drafter drafts the next one on the
    assumption that this one is accepted whole (a pre-draft).
    """
    meter = RoundMeter(state, carried=block is not None)
    wanted = policy.num_speculative_tokens()
    k = min(wanted, state.remaining - 1)
    if state.held_steps is not None:  # a seeded call's steps cut short go on first, as
        k = 0  # alone, in one call: no draft, no seed drawn for one, no back-off's turn
    state.draft_confidence = policy.draft_confidence()
    k, state.round_tree = (0, 0) if state.draft_context_full else \
        round_tree(state, policy, k, block is None and not pipelined and k == wanted)
    beside = None if meter.carried else \
        draft_beside(state, k, pipelined and policy.restarts_fresh())
    if block is None and beside is None:
        block = await draft(state, drafter, k)
        meter.fell_back = block is None
    block = meter.drafted(block or NO_DRAFT)
    verify_seed, held = round_seed(state, block, beside)  # in a fixed order: seeded repeat
    predraft = start_predraft(state, drafter, policy, block, beside, pipelined)
    steps = plain_steps(state, block, predraft, held)
    greedy = state.request.sampling.greedy
    try:
        block, scores = await verify_tree_or_chain(state, verifier, policy, block, verify_seed,
                                                   predraft, steps, beside != 0)
        scores = meter.verified(scores)
        outcome, scores = accept(block, scores, greedy, state.generator)
        outcome, next_block = await settle_predraft(predraft, meter, outcome, block, scores,
                                                    greedy, state.generator)
    except BaseException:  # a failed verify, or an answer accept refuses: no pre-draft
        if predraft is not None:  # runs on past the request's release
            predraft.cancel()
        raise
    continued = scores.continued_token_ids[:steps - 1]
    hold_steps(state, block, verify_seed, held or seed_steps(state, block, predraft, steps),
               1 + len(continued))
    if continued:
        outcome = replace(outcome, output_token_ids=outcome.output_token_ids + continued)
        state.stats.plain_step_tokens += len(continued)
    committed = state.commit(outcome.output_token_ids,
                             round_logprobs(scores, outcome, state.request.sampling))
    if continued and state.finish_reason is None:
        state.confirm_fed(state.verifier_view, len(continued))
    cost = meter.finish(block, scores, outcome, beside=beside)
    # a failed call's wait (a draft's, or a pre-draft's beside the verify) says nothing about
    # what a K costs, nor does a round that the draft's full context holds to K = 0
    held = state.draft_context_full and not block.token_ids
    if not (meter.fell_back or meter.predraft_failed or held):
        policy.update(depth(block) + outcome.predraft_tested,
                      outcome.num_accepted + outcome.predraft_accepted, cost)
    if block.confidences is not None and block.parents is None:
        policy.observe_confidences(block.confidences, outcome.num_accepted)
    forced = state.round_kept != len(committed)  # a thinking budget's ids: no pre-draft's
    return committed, None if state.finish_reason is not None or forced else next_block


def round_tree(state: RequestState, policy: KPolicy, k: int, chosen_now: bool
               ) -> tuple[int, int]:
    """(the round's K, its tree's nodes or 0): the policy's tree (AdaptiveK.round_shape), its
    main chain as K. Asked only for a sequential round that drafts the policy's K now (not
    one clipped by the request's end) and a request that names no tree of its own."""
    return policy.round_shape(chosen_now and state.request.tree_width <= 1) or (k, 0)


def round_logprobs(scores: TargetScores, outcome: RoundOutcome,
                   sampling: SamplingParams) -> list | None:
    """The logprobs of a round's output tokens, when the request asked for them; for
    logprob_token_ids, each token's own first, then the ids' (vLLM's: one entry an id)."""
    if scores.logprobs is None:
        return None
    entries = scores.logprobs.committed(outcome.output_token_ids, outcome.num_accepted)
    if not sampling.logprob_token_ids:
        return entries
    return [replace(entry, top=((entry.token_id, entry.logprob),
                                *(pair for pair in entry.top if pair[0] != entry.token_id)))
            for entry in entries]


async def draft(state: RequestState, drafter: Drafter, k: int) -> DraftBlock | None:
    """This round's k candidates: NO_DRAFT for k = 0, None when the drafter failed or is
    being skipped after failures (the round runs without a draft: exact)."""
    if k <= 0:
        return NO_DRAFT
    seed = draw_seed(state)  # drawn even when the drafter is skipped: seeds stay in order
    return await draft_or_none(state, drafter, k, seed) if state.draft_backoff.may_draft() \
        else None


def start_predraft(state: RequestState, drafter: Drafter, policy: KPolicy, block: DraftBlock,
                   beside: int | None, pipelined: bool) -> asyncio.Future | None:
    """The draft that runs beside the verify, or None: `beside` tokens from the committed
    prefix (see draft_beside), or, pipelined, the next block after this one: K + 1 tokens,
    whose first meets the test of this round's bonus position."""
    if beside is not None:
        return asyncio.ensure_future(draft_or_none(state, drafter, beside, draw_seed(state),
                                                   beside=True))
    tests_y1 = tests_predraft(state.request.sampling)  # then y1 is tested at the bonus
    next_k = min(policy.num_speculative_tokens() + tests_y1,
                 state.remaining - len(block.token_ids) - 1, MAX_SPECULATIVE_TOKENS)
    if not pipelined or not block.token_ids or next_k <= 0 or state.draft_backoff.skipping:
        return None
    return asyncio.ensure_future(
        draft_or_none(state, drafter, next_k, draw_seed(state), tuple(block.token_ids), True))


async def verify(state: RequestState, verifier: Verifier, block: DraftBlock, seed: int,
                 predraft: asyncio.Future | None, steps: int = 1, bonus: bool = True
                 ) -> TargetScores:
    """The target's scores of the block (of `steps` tokens without one: plain_steps).
    bonus: whether the pre-draft can bring a token to test at the bonus position (not the
    drafter's prefill of a first round, which drafts nothing: p(K + 1) would be a dense row
    shipped for nothing)."""
    request = state.request
    score = lambda sync: verifier.score(ScoreCall(  # noqa: E731
        request.request_id, sync, block.token_ids, request.sampling, block.draft_probs, seed,
        len(request.prompt_token_ids),
        # a sampled y1 is tested against p(K+1) (greedy needs only the argmax)
        return_bonus_probs=predraft is not None and bonus and not request.sampling.greedy
        and request.sampling.logprobs is None, draft_parents=block.parents,
        placement=request.placement, cache_key=request.cache_key, steps=steps,
        stop_token_ids=request.stop_token_ids))
    return await retried_while_busy(request.busy_wait_s, state.stats,
                                    lambda: state.call_pool(state.verifier_view, score))


async def verify_tree_or_chain(state: RequestState, verifier: Verifier, policy: KPolicy,
                               block: DraftBlock, seed: int, predraft, steps: int,
                               bonus: bool) -> tuple[DraftBlock, TargetScores]:
    """(the block verified, its scores). A tree the policy chose (the request named none)
    that the verifier cannot score (transformers' modeling with sliding windows) is
    verified as its main chain, drawn as a chain's tokens are (the siblings after it; a
    model-free tree's, drawn from no law, is not verified), and no round of the policy's
    drafts a tree again; a tree the request named is refused (a 400 with the reason)."""
    try:
        return block, await verify(state, verifier, block, seed, predraft, steps, bonus)
    except (ValueError, PoolUnavailable) as error:
        if block.parents is None or state.request.tree_width > 1 or not trees_refused(error):
            raise
    policy.refuse_trees()
    chain = NO_DRAFT
    if block.draft_probs is not None or state.request.sampling.greedy:
        length = main_chain_length(block.parents)
        chain = replace(block, token_ids=block.token_ids[:length], parents=None, draft_probs=None
                        if block.draft_probs is None else block.draft_probs.rows(0, length))
    return chain, await verify(state, verifier, chain, seed, predraft, steps, bonus)


async def settle_predraft(predraft: asyncio.Future | None, meter: RoundMeter,
                          outcome: RoundOutcome, block: DraftBlock, scores: TargetScores,
                          greedy: bool, generator) -> tuple[RoundOutcome, DraftBlock | None]:
    """(the round's outcome, the next round's candidates) once the pre-draft is in hand:
    awaited even when unused, as the drafter finishes it anyway and the router's view of
    the drafter's prefix must stay exact."""
    if predraft is None:
        return outcome, None
    return continue_with_predraft(outcome, block, await meter.settled(predraft), scores,
                                  greedy, generator)


async def run_rounds(state: RequestState, drafter: Drafter, verifier: Verifier, policy: KPolicy,
                     pipelined: bool = False):
    """Run rounds until the request finishes, yielding each round's new token ids.

    Releases both pools' caches when it ends (a pool client returns at once: releases never
    delay an answer); a caller that stops early closes it with
    contextlib.aclosing so that the release happens at once.
    """
    block = None
    try:
        while state.finish_reason is None:
            committed, block = await run_round(state, drafter, verifier, policy, block,
                                               pipelined)
            yield committed
    finally:
        try:
            if state.drafter_called:
                observe = getattr(drafter, "observe", None)  # optional (types.Drafter)
                if observe is not None:
                    observe(state.request.request_id, list(state.committed))
                await drafter.release(state.request.request_id)
        finally:  # the verifier's cache is released whatever the drafter's release does
            await verifier.release(state.request.request_id)

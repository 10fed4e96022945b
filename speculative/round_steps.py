"""A round's seeds and steps: the seed of each pool call a request makes (drawn in a fixed
order from its generator, so that a seeded request repeats), and how many steps a verify
call without a draft runs (plain_steps), with what a seeded call cut short holds for the
next rounds."""

import torch

from speculative.sampling import SEED_BLOCK, SEED_LOW_BITS, step_seed
from speculative.state import RequestState
from speculative.types import DraftBlock


def draw_seed(state: RequestState) -> int:
    """A pool call's seed, the next of the request's generator; 0 for a greedy request,
    whose calls draw nothing (a torch draw costs about 2 us, one to three a round)."""
    if state.request.sampling.greedy:
        return 0
    drawn = int(torch.randint(0, 2**63 - 1, (), generator=state.generator))
    # low bits a block apart from the request's first call's (sampling.SEED_BLOCK): drawn
    # alone, two of a long request's calls shared a CPU generator's stream within ~2**16
    if state.seeds_drawn == 0:
        state.seed_low = drawn & SEED_LOW_BITS
    low = (state.seed_low + state.seeds_drawn * SEED_BLOCK) & SEED_LOW_BITS
    state.seeds_drawn += 1
    return (drawn & ~SEED_LOW_BITS) | low


def round_seed(state: RequestState, block: DraftBlock, beside: int | None
               ) -> tuple[int, int | None]:
    """(the verify call's seed, the steps left of a seeded call cut short, or None): after
    such a call a round without a draft goes on with its seeds (sampling.step_seed), so a
    seeded request's tokens never follow where batches ended its steps (cohort_ends)."""
    held, state.held_steps = state.held_steps, None
    if held is not None and not block.token_ids and beside is None:
        return held
    return draw_seed(state), None


def hold_steps(state: RequestState, block: DraftBlock, seed: int, asked: int, made: int):
    """Keeps what a seeded round without a draft asked and did not make (round_seed)."""
    if made < asked and not block.token_ids and state.request.sampling.seeded:
        state.held_steps = (step_seed(seed, made), asked - made)


def plain_steps(state: RequestState, block: DraftBlock, predraft,
                most: int | None = None, honour_logprobs: bool = True) -> int:
    """The verifier's steps for this round's call (verifier.steps): the request's
    plain_steps for a round without a draft (and none beside it: a pre-draft or a fresh
    draft assumes the round makes one token) and without logprobs, within its tokens
    left and its context (and `most`: a held call's steps left, round_seed); else 1. A
    request's first token comes alone (its time to first token is a prefill's, not a
    prefill's and the steps'). honour_logprobs False: as though it asked none (seed_steps)."""
    request = state.request
    if block.token_ids or predraft is not None or not state.num_output_tokens \
            or honour_logprobs and request.sampling.logprobs is not None:
        return 1
    return max(1, min(request.plain_steps, state.steps_room(), most or request.plain_steps))


def seed_steps(state: RequestState, block: DraftBlock, predraft, steps: int) -> int:
    """The steps a round's seed covers: its call's, or for a call that logprobs hold to one
    step the steps it would have asked without them, the rest held (hold_steps), so that a
    seeded request draws the same tokens with logprobs asked or not, as vLLM's."""
    if state.request.sampling.logprobs is None:
        return steps
    return plain_steps(state, block, predraft, honour_logprobs=False)

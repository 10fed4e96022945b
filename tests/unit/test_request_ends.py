"""However a request ends, it leaves nothing behind: no session of a drafter the router runs
itself, however often its choices are cancelled while they release; no pre-draft running on
past the request's release."""

import asyncio

import pytest

from deployments.admission import Admission
from deployments.choices import Choices
from deployments.local_drafters import OffLoop
from drafter.ngram import NgramDrafter
from speculative.driver import Generation
from speculative.fixed_k import FixedK
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from speculative.state import Request
from speculative.types import DraftBlock, TargetScores


class Ignored:
    def record_choice(self, state, prompt_tokens, first_text_s, seconds):
        pass


class Disagreeing:
    """A verifier that agrees with no draft: token 3 at every row."""

    async def score(self, call):
        await asyncio.sleep(0.001)
        return TargetScores(target_token_ids=(3,) * (len(call.draft_token_ids) + 1))

    async def release(self, request_id):
        pass


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_whose_client_goes_away_releases_each_choice_from_the_routers_drafter(
        stream):
    """n = 4 over a drafter the router runs (OffLoop), the client gone mid-request: the
    choices are cancelled together and release on the drafter's thread one at a time. The
    first to end ends the gather, and all_or_none cancels the others again while their
    releases wait for the lock: that cut the waits short, leaving their sessions in the
    drafter (and their outputs out of a suffix drafter's index)."""
    drafter = NgramDrafter(64)
    routed = OffLoop(drafter)

    async def main():
        plan = RequestFrontEnd().plan("cmpl-x", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(
            temperature=0.0, max_tokens=200), n=4, num_speculative_tokens=2,
            drafter_kind="ngram")
        admission = Admission(4)
        choices = Choices(plan, (routed, Disagreeing()), lambda ids: "a" * len(ids),
                          Ignored(), admission.admit(4), model="m", chat=False,
                          return_token_ids=False)

        async def client():
            if stream:
                async for _ in choices.events():
                    pass
            else:
                await choices.complete()

        reading = asyncio.ensure_future(client())
        while len(drafter.sessions) < 4:  # every choice has drafted
            await asyncio.sleep(0.001)
        reading.cancel()  # the client goes away
        await asyncio.gather(reading, return_exceptions=True)
        for _ in range(200):  # the releases run on the drafter's thread, one at a time
            if not drafter.sessions:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert list(drafter.sessions) == []


class Holding:
    """A drafter that agrees with token 1 and holds a session per request until its
    release (a call that ends after the release makes one again)."""

    def __init__(self) -> None:
        self.sessions: set[str] = set()

    async def propose(self, call):
        await asyncio.sleep(0.01)
        self.sessions.add(call.request_id)
        return DraftBlock((1,) * call.num_speculative_tokens, None)

    async def release(self, request_id):
        self.sessions.discard(request_id)


class ShortOnThird:
    """A verifier that agrees, and answers its third call one row short (a pool of another
    version), which accept refuses."""

    def __init__(self) -> None:
        self.calls = 0

    async def score(self, call):
        self.calls += 1
        rows = len(call.draft_token_ids) + (self.calls != 3)
        return TargetScores(target_token_ids=(1,) * rows)

    async def release(self, request_id):
        pass


def test_a_round_that_fails_after_its_verify_ends_its_pre_draft():
    """A pipelined round whose verifier answer accept refuses: the pre-draft beside the
    verify is cancelled with the round (only a failed verify cancelled it: it ran on past
    the request's release, and its session stayed in the drafter)."""
    drafter = Holding()

    async def main():
        generation = Generation(Request("r", (5, 6, 7), SamplingParams(temperature=0.0,
                                                                        max_tokens=50)))
        with pytest.raises(ValueError, match="argmaxes"):
            await generation.run(drafter, ShortOnThird(), FixedK(3), pipelined=True)
        await asyncio.sleep(0.05)  # a pre-draft left running would have ended by now

    asyncio.run(main())
    assert drafter.sessions == set()


class Silent:
    """A verifier that never answers; its release notes the choices the router then counts
    as running (the admission's)."""

    def __init__(self, admission: Admission) -> None:
        self.admission, self.running_at_release = admission, []
        self.scoring, self.both_scoring = 0, asyncio.Event()

    async def score(self, call):
        self.scoring += 1
        if self.scoring == 2:
            self.both_scoring.set()
        await asyncio.sleep(60)

    async def release(self, request_id):
        self.running_at_release.append(self.admission.running)


def test_a_stream_whose_client_goes_away_keeps_its_slots_until_its_choices_have_ended():
    """As a whole answer's (all_or_none waits for its cancelled choices): the events asked
    their choices to cancel and gave the slots back at once, so a request admitted in their
    place ran beside choices still ending (releasing their pools, a drafter the router runs
    working on their releases)."""
    async def main():
        verifier = Silent(admission)
        plan = RequestFrontEnd().plan("chatcmpl-x", [5, 6, 7], SamplingParams(
            temperature=0.0, max_tokens=50), n=2, num_speculative_tokens=2)
        choices = Choices(plan, (Holding(), verifier), lambda ids: "a" * len(ids),
                          Ignored(), admission.admit(2), model="m", chat=True,
                          return_token_ids=False)
        events = choices.events()
        # the first chunk (the role's, with the first text) waits for a verify that never
        # answers: its task is cancelled as the client goes, as Starlette's stream is
        first = asyncio.ensure_future(events.__anext__())
        await verifier.both_scoring.wait()  # both choices wait for their verify
        first.cancel()  # the client has gone
        await asyncio.gather(first, return_exceptions=True)
        await events.aclose()
        return verifier.running_at_release

    admission = Admission(2)
    assert asyncio.run(main()) == [2, 2]
    assert admission.running == 0

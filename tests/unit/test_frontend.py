"""The request front end the router and the CLI share: choices, derived seeds, the K policy
(a seeded sampled "auto" request is pinned), pipelining defaults, shared costs, usage."""

import asyncio

import pytest

from deployments.router_args import RouterArgs
from specserve.cli import build_parser, request_front_end
from speculative.driver import Generation
from speculative.fixed_k import FixedK
from speculative.frontend import RequestFrontEnd, joined
from speculative.options import SpeculationDefaults
from speculative.policy import AdaptiveK
from speculative.rejection import RoundOutcome
from speculative.sampling import SamplingParams, derive_seeds
from speculative.stats import SpecStats
from tests.tiny import Agreeing

SAMPLED = SamplingParams(temperature=1.0, seed=5, max_tokens=32)
PROMPT = (3, 4, 5)


def cli_front_end(*flags) -> RequestFrontEnd:
    return request_front_end(build_parser().parse_args(["generate", *flags]))


def router_front_end(**args) -> RequestFrontEnd:
    return RequestFrontEnd(RouterArgs(**args).speculation_defaults())


@pytest.mark.parametrize("front_end", [router_front_end(), cli_front_end("-k", "auto")],
                         ids=["router", "cli"])
def test_a_seeded_sampled_auto_request_gets_k_4_from_both_front_ends(front_end):
    plan = front_end.plan("r", PROMPT, SAMPLED, n=2, num_speculative_tokens="auto")
    assert plan.num_speculative_tokens == 4
    for choice in plan.choices:
        assert isinstance(choice.policy, FixedK) and choice.policy.num_speculative_tokens() == 4


def test_the_seeded_k_follows_the_routers_args():
    plan = router_front_end(adaptive_k={"seeded": 2}).plan("r", PROMPT, SAMPLED)
    assert plan.choices[0].policy.num_speculative_tokens() == 2


@pytest.mark.parametrize("sampling, k, adaptive", [
    (SamplingParams(temperature=1.0, seed=None), "auto", True),  # unseeded: free to adapt
    (SamplingParams(temperature=0.0, seed=5), "auto", True),  # greedy: same ids whatever K
    (SAMPLED, 6, False),  # a K the request names is kept
])
def test_only_seeded_sampled_auto_requests_are_pinned(sampling, k, adaptive):
    plan = RequestFrontEnd().plan("r", PROMPT, sampling, num_speculative_tokens=k)
    policy = plan.choices[0].policy
    assert isinstance(policy, AdaptiveK) == adaptive
    if not adaptive:
        assert policy.num_speculative_tokens() == k


def test_the_k_policy_counts_the_steps_a_round_without_a_draft_really_runs():
    """A request asking for logprobs runs such rounds one step each (round_steps.plain_steps): its
    K policy's rate of K = 0 counts one token a call, not the router's plain_steps (it
    counted 4, turned drafting off alone and made about 15 % fewer tokens, reviewed)."""
    front_end = router_front_end()  # plain_steps 4 by default
    for logprobs, steps in ((None, 4), (0, 1), (5, 1)):
        sampling = SamplingParams(temperature=0, logprobs=logprobs)
        choice = front_end.plan("r", PROMPT, sampling, num_speculative_tokens="auto").choices[0]
        assert choice.policy.plain_steps == steps and choice.request.plain_steps == 4


def test_choices_have_their_own_ids_and_derived_seeds():
    plan = RequestFrontEnd().plan("cmpl-1", PROMPT, SAMPLED, n=3, stop_token_ids=[7])
    requests = [choice.request for choice in plan.choices]
    assert [r.request_id for r in requests] == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    assert all(r.placement == "cmpl-1" for r in requests)  # placed together (clients)
    assert [r.sampling.seed for r in requests] == derive_seeds(5, 3)
    assert all(r.prompt_token_ids == PROMPT and r.stop_token_ids == (7,) for r in requests)
    assert all(r.sampling.max_tokens == 32 for r in requests)


@pytest.mark.parametrize("mode, requested, greedy, pipelined", [
    ("greedy", None, True, True), ("greedy", None, False, False), ("on", None, False, True),
    ("off", None, True, False), ("off", True, False, True), ("on", False, True, False),
])
def test_pipelining_follows_the_default_unless_the_request_says(mode, requested, greedy,
                                                                pipelined):
    front_end = RequestFrontEnd(SpeculationDefaults(pipelined_drafting=mode))
    sampling = SamplingParams(temperature=0.0 if greedy else 1.0)
    assert front_end.plan("r", PROMPT, sampling, pipelined=requested).pipelined == pipelined


def test_the_cli_pipelines_only_when_asked():
    greedy = SamplingParams(temperature=0.0)
    assert cli_front_end().plan("r", PROMPT, greedy).pipelined is False
    assert cli_front_end("--pipelined").plan("r", PROMPT, SAMPLED).pipelined is True


def test_adaptive_policies_share_costs_by_drafter_kind_and_greediness():
    front_end = RequestFrontEnd()
    unseeded = SamplingParams(temperature=1.0)

    def costs(sampling, kind=None):
        return front_end.plan("r", PROMPT, sampling, drafter_kind=kind).choices[0].policy.costs

    assert costs(unseeded) is costs(unseeded)
    assert costs(unseeded) is not costs(SamplingParams(temperature=0.0))
    assert costs(unseeded) is not costs(unseeded, "ngram")


def test_usage_and_stats_are_merged_across_choices():
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    plan = RequestFrontEnd().plan("r", PROMPT, greedy, n=2, num_speculative_tokens=2)
    engine = Agreeing()
    done = [asyncio.run(Generation(c.request).run(engine, engine, c.policy)) for c in plan.choices]
    assert plan.usage(done) == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13,
                                "prompt_tokens_details": {"cached_tokens": 0}}
    stats = plan.merged_stats(done).as_dict()
    assert stats["rounds"] == sum(g.stats.rounds for g in done)
    assert stats["num_accepted_tokens"] == sum(g.stats.num_accepted_tokens for g in done) > 0


def test_a_batch_of_prompts_is_one_plan_with_each_prompt_counted_once():
    """A completions batch: each prompt planned with its n choices, joined in prompt order
    (vLLM's indices); usage counts each prompt once and every choice's tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    front_end = RequestFrontEnd()
    plans = [front_end.plan(f"r-{i}", prompt, greedy, n=2)
             for i, prompt in enumerate([PROMPT, (7, 8)])]
    plan = joined("r", plans)
    assert plan.request_id == "r" and plan.n == 2
    assert [c.request.prompt_token_ids for c in plan.choices] == [PROMPT] * 2 + [(7, 8)] * 2
    assert len({c.request.request_id for c in plan.choices}) == 4
    engine = Agreeing()
    done = [asyncio.run(Generation(c.request).run(engine, engine, c.policy)) for c in plan.choices]
    assert plan.usage(done)["prompt_tokens"] == 5 and plan.usage(done)["completion_tokens"] == 20


def test_cached_tokens_count_each_prompt_once_like_its_tokens():
    """n choices of one prompt each hit the same cached prefix: usage's cached_tokens counts
    it once per prompt (never above prompt_tokens), as prompt_tokens counts the prompt."""
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    front_end = RequestFrontEnd()
    plan = joined("r", [front_end.plan(f"r-{i}", prompt, greedy, n=2)
                        for i, prompt in enumerate([PROMPT, (7, 8)])])
    engine = Agreeing()
    done = [asyncio.run(Generation(c.request).run(engine, engine, c.policy)) for c in plan.choices]
    for generation, cached in zip(done, (2, 2, 0, 1)):
        generation.stats.cached_tokens = cached
    usage = plan.usage(done)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3 <= usage["prompt_tokens"]


def test_vllms_per_request_metrics_count_the_rounds_that_drafted():
    """vLLM's shape: histogram[j] = rounds that tested drafts and accepted j; the mean
    acceptance length is the tokens per such round (vLLM's 1 + accepted a step, but a round
    whose pre-drafted y1 is accepted outputs its accepted tokens alone: 1 + accepted / steps,
    9 / 4 here, said 3.25 where the steps output 3); rounds without a draft stay out; two
    choices' histograms add up."""
    stats, other = SpecStats(), SpecStats()
    stats.record(0, RoundOutcome((5,), 0))  # the target alone: not a speculation step
    stats.record(4, RoundOutcome((1, 2, 3), 2))
    stats.record(4, RoundOutcome((1, 2, 3, 4, 5), 4))
    stats.record(2, RoundOutcome((1, 2, 3), 2, predraft_tested=1, predraft_accepted=1))
    other.record(4, RoundOutcome((9,), 0))
    stats.add(other)
    metrics = stats.vllm_metrics()["speculative_decoding"]
    assert metrics["acceptance_histogram"] == [1, 0, 1, 1, 1]
    assert metrics["num_spec_steps"] == 4 and metrics["num_accepted_draft_tokens"] == 9
    assert metrics["mean_acceptance_length"] == (3 + 5 + 3 + 1) / 4
    assert metrics["num_draft_tokens"] == 15 and metrics["num_spec_tokens"] == 4
    assert metrics["draft_acceptance_rate"] == 9 / 15
    # the rounds that drafted (vLLM's num_drafts); a pre-drafted y1 accepted at the bonus
    # position counts at that position (the round's third)
    assert stats.as_dict()["num_drafts"] == 4
    assert stats.as_dict()["accepted_per_position"] == [3, 3, 2, 1]


def test_vllms_num_spec_tokens_covers_a_rejected_predrafted_token():
    """A pre-drafted y1 tested at a round's bonus position makes its block K + 1 long,
    accepted or not (a fresh round's y1 is a block of one beside a verify of none): no round
    tests more than num_spec_tokens, and the histogram has its K + 1 buckets. It was K (or 0
    when every round was fresh), so num_draft_tokens exceeded steps x num_spec_tokens."""
    chained, fresh, merged = SpecStats(), SpecStats(), SpecStats()
    chained.record(2, RoundOutcome((1, 2, 9), 2, predraft_tested=1, predraft_accepted=0))
    fresh.record(0, RoundOutcome((9,), 0, predraft_tested=1, predraft_accepted=0))
    merged.add(chained)
    merged.add(fresh)
    for stats, longest in ((chained, 3), (fresh, 1), (merged, 3)):
        metrics = stats.vllm_metrics()["speculative_decoding"]
        assert metrics["num_spec_tokens"] == longest
        assert len(metrics["acceptance_histogram"]) == longest + 1
        assert metrics["num_draft_tokens"] <= metrics["num_spec_steps"] * longest


def test_merged_stats_grow_the_per_round_timings_in_place():
    """A request's choices merged: each choice's per-round timings are added to one list.
    A new list at each add copied every round merged so far, quadratic in the choices (128
    choices of 8,000 rounds: 0.95 s, on the event loop for a stream's usage chunk)."""
    total, first, second = SpecStats(), SpecStats(), SpecStats()
    first.overhead_seconds, first.exposed_seconds = [0.1, 0.2], [0.3]
    second.overhead_seconds, second.exposed_seconds = [0.4], [0.5, 0.6]
    overhead, exposed = total.overhead_seconds, total.exposed_seconds
    total.add(first)
    total.add(second)
    assert total.overhead_seconds is overhead and total.exposed_seconds is exposed
    assert overhead == [0.1, 0.2, 0.4] and exposed == [0.3, 0.5, 0.6]
    assert first.overhead_seconds == [0.1, 0.2] and second.exposed_seconds == [0.5, 0.6]


def test_the_choices_of_a_request_share_their_prompt_hashed_once_and_its_first_syncs(
        monkeypatch):
    """A request's n choices hash its prompt once and send their pools the prompt's own
    tuple, not a copy each: the router's loop did both per choice (128 choices of a
    128k-token prompt: 0.36 s hashing and 0.33 s copying). The fingerprints stay exact."""
    import array

    from speculative.prefixes import prefix_hash
    from speculative.state import RequestState

    prompt = list(range(1, 3001))  # a list, as a caller may pass it
    hashed = []
    real_array = array.array

    def counting(kind, ids=()):
        hashed.append(len(ids))
        return real_array(kind, ids)

    monkeypatch.setattr(array, "array", counting)
    plan = RequestFrontEnd().plan("r", prompt, SAMPLED, n=4)
    shared = plan.choices[0].request.prompt_token_ids
    syncs = []

    async def first_calls(state):
        async def call(sync):
            syncs.append(sync)
        await state.call_pool(state.verifier_view, call)
        await state.call_pool(state.drafter_view, call)
        return state

    states = [asyncio.run(first_calls(RequestState(c.request))) for c in plan.choices]
    assert sum(n for n in hashed if n >= len(prompt)) == len(prompt)  # once, not once each
    assert [sync.new_token_ids is shared for sync in syncs] == [True] * 8
    assert shared == tuple(prompt)
    for state in states:
        for view in (state.drafter_view, state.verifier_view):
            assert (view.known_len, view.known_hash) == (len(prompt), prefix_hash(prompt))


def test_a_choice_cut_by_a_stop_string_fingerprints_its_prefix_from_the_shared_prompt():
    """stop_after starts the hash again from the prompt's shared state: exact after it."""
    from speculative.prefixes import prefix_hash
    from speculative.state import RequestState

    plan = RequestFrontEnd().plan("r", PROMPT, SAMPLED, n=2)
    state = RequestState(plan.choices[0].request)
    state.commit((7, 8, 9))
    state.stop_after(1)
    state.commit((10,))
    state.confirm_fed(state.verifier_view, len(state.committed))
    assert state.verifier_view.known_hash == prefix_hash([*PROMPT, 7, 10])
    assert RequestState(plan.choices[1].request).committed == list(PROMPT)


def test_a_request_refuses_a_prompt_hash_of_another_length():
    from speculative.prefixes import GrowingPrefixHash
    from speculative.state import Request

    hashed = GrowingPrefixHash()
    hashed.of([1, 2])
    with pytest.raises(ValueError, match="prompt_hash"):
        Request("r", (1, 2, 3), SAMPLED, prompt_hash=hashed)

"""The oracle: greedy speculative output equals the target's own greedy decoding."""

import random

import pytest

from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from drafter.suffix import SuffixDrafter
from speculative.fixed_k import FixedK
from speculative.options import MAX_SPECULATIVE_TOKENS
from speculative.sampling import SamplingParams
from tests.tiny import DraftsFirst, cutting_costs, hf_greedy, noisy_copy, run, tiny_llama
from verifier.engine import ModelVerifier

MAX_TOKENS = 24


def prompts():
    rng = random.Random(0)
    cases = [[rng.randrange(64) for _ in range(n)] for n in (1, 3, 8, 17)]
    return cases + [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2, 3]]  # repeats for the n-gram


@pytest.fixture(scope="module")
def target():
    return tiny_llama(7)


@pytest.fixture(scope="module")
def references(target):
    return [hf_greedy(target, prompt, MAX_TOKENS) for prompt in prompts()]


@pytest.fixture(scope="module")
def drafters(target):
    return {
        "self": lambda: ModelDrafter(target),  # always accepted: the "all K accepted" path
        "noisy": lambda: ModelDrafter(noisy_copy(target, 0.01, seed=1)),
        "random": lambda: ModelDrafter(tiny_llama(8, layers=1)),  # almost always rejected
        "ngram": lambda: NgramDrafter(64),
        # one drafter for every prompt: later prompts also draw on earlier outputs
        "suffix": lambda: SuffixDrafter(64),
        # blocks end early once the draft's confidence falls below 0.5
        "confident": lambda: ModelDrafter(noisy_copy(target, 0.01, seed=1), draft_confidence=0.5),
        # ...where each call says so (CONFIDENCE), over the pool's 0: a fixed cut, or learnt
        "per-call": lambda: ModelDrafter(noisy_copy(target, 0.01, seed=1)),
        "learnt": lambda: CutCounting(noisy_copy(target, 0.01, seed=1)),
    }


class CutCounting(ModelDrafter):
    """Counts the blocks cut short by a call's draft_confidence."""

    cut = 0

    async def propose(self, call):
        block = await super().propose(call)
        self.cut += bool(call.draft_confidence) and \
            0 < len(block.token_ids) < call.num_speculative_tokens
        return block


CONFIDENCE = {"per-call": 0.5, "learnt": "auto"}  # the draft calls' draft_confidence


CASES = [("self", 0)] + [
    (kind, k) for kind in ("self", "noisy", "ngram") for k in range(1, 9)
] + [("random", k) for k in (1, 4, 8)] + [(kind, k) for kind in ("suffix", "confident", "per-call")
                                           for k in (1, 3, 8)] + [
    (kind, "auto") for kind in ("self", "noisy", "random", "ngram", "suffix", "confident",
                                "per-call", "learnt")]


@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
@pytest.mark.parametrize("kind, k", CASES)
def test_greedy_speculation_equals_target_greedy(target, references, drafters, kind, k,
                                                 pipelined):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    drafter, verifier = drafters[kind](), ModelVerifier(target)
    accepted = drafted = pre_drafted = beside = 0
    costs = cutting_costs()  # the router's, shared by its requests: the learnt cut is 0.3
    for i, (prompt, expected) in enumerate(zip(prompts(), references)):
        out, state = run(drafter, verifier, prompt, greedy, k, request_id=f"r{i}",
                         pipelined=pipelined, confidence=CONFIDENCE.get(kind), costs=costs)
        assert out == expected, f"prompt {i}, K={k}, {kind} drafter"
        accepted += state.stats.num_accepted_tokens
        drafted += state.stats.num_draft_tokens
        pre_drafted += state.stats.pipelined_rounds
        beside += state.stats.predrafts
    assert len(drafter.sessions) == 0 and len(verifier.sessions) == 0  # released
    if kind in ("self", "noisy") and k != 0:  # (a first round's drafter prefill is no draft)
        assert (beside > 0) == pipelined
    if kind == "self":
        # drafter cache bugs cost only speed: only acceptance can reveal them
        assert accepted == drafted
    if kind in ("ngram", "suffix"):
        assert drafted > 0  # the repeating prompts give the model-free drafters matches
    if kind == "learnt" and not pipelined:
        assert drafter.cut > 0  # the learnt cut ended blocks early (pipelined: no cut)
    if kind == "noisy" and k != 0:
        assert 0 < accepted < drafted  # the case exercises acceptance and rejection both
    if pipelined and (kind == "self" and k != 0 or kind == "noisy" and k in (1, 2, 3, 4)):
        assert pre_drafted > 0  # the pre-drafted path ran (rare for long noisy blocks)


@pytest.mark.parametrize("kind, k", [("self", 3), ("noisy", 1), ("noisy", 3), ("noisy", 8),
                                     ("random", 4)])
def test_pipelined_rounds_that_draft_first_equal_target_greedy(target, references, drafters,
                                                               kind, k):
    """After a rejection the round drafts K, then verifies them beside the next block's
    pre-draft: no round runs the target alone but a request's first (and a last one
    clipped to its end)."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    drafter, verifier = drafters[kind](), ModelVerifier(target)
    pre_drafted = 0
    for i, (prompt, expected) in enumerate(zip(prompts(), references)):
        out, state = run(drafter, verifier, prompt, greedy, k, request_id=f"r{i}",
                         pipelined=True, policy=DraftsFirst(k))
        assert out == expected, f"prompt {i}, K={k}, {kind} drafter"
        assert state.stats.rounds_by_k.get(0, 0) <= 2
        pre_drafted += state.stats.pipelined_rounds
    assert len(drafter.sessions) == 0 and len(verifier.sessions) == 0
    if kind == "self" or k < 4:
        assert pre_drafted > 0  # whole blocks were accepted and their pre-drafts carried


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_largest_k_pipelined_asks_the_drafter_for_no_more_than_its_bound(target,
                                                                             temperature):
    """K = MAX_SPECULATIVE_TOKENS, whole blocks accepted: a pre-draft of K + 1 tokens (y1
    tested at the bonus position) would be over the drafter's bound, refused, and the request
    lost; it asks for the bound."""
    prompt, params = prompts()[1], SamplingParams(temperature=temperature, max_tokens=200, seed=1)
    out, state = run(ModelDrafter(target), ModelVerifier(target), prompt, params,
                     MAX_SPECULATIVE_TOKENS, pipelined=True)
    assert len(out) == 200 and state.stats.pipelined_rounds > 0
    if temperature == 0:
        assert out == hf_greedy(target, prompt, 200)


class BonusAsked:
    """A verifier that records, per call, whether it was asked for p(K + 1)."""

    def __init__(self, verifier) -> None:
        self.verifier, self.asked = verifier, []

    async def score(self, call):
        self.asked.append(call.return_bonus_probs)
        return await self.verifier.score(call)

    async def release(self, request_id: str) -> None:
        await self.verifier.release(request_id)


@pytest.mark.parametrize("pipelined", [False, True])
def test_p_of_the_bonus_position_is_asked_for_only_where_a_predraft_can_test_it(target,
                                                                               pipelined):
    """Unpipelined, a sampled request's first round runs the drafter's prefill beside its
    verify: it drafts nothing, so p(K + 1) (a dense row) would travel for nothing, and no
    later round pre-drafts. Pipelined rounds pre-draft the next block and ask for it."""
    verifier = BonusAsked(ModelVerifier(target))
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=3)
    run(ModelDrafter(target), verifier, prompts()[2], params, 3, pipelined=pipelined)
    assert len(verifier.asked) > 1 and any(verifier.asked) == pipelined


def test_a_drafter_release_that_fails_still_releases_the_verifiers_cache(target):
    class FailingRelease(ModelDrafter):
        async def release(self, request_id: str) -> None:
            raise RuntimeError("the drafter's release failed")

    verifier = ModelVerifier(target)
    with pytest.raises(RuntimeError, match="release failed"):
        run(FailingRelease(target), verifier, prompts()[1],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS), 3)
    assert len(verifier.sessions) == 0


def test_stop_tokens_end_the_output_and_are_included(target, references):
    prompt, expected = prompts()[2], references[2]
    stop = expected[5]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    out, state = run(ModelDrafter(target), ModelVerifier(target), prompt, greedy, 4, stop=(stop,))
    assert out == expected[: expected.index(stop) + 1] and state.finish_reason == "stop"


class OffMainChain:
    """A verifier that counts the rounds whose greedy path leaves a tree's main chain (an
    accepted sibling): the tree case must exercise them."""

    def __init__(self, verifier) -> None:
        self.verifier, self.sibling_paths, self.trees = verifier, 0, 0
        self.sessions = verifier.sessions

    async def score(self, call):
        from speculative.tree import DraftTree, accept_tree_greedy

        scores = await self.verifier.score(call)
        if call.draft_parents is not None:
            self.trees += 1
            tree = DraftTree(call.draft_token_ids, call.draft_parents)
            path = accept_tree_greedy(tree, scores.target_token_ids).accepted_nodes
            self.sibling_paths += any(node != depth for depth, node in enumerate(path))
        return scores

    async def release(self, request_id):
        await self.verifier.release(request_id)


@pytest.mark.parametrize("width, nodes", [(2, 0), (4, 0), (3, 10)])
@pytest.mark.parametrize("kind, k", [("self", 3), ("noisy", 1), ("noisy", 4), ("noisy", 8),
                                     ("random", 4), ("suffix", 4)])
def test_greedy_trees_equal_target_greedy(target, references, drafters, kind, k, width, nodes):
    """Each round a tree: up to `width` children at each node of the main chain, K deep,
    `nodes` in all (0: width everywhere); the verifier scores every node in one forward, the
    router keeps the path that matches."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    drafter, verifier = drafters[kind](), OffMainChain(ModelVerifier(target))
    for i, (prompt, expected) in enumerate(zip(prompts(), references)):
        out, _ = run(drafter, verifier, prompt, greedy, k, request_id=f"r{i}", tree_width=width,
                     tree_nodes=nodes)
        assert out == expected, f"prompt {i}, K={k}, width {width}, {kind} drafter"
    assert verifier.trees > 0 and len(verifier.sessions) == 0
    if kind in ("noisy", "random"):
        assert verifier.sibling_paths > 0  # a sibling was accepted: its keys were re-fed


class TreeEveryOtherRound(FixedK):
    """A policy whose K is the node budget and whose every other round drafts a tree of it,
    one level shorter (as AdaptiveK.round_shape chooses one), the others a chain."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.rounds = 0

    def round_shape(self, free):
        self.rounds += 1
        return (self.k - 1, self.k) if free and self.rounds % 2 else None


@pytest.mark.parametrize("kind, k", [("noisy", 3), ("noisy", 8), ("random", 4)])
def test_trees_chosen_round_by_round_equal_target_greedy(target, references, drafters, kind, k):
    """A tree in some rounds and a chain in the others, as a policy chooses them: each
    round's caches follow the path it kept."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    drafter, verifier = drafters[kind](), OffMainChain(ModelVerifier(target))
    for i, (prompt, expected) in enumerate(zip(prompts(), references)):
        policy = TreeEveryOtherRound(k)
        out, state = run(drafter, verifier, prompt, greedy, k, request_id=f"r{i}",
                         policy=policy)
        assert out == expected, f"prompt {i}, K={k}, {kind} drafter"
        assert state.stats.tree_rounds < state.stats.rounds  # chains between the trees
    assert verifier.trees > 0 and verifier.sibling_paths > 0

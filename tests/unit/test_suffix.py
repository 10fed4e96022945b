"""Suffix decoding's index and drafter by hand-built cases: counts, the longest match, the most
frequent continuation and its stopping rule, the global index's bound, and greedy output
equal to the target alone (also tests/unit/test_oracle.py)."""

import asyncio
import itertools

import pytest

from drafter.registry import DrafterSpec, build_drafter
from drafter.suffix import SuffixDrafter, SuffixIndex
from engine.models import DEMO_TARGET
from speculative.prefixes import EMPTY_PREFIX_HASH, prefix_hash
from speculative.sampling import SamplingParams
from speculative.types import (
    PrefixSync,
    ProposeCall,
    StaleBase,
)


def substrings(tokens, depth):
    counts = {}
    for start, end in itertools.combinations(range(len(tokens) + 1), 2):
        if end - start <= depth:
            key = tuple(tokens[start:end])
            counts[key] = counts.get(key, 0) + 1
    return counts


def indexed(index: SuffixIndex) -> dict:
    """{path: count} of every node."""
    found, stack = {}, [((), index.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            found[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return found


SEQUENCE = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5]


def test_every_substring_is_counted_once_added_or_extended():
    whole = SuffixIndex(max_depth=4)
    whole.add(SEQUENCE)
    assert indexed(whole) == substrings(SEQUENCE, 4)
    grown, previous = SuffixIndex(max_depth=4), 0
    for end in (3, 4, 7, len(SEQUENCE)):  # committed in rounds of different sizes
        grown.extend(SEQUENCE[:end], end - previous)
        previous = end
    assert indexed(grown) == indexed(whole)
    whole.add(SEQUENCE, sign=-1)  # uncounted: nothing is left
    assert indexed(whole) == {}


def test_the_most_frequent_continuation_of_the_longest_match():
    index = SuffixIndex(max_depth=8)
    index.add(SEQUENCE)
    # "1 2" was followed by 3 twice and by 4 once; "1 2 3" by 1 once (and 5, the end)
    tokens, score = index.propose([9, 1, 2], 4, min_token_prob=0.1, max_spec_factor=4)
    assert tokens[0] == 3 and score > 0
    node, length = index.match([7, 2, 4, 1])  # "2 4 1" occurred, followed by 2
    assert length == 3 and list(node.children) == [2]
    assert index.match([9, 9]) == (None, 0)
    # the continuation stops when its frequency falls below min_token_prob: after "1 2",
    # 3 has 2/3; after "1 2 3", 1 and 5 have 1/2 each: 2/3 * 1/2 = 1/3 < 0.5
    assert index.propose([1, 2], 4, min_token_prob=0.5, max_spec_factor=4)[0] == [3]
    # and at most max_spec_factor x the match length tokens
    assert len(index.propose([1, 2], 4, min_token_prob=0.01, max_spec_factor=0.5)[0]) == 1


def call(request_id, known, new, k=4, prompt_len=0):
    sync = PrefixSync(len(known), prefix_hash(known) if known else EMPTY_PREFIX_HASH,
                      tuple(new))
    return ProposeCall(request_id, sync, k, SamplingParams(temperature=0), seed=0,
                       prompt_len=prompt_len)


def test_outputs_of_finished_requests_propose_for_later_ones_within_a_bound():
    drafter = SuffixDrafter(16, max_global_outputs=1, max_spec_factor=2)
    prompt, output = [1, 2], [3, 4, 5, 6, 7]
    asyncio.run(drafter.propose(call("a", [], prompt + output, prompt_len=2)))
    asyncio.run(drafter.release("a"))
    # a new request whose context ends like a's output began: a's continuation comes back
    block = asyncio.run(drafter.propose(call("b", [], [9, 3, 4], prompt_len=1)))
    assert block.token_ids == (5, 6, 7)
    asyncio.run(drafter.release("b"))  # b's output [3, 4] replaces a's: the bound is 1
    assert list(drafter.outputs.values()) == [[3, 4]]
    block = asyncio.run(drafter.propose(call("c", [], [9, 3, 4], prompt_len=1)))
    assert block.token_ids == ()  # "3 4" was never continued in what is left
    assert len(drafter.sessions) == 1


def test_the_global_index_is_bounded_in_tokens_too():
    """Outputs leave, oldest first, while their tokens are over max_global_tokens; one longer
    than the bound alone keeps its last tokens; the tries count exactly what is left."""
    drafter = SuffixDrafter(16, max_global_tokens=6, max_spec_factor=2)
    for number, output in enumerate(([1, 2, 3], [4, 5], [6, 7, 8], list(range(9, 17)))):
        drafter.remember(f"r{number}", output)
        kept = [token for kept in drafter.outputs.values() for token in kept]
        assert drafter.global_tokens == len(kept) <= 6
        reference = SuffixIndex(drafter.max_depth)
        for kept in drafter.outputs.values():
            reference.add(kept)
        assert tries(drafter.global_index.root) == tries(reference.root)
    assert list(drafter.outputs.values()) == [[11, 12, 13, 14, 15, 16]]


def tries(node) -> dict:
    return {token: (child.count, tries(child)) for token, child in node.children.items()}


def test_the_pools_release_feeds_the_global_index_and_a_reused_id_starts_over():
    """A drafter pool releases through its session store (deployments.pools: Release), not
    the engine's release: the output still joins the global index. A later request under
    the same id, with another prompt, gets a fresh index (no stale counts)."""
    drafter = SuffixDrafter(16, max_spec_factor=2)
    drafter.propose_now(call("r", [], [1, 2, 3, 1, 2]))
    drafter.sessions.release("r")
    assert list(drafter.outputs.values()) == [[1, 2, 3, 1, 2]]  # prompt_len 0: all of it
    block = drafter.propose_now(call("r", [], [7, 8, 9, 7, 8, 9]))
    assert block.token_ids == (7, 8, 9)  # from its own index: "7 8 9" was followed by "7 8 9"


def test_a_rebuilt_request_reindexes_its_tokens():
    drafter = SuffixDrafter(16, max_spec_factor=1)
    asyncio.run(drafter.propose(call("a", [], [1, 2, 3, 1, 2])))
    # "5" was followed by 6; one token, as the match is one token long (max_spec_factor 1)
    assert asyncio.run(drafter.propose(call("a", [], [5, 6, 5]))).token_ids == (6,)


def test_an_evicted_then_rebuilt_request_is_indexed_once():
    """A session closed by an eviction indexes its output so far; the request's next call
    rebuilds it (its whole context), and its release indexes the whole output: in place of
    the first, not beside it (counted twice, the rebuilt request's continuations outranked
    every other output's, and its tokens took twice their room under max_global_tokens)."""
    drafter = SuffixDrafter(16, max_cached_requests=1, max_spec_factor=2)
    drafter.propose_now(call("a", [], [1, 2, 3, 4], prompt_len=1))
    drafter.propose_now(call("b", [], [9], prompt_len=1))  # evicts a: [2, 3, 4] indexed
    with pytest.raises(StaleBase):
        drafter.propose_now(call("a", [1, 2, 3, 4], [5], prompt_len=1))
    drafter.propose_now(call("a", [], [1, 2, 3, 4, 5], prompt_len=1))  # the rebuild
    drafter.sessions.release("a")
    assert list(drafter.outputs.values()) == [[2, 3, 4, 5]] and drafter.global_tokens == 4
    reference = SuffixIndex(drafter.max_depth)
    reference.add([2, 3, 4, 5])
    assert tries(drafter.global_index.root) == tries(reference.root)


def test_the_registry_builds_it_with_checked_options():
    assert isinstance(build_drafter(DrafterSpec(kind="suffix", target=DEMO_TARGET)),
                      SuffixDrafter)
    with pytest.raises(ValueError, match="min_token_prob"):
        SuffixDrafter(16, min_token_prob=0)


def test_a_tree_holds_the_other_frequent_continuations():
    """propose_tree: the chain's tokens first, then the next most frequent continuations
    at its nodes, the likeliest first within the node budget and above min_token_prob."""
    index = SuffixIndex(8)
    for output in ([7, 1, 2], [7, 1, 2], [7, 1, 3], [7, 4, 5], [7, 6, 5]):
        index.add(output)
    # after 7: 1 (3 of 5), 4, 6 (1 each); after 7 1: 2 (2 of 3), 3 (1)
    tokens, parents, score = index.propose_tree([9, 7], 2, 3, 0, 0.1, 2.0)
    assert tokens[:2] == (1, 2) and parents[:2] == (-1, 0)
    assert sorted(zip(tokens[2:], parents[2:])) == [(3, 0), (4, -1), (6, -1)]
    assert score == pytest.approx(0.6 + 0.4 + 0.2 + 0.2 + 0.2)
    tokens, parents, _ = index.propose_tree([9, 7], 2, 3, 3, 0.1, 2.0)  # 3 nodes in all
    assert len(tokens) == 3 and tokens[2] in (4, 6, 3)
    assert index.propose_tree([9, 7], 2, 3, 0, 0.3, 2.0)[0] == (1, 2)  # rarer ones cut


def test_a_tree_request_gets_a_tree_and_its_whole_output_is_indexed():
    """Through the drafter: width 3 asks for a tree (no q: verified by matching the
    target's draws); observe() hands the session the last rounds' tokens, so release indexes
    the whole output."""
    drafter = SuffixDrafter(16, max_spec_factor=2)
    for name, output in (("a", [7, 1, 2]), ("b", [7, 4, 5])):
        drafter.propose_now(call(name, [], [9, 7]))
        drafter.observe(name, [9, 7] + output[1:])  # what the router committed after
        drafter.sessions.release(name)
    assert list(drafter.outputs.values()) == [[9, 7, 1, 2], [9, 7, 4, 5]]
    sampled = SamplingParams(temperature=1.0)
    block = drafter.propose_now(ProposeCall("c", PrefixSync(0, EMPTY_PREFIX_HASH, (8, 9, 7)),
                                            2, sampled, 0, tree_width=3))
    assert block.draft_probs is None and block.parents is not None
    assert set(block.token_ids) == {1, 2, 4} and block.parents[0] == -1
    drafter.observe("c", [3, 3])  # not an extension of its tokens: ignored
    assert drafter.sessions.get("c").committed == [8, 9, 7]


def test_a_long_repeat_still_proposes_a_whole_block():
    """The match leaves room in the tries for the continuation: a repeat longer than the
    tries' depth proposes K tokens, not the one its deepest node holds."""
    index = SuffixIndex(6)
    tokens = [1, 2, 3] * 6
    index.add(tokens)
    proposed, _ = index.propose(tokens, 3, 0.1, 1.0)
    assert proposed == [1, 2, 3]
    assert index.match(tokens, 3)[1] == 3 and index.match(tokens)[1] == 5


def test_a_long_k_keeps_a_match_that_predicts():
    """The match's room is bounded so that a long K still proposes factor x match tokens:
    K = 32 on a long repeat proposes 16 (a match of 8), not one or two; and a tree stays
    within the 64 nodes a verifier scores."""
    index = SuffixIndex(24)
    tokens = list(range(30)) * 3
    index.add(tokens)
    proposed, _ = index.propose(tokens, 32, 0.1, 2.0)
    assert len(proposed) == 16 and proposed == list(range(16))
    wide, base = SuffixIndex(24), list(range(1, 21))
    for _ in range(10):
        wide.add(base)
    for level in range(1, 20):  # 7 other continuations at every level of the base
        for other in range(7):
            wide.add(base[:level] + [200 + 10 * level + other])
    tree_tokens, parents, _ = wide.propose_tree([1], 16, 8, 500, 1e-6, 32.0)
    assert tree_tokens[:16] == tuple(range(2, 18)) and len(tree_tokens) == 64


def test_the_router_runs_a_long_call_and_every_release_off_its_event_loop():
    """The router's own drafters (deployments.local_drafters): a call over OFF_LOOP_TOKENS
    tokens of context or bringing more than OFF_LOOP_NEW_TOKENS (a suffix drafter indexes
    the whole prompt on a first call, ~170 us a token) and a release (its output joins the
    global index) run on a worker thread, one at a time; a round's few new tokens over a
    short context stay on the loop. The proposals are the drafter's own."""
    import threading

    from deployments.local_drafters import OFF_LOOP_NEW_TOKENS, OFF_LOOP_TOKENS, OffLoop

    drafter = SuffixDrafter(16, max_spec_factor=2)
    where, inside = [], []
    propose_now, release_now = drafter.propose_now, drafter.release_now

    def watched(work):
        def run(*args):
            assert not inside  # one caller at a time
            inside.append(1)
            where.append(threading.current_thread() is threading.main_thread())
            try:
                return work(*args)
            finally:
                inside.pop()
        return run

    drafter.propose_now, drafter.release_now = watched(propose_now), watched(release_now)
    long_prompt = [1, 2, 3] * (OFF_LOOP_TOKENS // 3 + 1)
    routed = OffLoop(drafter)

    async def main():
        blocks = await asyncio.gather(routed.propose(call("long", [], long_prompt)),
                                      routed.propose(call("short", [], [7, 8, 9, 7, 8])))
        await routed.propose(call("first", [], [5] * (OFF_LOOP_NEW_TOKENS + 1)))
        await routed.propose(call("first", [5] * (OFF_LOOP_NEW_TOKENS + 1), [6]))
        await routed.release("long")
        return blocks

    long_block, short_block = asyncio.run(main())
    # on a thread: the long context, a first call of 65 tokens, the release
    assert where == [False, True, False, True, False]
    assert long_block.token_ids == (1, 2, 3, 1) and short_block.token_ids == (9, 7, 8)
    assert list(drafter.outputs.values()) == [long_prompt]


def test_the_router_runs_a_call_with_a_grammar_off_its_event_loop():
    """A constrained request's round, however short, may build its grammar's matcher (the
    first round with a proposal): 41 ms of the loop for a 60 KB schema over the demo's
    4,096 tokens, every other stream held meanwhile. Unconstrained, it stays on the loop."""
    import threading
    from dataclasses import replace

    from deployments.local_drafters import OffLoop

    drafter = SuffixDrafter(16)
    on_loop, propose_now = [], drafter.propose_now

    def watched(call):
        on_loop.append(threading.current_thread() is threading.main_thread())
        return propose_now(call)

    drafter.propose_now = watched
    routed = OffLoop(drafter)
    plain = call("plain", [], [7, 8, 9, 7, 8])
    constrained = replace(call("constrained", [], [7, 8, 9, 7, 8]),
                          sampling=SamplingParams(temperature=0, grammar='start: "a"'))

    async def main():
        await routed.propose(plain)
        await routed.propose(constrained)

    asyncio.run(main())
    assert on_loop == [True, False]


def test_the_routers_own_drafter_indexes_the_whole_output_and_a_cancelled_call_blocks_it():
    """Through the router's wrapper (deployments.local_drafters.OffLoop): observe() reaches
    the drafter with the release, so the global index gets the last rounds' tokens too; a
    call on a thread whose caller is cancelled holds the drafter until its thread ends, so
    the request's release after it runs after it and leaves no session behind."""
    import threading

    from deployments.local_drafters import OFF_LOOP_TOKENS, OffLoop

    drafter = SuffixDrafter(16, max_spec_factor=2)
    routed = OffLoop(drafter)
    asyncio.run(routed.propose(call("a", [], [9, 7], prompt_len=2)))
    routed.observe("a", [9, 7, 1, 2])
    asyncio.run(routed.release("a"))
    assert list(drafter.outputs.values()) == [[1, 2]] and not routed.observed

    started, finish, order = threading.Event(), threading.Event(), []
    propose_now = drafter.propose_now

    def slow(one):
        started.set()
        finish.wait(10)
        order.append("propose")
        return propose_now(one)

    drafter.propose_now = slow
    release_now = drafter.release_now
    drafter.release_now = lambda request_id: (order.append("release"),
                                               release_now(request_id))

    async def main():
        long = asyncio.ensure_future(routed.propose(call("b", [], [1, 2, 3] * OFF_LOOP_TOKENS)))
        await asyncio.to_thread(started.wait, 10)  # its thread runs
        long.cancel()
        released = asyncio.ensure_future(routed.release("b"))
        await asyncio.sleep(0.05)
        assert not released.done()  # held back by the thread still running
        finish.set()
        await released
        return long.cancelled()

    assert asyncio.run(main())
    assert order == ["propose", "release"] and drafter.sessions.get("b") is None


def test_a_refused_call_leaves_the_drafters_sessions_alone():
    drafter = SuffixDrafter(16, max_cached_requests=1)
    drafter.propose_now(call("kept", [], [1, 2, 3]))
    wide = ProposeCall("w", PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2)), 2,
                       SamplingParams(temperature=0), 0, tree_width=99)
    for refused in (call("empty", [], []), wide):
        with pytest.raises(ValueError):
            drafter.propose_now(refused)
    assert drafter.sessions.get("kept") is not None and len(drafter.sessions) == 1


def test_the_router_closes_an_evicted_session_off_its_event_loop():
    """A short call that evicts another request's session (the drafter's session bound
    reached: a router whose max_running_requests passes it) closes that session, and a suffix
    drafter indexes the closed output, as a release does: on the worker thread, not the loop
    (the pools ask the same of their sessions: SessionStore.may_close)."""
    import threading

    from deployments.local_drafters import OffLoop

    drafter = SuffixDrafter(16, max_cached_requests=1)
    on_loop, remember = [], drafter.remember

    def watched(request_id, output):
        on_loop.append(threading.current_thread() is threading.main_thread())
        remember(request_id, output)

    drafter.remember = watched
    routed = OffLoop(drafter)

    async def main():
        await routed.propose(call("a", [], [1, 2, 3, 1, 2], prompt_len=1))
        await routed.propose(call("b", [], [4, 5, 6], prompt_len=1))  # evicts a

    asyncio.run(main())
    assert on_loop == [False] and list(drafter.outputs.values()) == [[2, 3, 1, 2]]


def test_the_routers_drafters_hold_a_session_for_every_choice_it_runs():
    """Built with the drafters' default 256 sessions, a router admitting more evicted
    running sessions every round (a suffix drafter then indexed each prompt again)."""
    from deployments.router import local_drafters
    from engine.checkpoint import Checkpoint
    from engine.models import DEMO_TARGET

    target = Checkpoint.load(DEMO_TARGET)
    for running, sessions in ((128, 256), (1000, 2000)):
        drafters = local_drafters(DEMO_TARGET, target, running, 262_144)
        assert {kind: routed.drafter.sessions.capacity for kind, routed in drafters.items()} \
            == {"ngram": sessions, "suffix": sessions}

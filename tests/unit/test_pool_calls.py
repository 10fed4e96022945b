"""bench.pool_calls: its rounds keep each pool's caches in step (no call is refused or
rebuilt), the clock counts every forward, and a pool's time splits into forwards and the
rest."""

import pytest

from bench.pool_calls import ForwardClock, Requests, measure
from drafter.model import ModelDrafter
from tests.tiny import tiny_llama
from verifier.engine import ModelVerifier


@pytest.mark.parametrize("k, temperature", [(0, 0.0), (3, 0.0), (3, 1.0)])
def test_rounds_stay_in_step_and_every_forward_is_timed(k, temperature):
    target, draft = tiny_llama(1), tiny_llama(2, layers=1)
    drafter, verifier = ModelDrafter(draft), ModelVerifier(target)
    result = measure(drafter, verifier, requests=3, k=k, batches=5, prompt_tokens=12,
                     temperature=temperature)
    assert set(result) == ({"drafter", "verifier"} if k else {"verifier"})
    assert all(forwards > 0 and outside > 0 for forwards, outside in result.values())
    # every call built on what its pool held: nothing rebuilt from the whole prefix
    assert verifier.sessions.stats.misses == drafter.sessions.stats.misses == 0
    assert verifier.sessions.stats.hits == 3 * 8  # 9 batches of 3, the first 3 new
    # one verifier forward a batch, and K drafter forwards (a step each)
    assert verifier.runner.forward.calls == 9
    assert drafter.runner.forward.calls == (9 * k if k else 0)


def test_each_round_commits_two_drafted_tokens_and_the_targets_own():
    requests = Requests(2, prompt_tokens=4, vocab_size=50)
    first = list(requests.committed[1])
    assert requests.sync("verifier", 1).new_token_ids == tuple(first)
    requests.commit(1, (11, 12, 13), 40)
    assert requests.committed[1] == first + [11, 12, 40]
    sync = requests.sync("drafter", 1)
    assert (sync.known_len, sync.new_token_ids) == (4, (11, 12, 40))


def test_the_clock_adds_up_the_forwards_it_wraps():
    class Runner:
        def forward(self, segments):
            return list(segments)

    runner = Runner()
    clock = ForwardClock(runner)
    assert runner.forward([1, 2]) == [1, 2] and runner.forward([]) == []
    assert clock.calls == 2 and clock.seconds > 0

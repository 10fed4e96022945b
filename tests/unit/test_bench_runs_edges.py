"""The engine and placement benchmarks (bench.mixed_batches, prefix, spread) on stand-ins
for their models and servers: which requests each sends and how its printed numbers are
computed."""

import contextlib
import sys
import types

import pytest

from bench import mixed_batches, prefix, spread
from speculative.prefixes import EMPTY_PREFIX_HASH, prefix_hash


# ---------------------------------------------------------------------------- mixed_batches


class Verifier:
    """A verifier's stand-in: records its calls; score_now reports `cached` tokens."""

    def __init__(self, cached: int = 0) -> None:
        self.now, self.batches, self.released, self.cached = [], [], [], cached
        self.model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=50))
        self.sessions = types.SimpleNamespace(release=self.released.append)
        self.runner = types.SimpleNamespace(attention="stand-in")

    def score_now(self, call):
        self.now.append(call)
        return types.SimpleNamespace(cached_tokens=self.cached)

    def score_batch(self, calls):
        self.batches.append(list(calls))


def test_mixed_batches_run_sends_every_decode_its_round_and_one_fresh_prompt():
    """Batches: D decodes of C context each prefilled; a batch is each decode's bonus token
    and K drafted tokens after all its ids, and a fresh P-token prompt released after."""
    verifier = Verifier()
    batches = mixed_batches.Batches(verifier, decodes=3, context=7)
    assert [c.request_id for c in verifier.now] == ["d0", "d1", "d2"]
    assert all(len(c.sync.new_token_ids) == 7 and c.sync.known_len == 0 for c in verifier.now)
    assert len({c.sync.new_token_ids for c in verifier.now}) == 3
    assert all(0 < t < 50 for c in verifier.now for t in c.sync.new_token_ids)
    for round_, k, prompt in ((0, 4, 16), (1, 2, 30)):
        before = {rid: list(ids) for rid, ids in batches.committed.items()}
        batches.run(k, prompt)
        calls = verifier.batches[-1]
        assert [c.request_id for c in calls] == ["d0", "d1", "d2", f"p{round_ + 1}"]
        for call in calls[:3]:
            ids = before[call.request_id]
            assert call.sync.known_len == len(ids) == 7 + round_
            assert call.sync.known_hash == prefix_hash(ids) and call.sync.new_token_ids == (5,)
            assert call.draft_token_ids == tuple(range(11, 11 + k))
        new = calls[-1]
        assert new.sync.known_len == 0 and new.sync.known_hash == EMPTY_PREFIX_HASH
        assert len(new.sync.new_token_ids) == prompt and new.draft_token_ids == ()
        assert verifier.released[-1] == f"p{round_ + 1}"
        assert all(ids[-1] == 5 and len(ids) == 8 + round_ for ids in batches.committed.values())
    first, second = (batch[-1].sync.new_token_ids[:16] for batch in verifier.batches)
    assert first != second  # a fresh prompt each batch


def test_mixed_batches_main_alternates_the_layouts_and_drops_the_warm_up(monkeypatch, capsys):
    """main: repeats + 1 batches a layout, alternated, the first of each dropped; prints the
    medians and their ratio, and puts the forward's own layout back."""
    seen = []

    class FakeBatches:
        times = iter([100.0, 1.0, 3.0, 1.0, 5.0, 2.0, 4.0, 2.0])

        def __init__(self, verifier, decodes, context):
            seen.append(("batches", decodes, context))

        def run(self, k, prompt):
            seen.append((mixed_batches.engine.lean.feed_groups, k, prompt))
            return next(self.times) / 1e3

    monkeypatch.setattr(mixed_batches, "load_causal_lm", lambda name: "model")
    monkeypatch.setattr(mixed_batches, "ModelVerifier", lambda model: "verifier")
    monkeypatch.setattr(mixed_batches, "Batches", FakeBatches)
    monkeypatch.setattr(sys, "argv", ["mb", "--decodes", "2", "--k", "3", "--context", "9",
                                      "--prompts", "16", "--repeats", "3"])
    mixed_batches.main()
    layouts = [layout for layout, *_ in seen[1:]]
    assert seen[0] == ("batches", 2, 9) and len(layouts) == 8
    assert layouts[0::2] == [mixed_batches.LAYOUTS["one"]] * 4
    assert layouts[1::2] == [mixed_batches.feed_groups] * 4
    assert {s[1:] for s in seen[1:]} == {(3, 16)}
    assert "| 9 | 16 | 4.0 | 2.0 | 2.00x |" in capsys.readouterr().out
    assert mixed_batches.engine.lean.feed_groups is mixed_batches.feed_groups


# ---------------------------------------------------------------------------- bench.prefix


def test_prefix_first_token_scores_the_whole_prompt_as_the_prompt():
    """first_token_s: one call from an empty prefix with every prompt id and prompt_len set
    (cached_tokens counts the prompt's); returns the cached tokens reported."""
    verifier = Verifier(cached=12)
    seconds, cached = prefix.first_token_s(verifier, "a", [3, 4, 5])
    call = verifier.now[0]
    assert cached == 12 and seconds >= 0 and call.request_id == "a"
    assert (call.sync.known_len, call.sync.known_hash, call.sync.new_token_ids) == \
        (0, EMPTY_PREFIX_HASH, (3, 4, 5))
    assert call.draft_token_ids == () and call.prompt_len == 3
    assert call.sampling.temperature == 0.0


def test_prefix_main_repeats_a_prefix_with_two_last_tokens_and_drops_the_warm_up(
        monkeypatch, capsys):
    """main: each repeat a fresh prefix of --prefix-tokens ids, then that prefix + 11 and,
    once released, + 12; the first repeat is a warm-up; medians, ratio, the fewest cached."""
    calls, times = [], iter([9.0, 9.0, 0.004, 0.001, 0.002, 0.001, 0.006, 0.003])
    verifier = Verifier()

    def first_token_s(v, request_id, prompt):
        calls.append((request_id, list(prompt)))
        return next(times), 100 + len(calls)

    monkeypatch.setattr(prefix, "load_causal_lm", lambda name: "model")
    monkeypatch.setattr(prefix, "ModelVerifier", lambda model, max_batch_tokens: verifier)
    monkeypatch.setattr(prefix, "first_token_s", first_token_s)
    monkeypatch.setattr(sys, "argv", ["prefix", "--prefix-tokens", "6", "--repeats", "3"])
    prefix.main()
    assert [rid for rid, _ in calls] == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]
    assert verifier.released == [rid for rid, _ in calls]
    for (_, a), (_, b) in zip(calls[0::2], calls[1::2]):
        assert len(a) == 7 and a[:6] == b[:6] and (a[6], b[6]) == (11, 12)
        assert all(0 < t <= 4000 for t in a[:6])
    assert len({tuple(a) for _, a in calls[0::2]}) == 4  # fresh prefixes
    out = capsys.readouterr().out
    assert "| 7 | 4.0 | 1.0 | 0.25x | 104 |" in out


# ---------------------------------------------------------------------------- bench.spread


def test_spread_config_sets_the_replicas_and_the_load_factor():
    """config_with: the verifier's replicas share one CPU; the router's load factor."""
    config = spread.config_with(1.25, 3)
    apps = {app["name"]: app for app in config["applications"]}
    deployment = apps["verifier"]["deployments"][0]
    assert deployment["num_replicas"] == 3
    assert deployment["ray_actor_options"] == {"num_cpus": pytest.approx(1 / 3)}
    assert apps["router"]["args"]["prefix_affinity_load_factor"] == 1.25
    none = {a["name"]: a for a in spread.config_with(None, 2)["applications"]}
    assert none["router"]["args"]["prefix_affinity_load_factor"] is None


def test_spread_run_sends_each_stream_the_shared_prefix(monkeypatch):
    """run: every stream at once, greedy, 200 tokens, ignore_eos, the shared prefix and its
    own function name; counts the 200s and reads the poller's last line."""
    posts, configs = [], []

    @contextlib.contextmanager
    def fresh(config):
        configs.append(config)
        yield 8123, 1.0

    def post(url, timeout, json):
        posts.append((url, json))
        return types.SimpleNamespace(status_code=500 if json["prompt"].endswith("f3(") else 200)

    watching = types.SimpleNamespace(communicate=lambda timeout: ("[1]\n[9, 7]\n", None))
    monkeypatch.setattr(spread, "fresh_serve_run", fresh)
    monkeypatch.setattr(spread, "poller", lambda streams: watching)
    monkeypatch.setattr(spread.time, "sleep", lambda s: None)
    monkeypatch.setattr(spread.requests, "post", post)
    result = spread.run(1.25, 5, 2)
    assert result["ok"] == 4 and result["sessions_per_replica"] == [9, 7]
    assert result["load_factor"] == 1.25 and result["seconds"] >= 0
    assert {url for url, _ in posts} == {"http://127.0.0.1:8123/v1/completions"}
    prompts = sorted(body["prompt"] for _, body in posts)
    assert prompts == [spread.SHARED + f"def f{i}(" for i in range(5)]
    assert {(b["max_tokens"], b["temperature"], b["ignore_eos"]) for _, b in posts} == \
        {(200, 0, True)}
    verifier = [a for a in configs[0]["applications"] if a["name"] == "verifier"][0]
    assert verifier["deployments"][0]["num_replicas"] == 2


def test_spread_all_at_once_runs_each_index_once():
    """all_at_once: work(i) for every i below count."""
    done = []
    assert spread.all_at_once(done.append, 6) >= 0
    assert sorted(done) == list(range(6))

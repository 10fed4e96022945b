"""The benchmark modes beside the suite (bench.methods, features, predicted, model_free)
on stand-ins for their models and servers: which requests each sends, with which seeds,
and how its printed numbers are computed (the engine and placement benchmarks:
test_bench_runs_edges.py)."""

import types

from bench import confidence, features, methods, model_free, predicted, trees
from bench.pairs import PROMPTS
from speculative.sampling import SamplingParams
from speculative.stats import SpecStats
from tests.tiny import Agreeing, CodePointTokenizer, Scripted


# ---------------------------------------------------------------------------- bench.methods


def test_methods_quick_keeps_its_shapes_greedy_and_the_runs_prompts(monkeypatch):
    """methods.run: --quick the QUICK_SHAPES at T = 0 only, the full run every shape at
    T = 0 and 1; each on the run's first num_prompts prompts and max_tokens, K = 4 for the
    model-free rows."""
    calls = []
    monkeypatch.setattr(trees, "rows_of", lambda pair, shapes, prompts, n, t: calls.append(
        ([s[0] for s in shapes], prompts, n, t)) or [t])
    monkeypatch.setattr(model_free, "run", lambda args: [vars(args)])
    monkeypatch.setattr(confidence, "run", lambda *args: list(args))
    out = methods.run(2, 32, quick=True)
    assert list(out["trees"]) == ["0"] and out["trees"]["0"] == [0.0]
    names, prompts, n, t = calls[0]
    assert sorted(names) == sorted(methods.QUICK_SHAPES) and prompts == PROMPTS[:2]
    assert (n, t) == (32, 0.0)
    assert out["model_free"] == [{"max_tokens": 32, "k": 4}]
    assert out["confidence"] == ["demo", 32, True, 2]
    calls.clear()
    out = methods.run(3, 48, quick=False)
    assert list(out["trees"]) == ["0", "1"]
    assert [c[0] for c in calls] == [[m[0] for m in trees.methods()]] * 2
    assert [(len(c[1]), c[2], c[3]) for c in calls] == [(3, 48, 0.0), (3, 48, 1.0)]
    assert out["confidence"] == ["demo", 48, False, 3]


def test_methods_markdown_rows_show_each_figure(monkeypatch):
    """markdown_lines: a row per tree and model-free result with its figures as printed."""
    monkeypatch.setattr(confidence, "markdown_lines", lambda rows: ["conf"])
    tree = {"method": "chain K=4", "nodes_per_round": 4.0, "tokens_per_round": 2.456,
            "tokens_per_s": 1234.4, "speedup": 1.456, "same_tokens": True}
    free = {"pass": "repeat", "workload": "code edit", "method": "suffix",
            "tokens_per_round": None, "tokens_per_s": 99.6, "speedup": 0.5,
            "same_tokens": False}
    lines = methods.markdown_lines({"trees": {"0": [tree, {**tree, "same_tokens": None}]},
                                    "model_free": [free]})
    assert "| 0 | chain K=4 | 4.00 | 2.46 | 1234 | 1.46x | yes |" in lines
    assert "| 0 | chain K=4 | 4.00 | 2.46 | 1234 | 1.46x | – |" in lines
    assert "| repeat | code edit | suffix | – | 100 | 0.50x | NO |" in lines
    assert lines[-2:] == ["conf", ""]


# ---------------------------------------------------------------------------- bench.features


def test_features_measure_runs_each_feature_seeded_at_k_0_and_4(monkeypatch):
    """features.measure: every feature at T 0 and 1, each held-out prompt at K = 0 then K = 4
    with seed 1000 x repeat + index and the feature's fields; acceptance, tokens/s at K = 4
    and the speedup over K = 0 from the sums."""
    calls = []

    def decode(drafter, verifier, ids, params, k):
        calls.append((tuple(ids), params, k))
        stats = SpecStats(num_draft_tokens=4 if k else 0, num_accepted_tokens=3 if k else 0)
        return (12, 0.5, stats) if k else (10, 1.0, stats)

    monkeypatch.setattr("engine.models.load_tokenizer", lambda name: CodePointTokenizer())
    monkeypatch.setattr("speculative.grammar.ll_tokenizer", lambda tokenizer, n: "grammar")
    monkeypatch.setattr(features, "pools", lambda grammar: ("drafter", "verifier"))
    monkeypatch.setattr(features, "feature_fields", lambda name, grammar: {
        key: value for key, value in features.FEATURES[name].items() if key != "grammar"})
    monkeypatch.setattr(features, "decode", decode)
    monkeypatch.setattr(features, "HELD_OUT", ["ab", "cde"])
    rows = features.measure(16, repeats=2)
    assert [(r["feature"], r["temperature"]) for r in rows] == \
        [(name, t) for name in features.FEATURES for t in (0.0, 1.0)]
    for r in rows:
        assert r["acceptance"] == 0.75 and r["tokens_per_s"] == 24.0 and r["speedup"] == 2.4
    assert len(calls) == 2 * 2 * len(features.FEATURES) * 2 * 2
    assert [k for *_, k in calls[:4]] == [0, 4, 0, 4]
    assert {(ids, p.seed) for ids, p, _ in calls} == {
        ((97, 98), 0), ((99, 100, 101), 1), ((97, 98), 1000), ((99, 100, 101), 1001)}
    assert {p.max_tokens for _, p, _ in calls} == {16}
    penalised = [p for _, p, _ in calls if p.presence_penalty == 1.0]
    assert len(penalised) == 2 * 2 * 2 * 2 and {p.temperature for p in penalised} == {0.0, 1.0}
    assert sum(p.logprobs == 5 for _, p, _ in calls) == 16


def test_feature_fields_and_decode_on_agreeing_pools():
    """feature_fields of a feature without a grammar are its fields; decode runs the request
    at the K asked (every draft accepted: K + 1 tokens a round) to max_tokens or END."""
    assert features.feature_fields("plain", None) == {}
    assert features.feature_fields("repetition_penalty 1.2", None) == {"repetition_penalty": 1.2}
    params = SamplingParams(temperature=0.0, max_tokens=10)
    tokens, seconds, stats = features.decode(Agreeing(), Agreeing(), [3, 4], params, 4)
    assert tokens == 10 and seconds > 0 and max(stats.rounds_by_k) == 4
    assert stats.num_draft_tokens == 7  # a first round alone, then 4 + 1 and 3 + 1
    tokens, _, stats = features.decode(Agreeing(), Agreeing(), [3, 4], params, 0)
    assert tokens == 10 and stats.num_draft_tokens == 0 and set(stats.rounds_by_k) == {0}
    script = Scripted([5, 6, 7], prompt_len=2)  # then END (0): a constrained output's end
    tokens, _, _ = features.decode(script, script, [3, 4], params, 4)
    assert tokens == 4


# ---------------------------------------------------------------------------- bench.predicted


def test_edited_replaces_about_its_share_seeded():
    """edited, "replace": the same length, about `share` of the ids changed, the same edits
    for the same seed and others for another; share 0 is the answer, share 1 all random."""
    answer = [7] * 2000
    out = predicted.edited(answer, 0.1, 1000, seed=3)
    assert len(out) == 2000 and isinstance(out, tuple)
    changed = sum(a != b for a, b in zip(answer, out))
    assert 150 <= changed <= 250
    assert out == predicted.edited(answer, 0.1, 1000, seed=3)
    assert out != predicted.edited(answer, 0.1, 1000, seed=4)
    assert predicted.edited(answer, 0.0, 1000, seed=3) == tuple(answer)
    assert sum(t == 7 for t in predicted.edited(answer, 1.0, 1000, seed=3)) < 10
    assert all(0 <= t < 5 for t in predicted.edited(answer, 1.0, 5, seed=3))


def test_edited_mixed_makes_spans_of_edits_at_half_the_share():
    """edited, "mixed": edits at about share / 2 of the positions, each replacing, inserting
    or deleting 1-3 ids; share 0 keeps the answer; seeded."""
    answer = list(range(1000, 4000))
    assert predicted.edited(answer, 0.0, 500, seed=1, kind="mixed") == tuple(answer)
    out = predicted.edited(answer, 0.2, 500, seed=1, kind="mixed")
    assert out == predicted.edited(answer, 0.2, 500, seed=1, kind="mixed")
    kept = [t for t in out if t >= 1000]
    assert kept == sorted(kept) and len(set(kept)) == len(kept)  # the answer's order
    new = [t for t in out if t < 1000]
    assert all(0 <= t < 500 for t in new)
    # ~300 edits of 2 ids on average: ~400 ids new (replaced, inserted), ~400 answer ids gone
    assert 250 <= len(new) <= 550 and 250 <= len(answer) - len(kept) <= 550
    assert abs(len(out) - len(answer)) < 100  # insertions and deletions alike: ids kept
    runs, previous = [], None  # the lengths of runs of new ids: 1 to 3, or 4-6 adjoining
    for t in out:
        if t < 1000:
            runs[-1:] = [runs[-1] + 1] if previous is not None and previous < 1000 else \
                runs[-1:] + [1]
        previous = t
    assert max(runs) <= 6 and min(runs) == 1 and 3 in runs


def test_predicted_run_sends_the_prediction_only_to_its_row(monkeypatch):
    """predicted.run: each prompt alone at K = 0 first, its prediction edited with the
    prompt's index as seed at --edits and --edit-kind, sent with the "prediction" row only;
    rows sum tokens, seconds and rounds over the prompts, vs K = 0 from the same run."""
    calls, edits = [], []
    answers = {0: [1, 2, 3, 4], "auto": [1, 2, 3, 4]}

    def run_loop(drafter, verifier, prompt, n, t, seed, k, prediction_ids=()):
        calls.append((drafter, tuple(prompt), n, t, seed, k, tuple(prediction_ids)))
        out = [1, 2, 3] if drafter == "draft" and prompt == [97] else answers[k]
        return out, 2.0 if k == 0 else 1.0, SpecStats(rounds=4 if k == 0 else 2)

    def edited(answer, share, vocab, seed, kind):
        edits.append((tuple(answer), share, vocab, seed, kind))
        return (9, seed)

    monkeypatch.setattr(predicted, "load_tokenizer", lambda name: CodePointTokenizer())
    monkeypatch.setattr(predicted, "load_causal_lm", lambda name: name)
    monkeypatch.setattr(predicted, "ModelVerifier", lambda model: types.SimpleNamespace(
        model=types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=77))))
    monkeypatch.setattr(predicted, "ModelDrafter", lambda model: "draft")
    monkeypatch.setattr(predicted, "NgramDrafter", lambda vocab: f"ngram{vocab}")
    monkeypatch.setattr(predicted, "run_loop", run_loop)
    monkeypatch.setattr(predicted, "edited", edited)
    monkeypatch.setattr(predicted, "PROMPTS", ["a", "bc"])
    args = types.SimpleNamespace(max_tokens=24, edits=0.3, edit_kind="mixed")
    rows = predicted.run(args)
    assert edits == [((1, 2, 3, 4), 0.3, 77, 0, "mixed"), ((1, 2, 3, 4), 0.3, 77, 1, "mixed")]
    assert calls[0][2:6] == (8, 0.0, 0, 0)  # the warm-up
    timed = [c for c in calls[1:] if c[2] == 24]
    assert len(timed) == 2 * 5 and {c[3:5] for c in timed} == {(0.0, 0)}
    assert [(c[0], c[5], c[6]) for c in timed[:5]] == [
        (None, 0, ()), (None, 0, ()), ("draft", "auto", ()), ("ngram77", "auto", ()),
        ("ngram77", "auto", (9, 0))]
    assert timed[9][6] == (9, 1) and timed[5][1] == (98, 99)
    by = {r["method"]: r for r in rows}
    assert list(by) == ["K = 0", "draft model, auto K", "ngram, auto K",
                        "ngram + prediction, auto K"]
    assert by["K = 0"]["tokens_per_s"] == 2.0 and by["K = 0"]["ratio"] == 1.0
    assert by["K = 0"]["tokens_per_round"] == 1.0
    ngram = by["ngram + prediction, auto K"]
    assert (ngram["tokens_per_s"], ngram["tokens_per_round"], ngram["ratio"]) == (4.0, 2.0, 2.0)
    assert ngram["same_tokens"] and not by["draft model, auto K"]["same_tokens"]
    assert by["draft model, auto K"]["tokens_per_s"] == 3.5  # one prompt's tokens differed


# ---------------------------------------------------------------------------- bench.model_free


def test_model_free_run_repeats_each_workload_through_each_drafter(monkeypatch):
    """model_free.run: every workload, first then repeat, through the target alone (K = 0),
    ngram, suffix (width 1) and suffix tree (width 3) at K = --k, greedy, max_tokens; each
    row's speedup is over the target alone on the same pass and workload."""
    calls, seconds = [], iter(range(1, 100))

    def run_loop(drafter, verifier, prompt, n, t, seed, k, width):
        calls.append((drafter, tuple(prompt), n, t, seed, k, width))
        out = [1, 2, 3] if drafter != "suffix64" or width == 1 else [1, 2]
        return out, float(next(seconds)), SpecStats(rounds=1, num_emitted_tokens=len(out))

    monkeypatch.setattr(model_free, "load_tokenizer", lambda name: CodePointTokenizer())
    monkeypatch.setattr(model_free, "load_causal_lm", lambda name: name)
    monkeypatch.setattr(model_free, "ModelVerifier", lambda model: types.SimpleNamespace(
        model=types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=64))))
    monkeypatch.setattr(model_free, "NgramDrafter", lambda vocab: f"ngram{vocab}")
    monkeypatch.setattr(model_free, "SuffixDrafter", lambda vocab: f"suffix{vocab}")
    monkeypatch.setattr(model_free, "run_loop", run_loop)
    rows = model_free.run(types.SimpleNamespace(max_tokens=20, k=3))
    workloads = list(model_free.WORKLOADS)
    assert [(r["pass"], r["workload"], r["method"]) for r in rows] == [
        (p, w, m) for p in ("first", "repeat") for w in workloads
        for m in ("target alone", "ngram", "suffix", "suffix tree")]
    assert [(c[0], c[5], c[6]) for c in calls[:4]] == [
        (None, 0, 1), ("ngram64", 3, 1), ("suffix64", 3, 1), ("suffix64", 3, 3)]
    assert {c[2:5] for c in calls} == {(20, 0.0, 0)}
    second = model_free.WORKLOADS[workloads[1]]
    assert calls[4][1] == tuple(CodePointTokenizer()(second)["input_ids"])
    assert calls[4 * len(workloads)][1] == calls[0][1]  # the repeat pass: the same prompts
    assert [r["speedup"] for r in rows[4:8]] == [1.0, 5 / 6, 5 / 7, 5 / 8]
    assert rows[7]["tokens_per_s"] == 2 / 8 and not rows[7]["same_tokens"]
    assert rows[6]["same_tokens"] and rows[6]["tokens_per_round"] == 3.0
    assert rows[-4]["speedup"] == 1.0


def test_model_free_row_and_shown():
    """row: tokens/s of its own tokens, the speedup in seconds over the target alone's, the
    tokens per round and acceptance from its stats; shown prints None as a dash."""
    stats = SpecStats(rounds=2, num_drafts=2, num_draft_tokens=8, num_accepted_tokens=6,
                      num_emitted_tokens=8)
    r = model_free.row("first", "w", "ngram", [1] * 8, 2.0, stats, ([1] * 8, 3.0))
    assert (r["tokens_per_s"], r["speedup"], r["tokens_per_round"]) == (4.0, 1.5, 4.0)
    assert r["acceptance_rate"] == 0.75 and r["same_tokens"] is True
    assert model_free.row("first", "w", "m", [2], 1.0, stats, ([1], 1.0))["same_tokens"] is False
    assert model_free.shown(None, ".2f") == "–" and model_free.shown(0.0, ".2f") == "0.00"

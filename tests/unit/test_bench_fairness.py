"""What the benchmarks' numbers measure: each cell's own K, requests and contexts."""

import contextlib
import types

import pytest

from bench import confidence, peer, trees
from bench.pairs import PAIRS
from bench.records import FIELDS, Tally, add_speedups, record
from bench.runners import hf_generate
from speculative.stats import SpecStats
from tests.tiny import hf_greedy, tiny_llama


@pytest.mark.parametrize("k", [2, 4])
def test_hf_assisted_drafts_the_k_of_its_cell(monkeypatch, k):
    """transformers takes the assistant's block length and confidence cut from the
    assistant's own generation_config: K passed to generate() alone left every hf_assisted
    cell at the defaults (blocks of up to 20 tokens, cut at a draft confidence of 0.4)."""
    from transformers.generation import candidate_generator

    blocks = []
    get_candidates = candidate_generator.AssistedCandidateGenerator.get_candidates

    def spy(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        blocks.append((input_ids.shape[1], candidates.shape[1] - input_ids.shape[1]))
        return candidates, logits

    monkeypatch.setattr(candidate_generator.AssistedCandidateGenerator, "get_candidates", spy)
    target, draft, prompt = tiny_llama(0), tiny_llama(1), [1, 2, 3]
    out, _ = hf_generate(target, prompt, 12, 0.0, 0, draft, k)
    assert out == hf_greedy(target, prompt, 12)
    # every block K long, but where the request's end leaves less room (no cut by confidence)
    assert blocks and all(drafted == min(k, len(prompt) + 12 - length - 1)
                          for length, drafted in blocks), blocks


def test_each_peer_cell_has_contexts_of_its_own(monkeypatch):
    """bench.peer names a cell's contexts by its row and stream count: row 1 at 32 streams
    and row 13 at 2 read "...132" alike when the two numbers ran together, and the later
    cell's requests found the earlier one's prefixes cached."""
    cells = []
    monkeypatch.setattr(peer, "tokens_per_second", lambda url, streams, max_tokens, fields,
                        context_tokens, cell: cells.append(cell) or 1.0)
    rows = {f"row {i}": {} for i in range(14)}
    peer.measure("http://x", rows, (2, 32), 96, context_tokens=400)
    assert len(cells) == 28 and len(set(cells)) == 28
    contexts = {peer.context(400, cell, 0) for cell in cells}
    assert len(contexts) == 28


def test_the_sweep_has_no_speedup_over_the_one_stream_anchor():
    """The sweep's cells run other prompts and lengths than target_only's: their ratio to
    the anchor would weigh two request sets; speedup_vs_off is theirs (same requests)."""
    anchor = record("demo", "target_only", 0, 0.0, 1, Tally(3, 144, 1.2), {"c": 0.25})
    off = record("demo", "serve_off", 0, 0.0, 4, Tally(4, 160, 1.0), {"c": 0.25})
    on = record("demo", "serve_adaptive", "auto", 0.0, 4, Tally(4, 160, 0.8), {"c": 0.25})
    batched = record("demo", "serve_sync", 4, 0.0, 4, Tally(4, 192, 0.8), {"c": 0.25})
    for rec in (off, on):
        rec["stream"] = True
    add_speedups([anchor, off, on, batched])
    assert set(on) == set(FIELDS)
    assert off["speedup"] is None and on["speedup"] is None
    assert on["speedup_vs_off"] == 1.25
    # the suite's cell of four at once runs target_only's prompts and tokens: its ratio stays
    assert batched["speedup"] == 2.0 and anchor["speedup"] == 1.0


def fake_loop(drafter, verifier, prompt, max_tokens, temperature, seed, k, *args, **kwargs):
    """64 tokens: without a draft in 17 rounds (the first alone, then 4 steps a round, as
    plain_steps asks); at K = 4, 16 rounds of 3 accepted and one more."""
    if not k:
        return list(range(64)), 0.2, SpecStats(rounds=17, num_emitted_tokens=64,
                                                plain_step_tokens=47)
    return list(range(64)), 0.1, SpecStats(rounds=16, num_drafts=16, num_draft_tokens=64,
                                            num_accepted_tokens=48, num_emitted_tokens=64)


@pytest.mark.parametrize("module", [trees, confidence])
def test_tokens_per_round_leave_out_a_plain_rounds_later_steps(monkeypatch, module):
    """trees' and confidence's tokens/round (the mean acceptance length) counted the tokens
    a round without a draft asks the verifier for after its first: the target alone read
    3.76 tokens a round, and so did every draftless round of an adaptive K or a cut."""
    monkeypatch.setattr(module, "warm_pair", lambda pair, texts: (None, None, [[1, 2]]))
    monkeypatch.setattr(module, "run_loop", fake_loop)
    shapes = [("target alone", 0, 1, None), ("chain K=4", 4, 1, None)] if module is trees \
        else [("target alone", 0, None), ("K=4", 4, None)]
    rows = module.rows_of(PAIRS["demo"], shapes, ["x"], 64, *([0.0] if module is trees else []))
    assert [r["tokens_per_round"] for r in rows] == [1.0, 4.0]
    assert [r["speedup"] for r in rows] == [1.0, 2.0]


def test_every_row_is_set_against_vllms_best_row_at_each_stream_count():
    """The ratio is the row's tokens/s over the fastest vLLM row at that stream count (a
    specserve row, however fast, is no yardstick); no vLLM row, no ratio."""
    results = {"vLLM, target alone": {1: 100.0, 4: 200.0},
               "vLLM, the demo draft at K = 4": {1: 120.0, 4: 150.0},
               "specserve, default (auto K)": {1: 240.0, 4: 100.0}}
    assert peer.table(results, [1, 4]) == [
        "| server | 1 streams | 4 streams |", "|---|---|---|",
        "| vLLM, target alone | 100 (0.83x) | 200 (1.00x) |",
        "| vLLM, the demo draft at K = 4 | 120 (1.00x) | 150 (0.75x) |",
        "| specserve, default (auto K) | 240 (2.00x) | 100 (0.50x) |"]
    alone = {"specserve, K = 4": {1: 240.0}}
    assert peer.table(alone, [1])[-1] == "| specserve, K = 4 | 240 |"


def test_a_peer_cell_times_max_8_or_2x_streams_requests_after_a_warm_up(monkeypatch):
    """At 16 streams: 16 warm-up requests of 8 tokens, then 32 timed ones, each after its own
    context of round(N / 18) lines; tokens/s over the timed requests' wall time."""
    sent = []
    monkeypatch.setattr(peer, "completion", lambda url, prompt, max_tokens, fields:
                        sent.append((prompt, max_tokens)) or max_tokens)
    clock = iter([10.0, 12.0])
    monkeypatch.setattr(peer, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    assert peer.tokens_per_second("http://x", 16, 96, {}, 180, "0][16") == 32 * 96 / 2.0
    assert sorted(n for _, n in sent) == [8] * 16 + [96] * 32
    assert len({p for p, _ in sent}) == 48
    assert all(p.count("    total -= ") == 10 for p, _ in sent)


def test_specserve_rows_name_each_default_run_after_the_first(monkeypatch):
    @contextlib.contextmanager
    def serve_run():
        yield 8000, None

    monkeypatch.setattr(peer, "fresh_serve_run", serve_run)
    monkeypatch.setattr(peer, "measure", lambda url, rows, *args: rows)
    rows = peer.run_specserve([1], 96, fixed_k=(0, 4), default_runs=2)
    assert list(rows) == ["specserve, default (auto K)", "specserve, default (auto K), run 2",
                          "specserve, K = 0", "specserve, K = 4"]
    assert rows["specserve, K = 4"] == {"num_speculative_tokens": 4}

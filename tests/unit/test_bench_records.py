"""The suite's derived figures, on hand-made tallies, and the sweep's streaming client on a
stand-in server (the end-to-end run is in integration)."""

import itertools
import json
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from bench import sweep
from bench.costs import expected_tokens_per_round
from bench.records import FIELDS, Tally, add_speedups, record
from bench.report import fmt, plotted, same_tokens
from bench.soak import report as soak_report
from bench.runners import departs_at_tie, stats_from_http
from bench.sweep import Streamed, latency_fields, percentile, stream_completion
from speculative.stats import SpecStats
from tests.tiny import hf_greedy, tiny_llama


def test_expected_tokens_per_round_is_the_geometric_formula():
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(None, 4) is None


def test_a_speculative_record_has_the_formula_and_the_measured_ratio():
    stats = SpecStats(rounds=10, num_drafts=10, num_draft_tokens=20, num_accepted_tokens=10,
                      num_emitted_tokens=20,
                      accepted_per_position=[7, 3], draft_compute_seconds=0.01,
                      verify_compute_seconds=0.05, draft_seconds=0.02, verify_seconds=0.06,
                      round_seconds=0.081, wire_bytes=2500)
    tally = Tally()
    tally.add(tokens=20, seconds=0.1, stats=stats, overhead_p50=2.0)
    tally.compare([1, 2], [1, 2])
    rec = record("demo", "serve_sync", 2, 0.0, 1, tally, {"c": 0.25})
    anchor = record("demo", "target_only", 0, 0.0, 1, Tally(1, 10, 0.1), {"c": 0.25})
    add_speedups([rec, anchor])
    assert set(rec) == set(FIELDS)
    assert rec["acceptance_rate"] == 0.5 and rec["mean_acceptance_length"] == 2.0
    assert rec["acceptance_by_position"] == [0.7, 0.3]
    assert rec["predicted_tokens_per_round"] == 1.75
    assert rec["predicted_speedup"] == pytest.approx(1.75 / 1.5, abs=1e-3)
    assert rec["speedup"] == 2.0 and anchor["speedup"] == 1.0
    assert rec["speedup_vs_predicted"] == pytest.approx(2.0 / 1.167, abs=1e-3)
    assert (rec["ms_draft"], rec["ms_verify"], rec["ms_transport"], rec["ms_router"]) == \
        pytest.approx((1.0, 5.0, 2.0, 0.1))
    assert rec["wire_bytes_per_round"] == 250 and rec["overhead_ms_p50"] == 2.0
    assert rec["greedy_matches_target"] is True and rec["sampled_matches_inprocess"] is None
    assert anchor["acceptance_rate"] is None and anchor["predicted_speedup"] is None
    # four streams at once: throughput against one stream, no one-stream formula beside it,
    # and against speculation off at the same load
    batched = record("demo", "serve_sync", 2, 0.0, 4, tally, {"c": 0.25})
    batched_off = record("demo", "serve_off", 0, 0.0, 4, Tally(4, 50, 0.1), {"c": 0.25})
    add_speedups([batched, batched_off, anchor])
    assert batched["speedup"] == 2.0 and batched["predicted_tokens_per_round"] == 1.75
    assert batched["predicted_speedup"] is None and batched["speedup_vs_predicted"] is None
    assert (batched["speedup_vs_off"], batched_off["speedup_vs_off"]) == (0.4, 1.0)
    assert rec["speedup_vs_off"] is None  # one stream: the target alone is its baseline


def test_a_departure_at_a_tie_is_counted_apart_from_mismatches():
    tied, untied = Tally(2, 4, 0.1), Tally(1, 2, 0.1)
    tied.compare([1, 2], [1, 2], lambda ids: False)
    tied.compare([1, 3], [1, 2], lambda ids: True)
    untied.compare([1, 3], [1, 2], lambda ids: False)
    rec, bad = (record("demo", "serve_sync", 2, 0.0, 1, t, {"c": 0.25}) for t in (tied, untied))
    assert (rec["greedy_matches_target"], rec["greedy_departures_at_ties"]) == (True, 1)
    assert (bad["greedy_matches_target"], bad["greedy_departures_at_ties"]) == (False, 0)


def test_a_tie_is_a_token_within_one_unit_of_rounding_of_the_top_logit():
    model, prompt = tiny_llama(5, vocab_size=16), [1, 2, 3]
    first = hf_greedy(model, prompt, 1)[0]
    partner = (first + 1) % 16
    with torch.no_grad():  # the partner's logits equal the first's everywhere: a tie
        model.lm_head.weight[partner] = model.lm_head.weight[first]
    reference = hf_greedy(model, prompt, 4)  # the lower of the two ids wins the tie
    partner = first if reference[0] == partner else partner
    with torch.no_grad():  # the least likely token after the prompt and after 2 more
        least = [int(model(input_ids=torch.tensor([prompt + reference[:i]])).logits[0, -1]
                     .argmin()) for i in (0, 2)]
    assert departs_at_tie(model, prompt, reference, [partner, *reference[1:]])
    last = least[0]  # far below the top: a mismatch
    assert not departs_at_tie(model, prompt, reference, [last, *reference[1:]])
    later = least[1]
    assert not departs_at_tie(model, prompt, reference, [*reference[:2], later, reference[3]])
    assert not departs_at_tie(model, prompt, reference, reference)


def test_percentiles_interpolate_between_order_statistics():
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.99) == pytest.approx(3.97)
    assert percentile([7.0], 0.99) == 7.0 and percentile([], 0.5) is None


def sweep_stats(num_draft_tokens: int) -> dict:
    """A response's speculative object: 4 rounds of 2 tokens, K = num_draft_tokens / 4."""
    stats = SpecStats(rounds=4, num_drafts=4 if num_draft_tokens else 0,
                      num_draft_tokens=num_draft_tokens, num_accepted_tokens=num_draft_tokens // 2,
                      num_emitted_tokens=8, round_seconds=0.04)
    return stats.as_dict() | {"mean_batch_size_verifier": 3.0,
                              "mean_batch_size_drafter": 2.0 if num_draft_tokens else None}


def test_a_sweep_cell_has_latencies_batch_sizes_and_the_ratio_to_speculation_off():
    def cell(mode, k, num_draft_tokens, seconds):
        streams = [Streamed(list(range(8)), 0.1 * (i + 1), 0.1 * (i + 1) + 0.07,
                            sweep_stats(num_draft_tokens)) for i in range(4)]
        tally = Tally()
        for s in streams:
            tally.add(len(s.token_ids), 0.0, stats_from_http(s.speculative))
        tally.seconds = seconds
        rec = record("demo", mode, k, 0.0, 4, tally, {"c": 0.25})
        rec.update(stream=True, **latency_fields(streams))
        return rec

    off, on = cell("serve_off", 0, 0, 0.5), cell("serve_adaptive", "auto", 8, 0.4)
    single = record("demo", "serve_off", 0, 0.0, 4, Tally(4, 32, 1.0), {"c": 0.25})
    add_speedups([off, on, single])
    assert set(on) == set(FIELDS) and single["stream"] is None
    assert (off["tokens_per_s"], on["tokens_per_s"]) == (64.0, 80.0)
    # the cell of four requests at once (not streamed) has its own serve_off: itself
    assert (off["speedup_vs_off"], on["speedup_vs_off"], single["speedup_vs_off"]) == \
        (1.0, 1.25, 1.0)
    assert on["ttft_ms_p50"] == 250.0  # sent -> first chunk: 100, 200, 300, 400 ms
    assert on["tpot_ms_p50"] == on["tpot_ms_p99"] == 10.0  # 70 ms over 7 tokens after the first
    assert (on["batch_mean_verifier"], on["batch_mean_drafter"]) == (3.0, 2.0)
    assert (off["batch_mean_drafter"], off["mean_k"], on["mean_k"]) == (None, 0.0, 2.0)


class SSE(BaseHTTPRequestHandler):
    """Streams what the router streams, in chunked transfer encoding (usage says the server's
    completion_tokens)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["ignore_eos"] and body["return_token_ids"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        final = {"choices": [], "usage": {"completion_tokens": self.server.completion_tokens},
                 "speculative": {"rounds": 2}}
        for chunk in ({"choices": [{"index": 0, "text": "a b", "finish_reason": None}]},
                      {"choices": [{"index": 0, "text": " c", "finish_reason": None}]},
                      {"choices": [{"index": 0, "text": "", "finish_reason": "length",
                                    "token_ids": [5, 6, 7]}]},
                      final, "[DONE]"):
            event = f"data: {chunk if chunk == '[DONE]' else json.dumps(chunk)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args):
        pass


def test_a_streamed_request_is_timed_chunk_by_chunk(monkeypatch):
    """A clock that ticks once a reading (no wall-clock threshold): read at the send, then at
    each line received, an event's data line and its blank line."""
    ticks = itertools.count()
    monkeypatch.setattr(sweep, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    server = ThreadingHTTPServer(("127.0.0.1", 0), SSE)
    server.completion_tokens = 3
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        streamed = stream_completion(url, [1, 2], 3, "auto", timeout_s=10)
        assert streamed.token_ids == [5, 6, 7] and streamed.speculative == {"rounds": 2}
        # the first chunk at the first line read, the final chunk (usage) at the seventh
        assert (streamed.first_chunk_s, streamed.final_chunk_s, streamed.tpot_s) == (1, 7, 3)
        server.completion_tokens = 4
        with pytest.raises(RuntimeError, match="disagree with its usage"):
            stream_completion(url, [1, 2], 3, 0, timeout_s=10)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("shipped", ["dense", "mass0.99-float16"])
def test_the_k_plots_draw_the_sampled_cells_with_the_shipped_q(shipped):
    def cell(mode, temperature, q, concurrency=1):
        rec = dict.fromkeys(FIELDS)
        rec.update(pair="demo", mode=mode, k=4, temperature=temperature, draft_q=q,
                   concurrency=concurrency, stream=False)
        return rec

    cells = [cell("inprocess", 0.0, None), cell("inprocess", 1.0, shipped),
             cell("serve_sync", 1.0, shipped), cell("hf_assisted", 1.0, "dense"),
             cell("serve_sync", 0.0, None, concurrency=4)]
    if shipped != "dense":
        cells.append(cell("inprocess", 1.0, "dense"))  # the comparison: tables only
    drawn = plotted({"results": cells, "pairs": {"demo": {"draft_q": shipped}}})
    assert drawn == cells[:4]


def test_a_soak_with_no_completed_request_still_reports():
    result = {"streams": 2, "seconds": 5.0, "requests": 4, "completed": 0, "cancelled": 0,
              "refused_429": 0, "errors": 4, "error_kinds": ["503"], "latency_s_p50": None,
              "latency_s_p99": None, "tokens_per_s": 0.0, "sessions_left": {},
              "rss": {"router": {"after_warmup_mb": 1.0, "max_mb": 2.0, "end_mb": 2.0}}}
    assert "p50 -, p99 -" in soak_report(result)


def test_a_served_records_tokens_per_round_leave_out_the_plain_steps():
    """A round without a draft that asked the verifier for 4 tokens is one round of one
    speculation token, as the server's own stats count it."""
    stats = SpecStats(rounds=3, num_drafts=2, num_draft_tokens=8, num_accepted_tokens=4,
                      num_emitted_tokens=13, plain_step_tokens=3, draft_fallback_rounds=1)
    back = stats_from_http(stats.as_dict())
    assert back.mean_acceptance_length == stats.mean_acceptance_length == 10 / 3
    assert back.draft_fallback_rounds == 1


def test_a_cell_leaves_a_one_token_request_out_of_tpot_and_sums_its_fallbacks():
    """TPOT needs two tokens; p99 is the 0.99 quantile; batch means skip a request without
    one; fallback rounds add up over the cell's requests."""
    streams = [Streamed([1], 0.5, 0.5, {"mean_batch_size_verifier": None,
                                        "draft_fallback_rounds": 2})]
    streams += [Streamed(list(range(11)), 0.0, 0.1 * i, {"mean_batch_size_verifier": 2.0 * i,
                                                         "draft_fallback_rounds": 3})
                for i in range(1, 11)]
    assert streams[0].tpot_s is None
    fields = latency_fields(streams)
    assert fields["tpot_ms_p50"] == 55.0 and fields["tpot_ms_p99"] == 99.1
    assert fields["batch_mean_verifier"] == 11.0 and fields["draft_fallback_rounds"] == 32
    assert sweep.mean([2.0, None, 4.0]) == 3.0 and sweep.mean([None]) is None


def test_a_sweep_cell_returns_every_prompts_result_in_prompt_order(monkeypatch):
    """Client i sends prompts i, i + clients, ...: the results come back in prompt order."""
    monkeypatch.setattr(sweep, "stream_completion", lambda url, p, max_tokens, k: p)
    results, _ = sweep.run_cell("http://x", list(range(7)), 3, 8, "auto")
    assert results == list(range(7))


def test_the_sweep_table_says_on_over_off_at_the_same_load():
    rec = dict.fromkeys(FIELDS) | {"pair": "demo", "mode": "serve_adaptive", "concurrency": 4,
                                   "requests": 8, "tokens_per_s": 80.0, "speedup": 9.0,
                                   "speedup_vs_off": 1.25}
    plan = {"concurrency": [4], "requests_per_client": 2, "max_tokens": 8}
    [row] = [line for line in sweep.section([rec], plan, fmt, same_tokens)
             if line.startswith("| demo")]
    assert row.startswith("| demo | serve_adaptive | 4 | 8 | 80.0 | 1.25x |")

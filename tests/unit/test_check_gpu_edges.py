"""Edges of `specserve check-gpu`'s verdict on hand-made reports (each flaw alone fails the run,
each bound itself passes), its exit status, the full run's dtypes, and the measures' arithmetic
(specserve.check_gpu, specserve.gpu_measures)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.memory import kv_bytes_per_token
from specserve import check_gpu, gpu_measures
from specserve.cli_args import FlagError
from tests.tiny import tiny_llama
from tests.unit.test_check_gpu import CLEAN_DEMO


def entry(dtype="float32", **changes) -> dict:
    """A shape's entry that passes; changes replace its parts."""
    clean = {"dtype": dtype, "greedy": {"tokens": 16, "identical": True},
             "sampled": {"tokens": 16, "asked": 16, "in_vocabulary": True},
             "alone_vs_batch": {"max_logit_difference": 0.0, "max_abs_logit": 40.0},
             "when_full": {"refused": True}}
    return clean | changes


def verdict(models=None, demo=None) -> bool:
    return check_gpu.passed({"models": {"m": entry()} if models is None else models,
                             **({} if demo is None else {"demo_pair": demo})})


@pytest.mark.parametrize("flaw", [
    {"sampled": {"tokens": 16, "asked": 16, "in_vocabulary": False}},
    {"when_full": {"refused": False}},
    {"alone_vs_batch": {"max_logit_difference": 2e-3, "max_abs_logit": 40.0}},
    {"greedy": {"tokens": 16, "identical": False, "first_divergence": 3,
                "logit_gap_there": 0.0, "top_logit_there": 40.0}},  # fp32: no near-tie excuse
])
def test_each_flaw_of_a_shape_alone_fails_the_run(flaw):
    assert verdict() and verdict(demo=CLEAN_DEMO)
    assert not verdict({"m": entry(**flaw)}, CLEAN_DEMO)


@pytest.mark.parametrize("flaw", [
    {"greedy": {"tokens": 32, "identical": False}},
    {"sampled": {"tokens": 31, "asked": 32, "in_vocabulary": True}},
    {"sampled": {"tokens": 32, "asked": 32, "in_vocabulary": False}},
    {"error": "RuntimeError: out of memory (x.py:1)"},
])
def test_a_flaw_of_the_demo_pair_alone_fails_the_run(flaw):
    assert not verdict(demo=CLEAN_DEMO | flaw)


def test_the_float32_batch_bound_itself_passes():
    assert verdict({"m": entry(alone_vs_batch={"max_logit_difference": 1e-3,
                                               "max_abs_logit": 40.0})})


def test_bfloat16_bounds_are_16_units_of_the_top_logit_and_a_quarter_of_its_scale():
    """At a top logit of 40 a bfloat16 unit is 0.25 (2**-7 of 32): 16 units are 4.0."""
    def diverged(gap):
        return {"tokens": 16, "identical": False, "first_divergence": 3,
                "logit_gap_there": gap, "top_logit_there": 40.0}

    assert verdict({"m": entry("bfloat16", greedy=diverged(4.0))})
    assert not verdict({"m": entry("bfloat16", greedy=diverged(4.25))})
    assert check_gpu.bf16_near_tie(diverged(0.0) | {"top_logit_there": 0.0})
    batched = {"max_logit_difference": 10.0, "max_abs_logit": 40.0}
    assert verdict({"m": entry("bfloat16", alone_vs_batch=batched)})
    assert not verdict({"m": entry("bfloat16", alone_vs_batch=batched
                                   | {"max_logit_difference": 10.5})})


@pytest.mark.parametrize("ok, code", [(True, 0), (False, 1)])
def test_the_exit_status_is_the_verdict_and_the_report_is_written(monkeypatch, tmp_path, ok,
                                                                  code):
    monkeypatch.setattr(check_gpu, "run", lambda device, small: {"ok": ok, "device": device})
    out = tmp_path / "report.json"
    args = SimpleNamespace(device="cpu", small=True, out=out)
    assert check_gpu.main(args) == code
    assert json.loads(out.read_text()) == {"ok": ok, "device": "cpu"}


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_in_a_folder_that_takes_no_files_is_refused_before_the_run(monkeypatch):
    """/proc is a folder where nothing can be made (even as root): the report's write raised
    a traceback after the whole run; it is refused first, naming --out (the CLI's exit 2)."""
    monkeypatch.setattr(check_gpu, "run", lambda device, small: pytest.fail("ran"))
    args = SimpleNamespace(device="cpu", small=True, out=Path("/proc/specserve-report.json"))
    with pytest.raises(FlagError, match="--out /proc/specserve-report.json: cannot write there"):
        check_gpu.main(args)


def test_the_full_run_checks_the_1b_shape_in_both_dtypes_and_the_8b_in_bfloat16(monkeypatch):
    ran = []

    def check_shape(shape, device, small, dtype):
        ran.append((shape.name, dtype))
        return entry(str(dtype).removeprefix("torch."))

    monkeypatch.setattr(check_gpu, "check_shape", check_shape)
    monkeypatch.setattr(check_gpu, "check_demo_pair", lambda device, small: CLEAN_DEMO)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    report = check_gpu.run("cuda", small=False)
    assert ran == [("llama-3.2-1b", torch.float32), ("llama-3.2-1b", torch.bfloat16),
                   ("llama-3.1-8b", torch.bfloat16)]
    assert list(report["models"]) == ["llama-3.2-1b float32", "llama-3.2-1b bfloat16",
                                      "llama-3.1-8b bfloat16"]
    assert report["ok"] is True and report["gpu"] == "a GPU"


def test_a_timing_is_the_median_of_its_repeats_after_a_warm_up(monkeypatch):
    clock = iter([0.0, 0.005, 1.0, 1.001, 2.0, 2.003])  # 5, 1 and 3 ms
    monkeypatch.setattr(gpu_measures.time, "perf_counter", lambda: next(clock))
    calls = []
    assert gpu_measures.timed_ms(lambda: calls.append(1), "cpu", 3) == 3.0
    assert len(calls) == 4  # the warm-up, untimed


def test_a_forward_reads_the_weights_and_every_position_of_its_context(monkeypatch):
    """K + 1 new tokens over a context of `length`: length + K + 1 positions' keys and
    values a request, besides the weights once."""
    model = tiny_llama(0)
    runner = check_gpu.serving_runner(model, "paged", "auto", kv_cache_tokens=512,
                                      max_sequences=8)
    monkeypatch.setattr(gpu_measures, "copy_bandwidth", lambda device: 1e3)  # 1 byte a ms
    monkeypatch.setattr(gpu_measures, "timed_ms", lambda work, device, repeats: 1.0)
    times = gpu_measures.forward_times(runner, [2], 16, [4], 1)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for k in (0, 4):
        moved = weights + 2 * (16 + k + 1) * kv_bytes_per_token(model)
        assert times[f"batch 2 x K {k}"] == {"ms": 1.0, "gb_read": round(moved / 1e9, 3),
                                             "floor_ms": moved}

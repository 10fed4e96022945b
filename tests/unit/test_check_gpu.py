"""`specserve check-gpu --device cpu --small`: the GPU acceptance run's checks, on a CPU."""

import pytest

from engine import paged
from specserve import check_gpu

# one worker runs the module: spread over both, each built its report (5 CPU s)
pytestmark = pytest.mark.xdist_group("tests/unit/test_check_gpu.py")


@pytest.fixture(scope="module")
def report():
    return check_gpu.run("cpu", small=True)


def test_the_small_run_passes_and_reports_every_measure(report):
    assert report["ok"] is True
    assert set(report["models"]) == {"small-1b-like float32", "small-8b-like float32"}
    for entry in report["models"].values():
        assert entry["greedy"]["identical"] is True
        assert entry["sampled"]["tokens"] == 16
        assert entry["alone_vs_batch"]["argmax_flips"] == 0
        assert entry["alone_vs_batch"]["groups"] == 2  # the batch beside a prompt's prefill
        times = dict(entry["forward_ms"])
        assert times.pop("bandwidth_gb_s") > 0
        assert set(times) == {f"batch {b} x K {k}" for b in (1, 8, 32) for k in (0, 4, 8)}
        assert all(t["ms"] > 0 and 0 < t["floor_ms"] and t["gb_read"] > 0
                   for t in times.values())
        assert entry["attention"] == "paged"
        assert entry["when_full"]["refused"] is True
    demo = report["demo_pair"]
    assert demo["greedy"] == {"tokens": 32, "identical": True}
    assert demo["sampled"]["tokens"] == 32 and demo["sampled"]["in_vocabulary"]
    assert set(demo["tokens_per_s"]) == {"K=0", "K=4"}


# a demo pair's entry that passes: the runs below check the shapes' entries, and each real
# demo run took about 0.9 CPU s (the module's report runs the real one)
CLEAN_DEMO = {"greedy": {"tokens": 32, "identical": True},
              "sampled": {"tokens": 32, "asked": 32, "in_vocabulary": True}}


def test_the_run_fails_an_engine_whose_batch_leaks(monkeypatch):
    """Mutant: the paged forward without its masks (queries see later and foreign keys). The
    demo pair's entry passes, so the shape's own checks must fail the run."""
    plan_init = paged.PagedPlan.__init__

    def unmasked(self, *args):
        plan_init(self, *args)
        self.masks = dict.fromkeys(self.masks)

    monkeypatch.setattr(paged.PagedPlan, "__init__", unmasked)
    monkeypatch.setattr(check_gpu, "SMALL", check_gpu.SMALL[:1])
    monkeypatch.setattr(check_gpu, "check_demo_pair", lambda device, small: CLEAN_DEMO)
    assert check_gpu.run("cpu", small=True)["ok"] is False


def test_a_check_that_raises_fails_the_run_and_keeps_the_others(monkeypatch):
    """A check's exception is reported in its entry (the other shapes still run)."""
    check_shape = check_gpu.check_shape

    def broken_second(shape, *args):
        if shape == check_gpu.SMALL[1]:
            raise RuntimeError("No available kernel. Aborting execution.")
        return check_shape(shape, *args)

    monkeypatch.setattr(check_gpu, "check_shape", broken_second)
    monkeypatch.setattr(check_gpu, "check_demo_pair", lambda device, small: CLEAN_DEMO)
    report = check_gpu.run("cpu", small=True)
    assert report["ok"] is False
    assert report["models"]["small-1b-like float32"]["greedy"]["identical"] is True
    assert report["models"]["small-8b-like float32"]["error"].startswith(
        "RuntimeError: No available kernel")


def test_a_bfloat16_batch_that_leaks_fails_the_run(monkeypatch, report):
    """Mutant (the masks dropped) in bfloat16, at the 8B-like shape: before, no bfloat16
    measurement was gated (the mutant moves a logit by about 1.5x the logits' scale, a clean
    batch by under 1 %)."""
    import torch

    shape = check_gpu.SMALL[1]
    runner = check_gpu.serving_runner(check_gpu.build(shape, torch.bfloat16, "cpu"), "paged",
                                      "auto", kv_cache_tokens=34 * 48 + 64, max_sequences=64)

    def entry():
        batched = check_gpu.alone_vs_batch(runner, 32, 32)
        return dict(report["models"]["small-8b-like float32"], dtype="bfloat16",
                    alone_vs_batch=batched)

    assert check_gpu.passed({"models": {"clean": entry()}})
    plan_init = paged.PagedPlan.__init__

    def unmasked(self, *args):
        plan_init(self, *args)
        self.masks = dict.fromkeys(self.masks)

    monkeypatch.setattr(paged.PagedPlan, "__init__", unmasked)
    assert not check_gpu.passed({"models": {"leaky": entry()}})


def test_a_short_sampled_run_fails(report):
    entry = dict(report["models"]["small-1b-like float32"])
    entry["sampled"] = dict(entry["sampled"], tokens=0)
    assert not check_gpu.passed({"models": {"short": entry}})


def test_bfloat16_greedy_divergence_only_at_a_near_tie():
    assert check_gpu.bf16_near_tie({"identical": False, "logit_gap_there": 0.25,
                                    "top_logit_there": 40.0})  # one unit (measured, 8B)
    assert not check_gpu.bf16_near_tie({"identical": False, "logit_gap_there": 5.0,
                                        "top_logit_there": 40.0})


def test_greedy_identity_masks_the_end_tokens_as_generate_does():
    """generate's min_new_tokens masks the end token at every position: a model whose greedy
    choice is its end token diverged from the loop, which kept choosing it."""
    from tests.tiny import hf_greedy, tiny_llama

    model = tiny_llama(0)
    model.generation_config.eos_token_id = hf_greedy(model, [1, 2, 3], 1)[0]  # its first pick
    runner = check_gpu.serving_runner(model, "paged", "auto", kv_cache_tokens=256,
                                      max_sequences=8)
    assert check_gpu.greedy_identity(runner, [1, 2, 3], 8, 2) == {"tokens": 8, "identical": True}

import gc
import json
import os

import pytest

# Every Ray instance the tests start (the shared one, `bench`'s, `serve run`'s, the placement
# cluster's: they inherit this process's environment) starts its workers when an actor or
# task needs one, not one a logical CPU at the first driver's connection: Serve's actors never
# used them. A Ray start with cluster/config.yaml's three apps took 30-31 CPU s instead of
# 34-35 (measured twice each, Intel Xeon without AVX-512 BF16).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")


def pytest_configure(config):
    """One torch thread in every process that runs tests (tiny models gain nothing from
    threads, and two test workers must not fight over cores), and hypothesis seeded. The
    xdist controller runs none, so it imports neither torch nor the models: this file is
    imported before the workers start, and its imports held them back by about 6 s
    (measured, AVX-512)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import torch
    from hypothesis import settings

    torch.set_num_threads(1)
    # property tests draw the same examples every run (seeded by the test), none replayed
    # from a local database: a run does not depend on the runs before it
    settings.register_profile("seeded", derandomize=True, database=None)
    settings.load_profile("seeded")


def pytest_collection_finish(session):
    """The garbage collector skips what collection built (the modules it imported: some
    hundreds of thousands of objects, alive until the worker ends) and runs its youngest
    generation 14 times less often. Each full collection walked them all, about 230 ms
    apiece: over tests/stats on two workers the collector took 31 of their 257 CPU s, and
    1.5 with this (measured back to back, AVX-512; the files' wall time 153 -> 125 s). A
    test's allocations are freed by reference counting; its reference cycles are still
    collected, later."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """xdist groups: the tests that use the shared Ray cluster run on one worker, in file
    order (one deployment, started once); every other integration module runs whole on one
    worker (its module fixture, such as `bench --quick` or a three-node cluster, runs once);
    everything else spreads over the workers beside them (a unit module whose module fixture
    is dear groups itself with its pytestmark)."""
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("cluster"))
        elif "integration" in item.nodeid.split("::")[0]:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


TEXT = ["def add(a, b):\n    return a + b\n", "class Point:\n    x = 0\n    y = 1\n"] * 20


def save_pair(root, target, draft, tokenizer):
    """Save a pair like hub models: root/target and root/draft, each with the tokenizer."""
    for name, model in (("target", target), ("draft", draft)):
        model.config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory):
    """A tiny random target and draft with a real (tiny) tokenizer, saved like hub models."""
    from specserve.demo import train_tokenizer
    from tests.tiny import noisy_copy, tiny_llama

    root = tmp_path_factory.mktemp("tiny_pair")
    tokenizer = train_tokenizer(TEXT, vocab_size=300)
    target = tiny_llama(3, vocab_size=len(tokenizer))
    draft = noisy_copy(target, 0.05, seed=4)
    return save_pair(root, target, draft, tokenizer)


@pytest.fixture(scope="session")
def quirky_pair_dir(tmp_path_factory):
    """A pair with the properties of real checkpoints the demo pair lacks, built from configs:
    - Llama-3.1-Instruct-like end tokens: generation_config lists three, one of which the
      target emits early for QUIRKY_PROMPT (its index in the output: `report["end_at"]`);
    - Qwen2.5-like padded vocabularies: a tokenizer of < 300 tokens, target 320 rows, draft 310;
    - Mistral-like sliding-window attention (window 16), in both target and draft.
    """
    from specserve.demo import train_tokenizer
    from tests.tiny import hf_greedy, noisy_copy, tiny_sliding

    root = tmp_path_factory.mktemp("quirky_pair")
    tokenizer = train_tokenizer(TEXT, vocab_size=300)
    target = tiny_sliding(11, window=16, vocab_size=320)
    draft = noisy_copy(target, 0.01, seed=12)
    draft.resize_token_embeddings(310)
    prompt = tokenizer(QUIRKY_PROMPT, add_special_tokens=False)["input_ids"]
    out = hf_greedy(target, prompt, 40)
    end_at = next(i for i in range(4, 40) if out[i] not in out[:i] and out[i] < len(tokenizer))
    unused = [t for t in range(1, len(tokenizer)) if t not in out][:2]
    target.generation_config.eos_token_id = [unused[0], out[end_at], unused[1]]
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "report.json").write_text(json.dumps({"end_at": end_at, "greedy": out}))
    return root


QUIRKY_PROMPT = "def add("

"""What `specserve check-gpu` measures on a runner (engine.runner): timings on the device,
a request alone against the same request in a batch, forward times against the bandwidth
floor, and a full KV pool's refusal."""

import time

import torch

from engine.cache import KVCacheFull
from engine.kv import SessionStore
from engine.memory import kv_bytes_per_token
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.types import PrefixSync


def sync_device(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(work, device, repeats: int) -> float:
    """The median of `repeats` timings of work(), in milliseconds, after one warm-up."""
    work()
    times = []
    for _ in range(repeats):
        sync_device(device)
        started = time.perf_counter()
        work()
        sync_device(device)
        times.append(time.perf_counter() - started)
    return round(sorted(times)[len(times) // 2] * 1e3, 3)


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (count, length), generator=generator).tolist()


def prefill(runner, store: SessionStore, request_id: str, prompt: list[int]):
    sequence = store.apply(request_id, PrefixSync(0, EMPTY_PREFIX_HASH, tuple(prompt)))
    runner.forward([sequence.segment(runner, [], 1)])
    return sequence


def alone_vs_batch(runner, batch: int, length: int) -> dict:
    """Request 0's logits over K + 1 = 5 new tokens, alone and beside batch - 1 others,
    each longer than it by i tokens (its keys padded in the batch's layout), and a new
    prompt of `length` tokens, whose prefill puts the batch in two layouts
    (engine.attention.feed_groups: `groups`)."""
    from engine.attention import feed_groups

    store = SessionStore(2 * batch + 3)
    vocab = runner.model.config.vocab_size
    texts = [text[:length - batch + 1 + i] for i, text in
             enumerate(prompts(batch, length, vocab, seed=1))]
    draft = [3, 1, 4, 1]
    alone = prefill(runner, store, "alone", texts[0])
    single = runner.forward([alone.segment(runner, draft, 5)])[0].float()
    sequences = [prefill(runner, store, f"b{i}", text) for i, text in enumerate(texts)]
    fresh = store.apply("prompt", PrefixSync(0, EMPTY_PREFIX_HASH,
                                             tuple(prompts(1, length, vocab, seed=2)[0])))
    segments = [s.segment(runner, draft, 5) for s in sequences] + \
        [fresh.segment(runner, [], 1)]
    groups = feed_groups(segments)
    together = runner.forward(segments)[0].float()
    store.clear()
    return {"batch": batch, "groups": 1 if groups is None else len(groups),
            "max_logit_difference": float((single - together).abs().max()),
            "max_abs_logit": float(single.abs().max()),
            "argmax_flips": int((single.argmax(-1) != together.argmax(-1)).sum())}


def forward_times(runner, batches: list[int], length: int, ks: list[int], repeats: int) -> dict:
    """Verify forward (K + 1 new tokens per request) and a 1-token step, per batch size, and
    each one's floor: the bytes it reads (weights, keys and values) over the device's
    measured bandwidth."""
    model, times = runner.model, {}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(model.device)
    times["bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    for batch in batches:
        store = SessionStore(batch + 1)
        sequences = [prefill(runner, store, f"t{i}", text) for i, text in
                     enumerate(prompts(batch, length, model.config.vocab_size, seed=2))]
        for k in [0, *ks]:
            work = lambda: runner.forward([s.segment(runner, [5] * k, k + 1)  # noqa: E731
                                           for s in sequences])
            moved = weights + batch * (length + k + 1) * kv_bytes_per_token(model)
            times[f"batch {batch} x K {k}"] = {
                "ms": timed_ms(work, model.device, repeats), "gb_read": round(moved / 1e9, 3),
                "floor_ms": round(1e3 * moved / bandwidth, 3)}
        store.clear()
    return times


def copy_bandwidth(device) -> float:
    """Bytes per second a device-to-device copy of 512 MiB reads (it writes as many)."""
    source = torch.empty(128 << 20, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    return source.numel() * 4 * 2 / (timed_ms(lambda: target.copy_(source), device, 5) / 1e3)


def full_pool(runner) -> dict:
    """Feed one request until the KV pool refuses: the refusal must be a KVCacheFull."""
    capacity = runner.pool.max_tokens
    store = SessionStore(4)
    sequence = store.apply("full", PrefixSync(0, EMPTY_PREFIX_HASH, (1,)))
    try:
        runner.forward([sequence.segment(runner, [2] * capacity, 1)])
    except KVCacheFull as error:
        return {"capacity_tokens": capacity, "refused": True, "message": str(error)}
    finally:
        store.clear()
    return {"capacity_tokens": capacity, "refused": False}

"""engine.graphs on a CPU: the bucketed forward that a GPU records as CUDA graphs, run eagerly
(capture=False), against fresh forwards of each request's own tokens. Where CUDA is there
(`pytest tests/unit/test_graphs.py` on a GPU machine), the `cuda` cases run the same checks
with the graphs recorded and replayed, and captures that really fail.

The bugs to catch: padding (rows, tokens, keys) leaking into a request's logits, a padding
write landing in the zero block or in a request's own blocks, a rolled-back cache whose
later blocks overflow its bucket's table, and a sliding window lost in the device's masks.
"""

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import graphs
from engine.batch import Segment
from engine.graphs import MAX_NEW, MAX_ROWS, MAX_SLOTS, GraphedForward, bucket_of, \
    graphs_refused, key_bucket
from engine.kv import SessionStore
from engine.runner import serving_runner
from tests.unit.test_batch import ATOL, MODELS, batched_rounds_error, full_logits, served, sync


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="a real capture: CUDA only")


def bucketed(name: str, block_size: int = 16, device: str = "cpu"):
    """The named tiny model's paged runner with its bucketed forward: run eagerly on a CPU,
    recorded and replayed on CUDA (as a pool there)."""
    runner = serving_runner(MODELS[name]().to(device), "paged", "paged", kv_cache_tokens=4096,
                            block_size=block_size)
    if device == "cpu":
        runner.graphs = GraphedForward(runner.lean, capture=False)
    assert runner.graphs.capture == (device != "cpu")
    return runner


def zero_block_is_zero(runner) -> bool:
    pool, size = runner.pool, runner.pool.block_size
    return not pool.keys[:, :size].any() and not pool.values[:, :size].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_the_bucketed_forward_equals_each_request_alone(name, device):
    """Four requests of 1-4 drafts each (tokens padded to the longest), the sliding-window
    models' keys past their window; the prompts' forwards are too long for a bucket."""
    runner = bucketed(name, device=device)
    assert batched_rounds_error(runner) < ATOL
    assert runner.graphs.recorded, "no round ran bucketed"
    assert zero_block_is_zero(runner)


def verify_rounds(runner, store, prompts, rounds) -> float:
    """Each request's prompt alone, then rounds of one committed token and its drafts (rounds
    [round][request]), each round one forward; the largest gap to a fresh forward."""
    for i, prompt in enumerate(prompts):
        runner.forward([store.apply(f"r{i}", sync([], prompt)).segment(runner, [], 1)])
    known, worst = [list(p) for p in prompts], 0.0
    for drafts in rounds:
        segments, wanted = [], []
        for i, drafted in enumerate(drafts):
            committed = known[i] + [11 + i]
            sequence = store.apply(f"r{i}", sync(known[i], committed[len(known[i]):]))
            known[i] = committed
            segments.append(sequence.segment(runner, drafted, len(drafted) + 1))
            wanted.append(committed + drafted)
        for got, ids, segment in zip(runner.forward(segments), wanted, segments):
            expected = full_logits(runner.model, ids)[-segment.num_logits:]
            worst = max(worst, float((got - expected).abs().max()))
    return worst


@pytest.mark.parametrize("device", DEVICES)
def test_padding_rows_and_a_rolled_back_cache_keep_every_request_exact(device):
    """Three requests (a fourth row of padding); one of them holds 17 blocks after a 9-token
    verify, then rolls back to 251 positions: its bucket's table has room for 16."""
    runner, store = bucketed("llama", device=device), SessionStore(8)
    prompts = [[(5 * i) % 60 + 1 for i in range(250)], [3, 1, 4], [2, 7, 1, 8]]
    rounds = [[[7] * 8, [5], [6, 6]],  # r0: 9 new tokens, its cache to 259 positions
              [[9], [4, 4, 4], []]]  # r0 rolled back to 251 positions: 2 new tokens
    assert verify_rounds(runner, store, prompts, rounds) < ATOL
    assert len(store.get("r0").cache.units) == 17
    # the short prompts ran alone; then rows of 9 new tokens over 259 keys, 4 over 253
    assert set(runner.graphs.recorded) == {(1, 3, 256), (1, 4, 256), (4, 9, 512), (4, 4, 256)}
    assert zero_block_is_zero(runner)
    assert runner.graphs.scratch not in runner.pool._free and \
        runner.pool.refs[runner.graphs.scratch] == 1  # never handed out


@pytest.mark.parametrize("device", DEVICES)
def test_a_full_bucket_returns_each_request_its_own_logits(device):
    """Two requests of three drafts each: every row and token of the bucket is wanted."""
    runner = bucketed("mistral-sliding", device=device)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]]
    rounds = [[[1, 2, 3], [4, 5, 6]], [[7, 7, 7], [8, 8, 8]]]
    assert verify_rounds(runner, SessionStore(4), prompts, rounds) < ATOL
    assert (2, 4, 256) in runner.graphs.recorded


@pytest.mark.parametrize("device", DEVICES)
def test_an_eager_batch_past_the_graphs_buffers_grows_its_own_and_voids_no_graph(device):
    """A replay reaches the gather buffers by address: an eager batch longer than they hold
    grows buffers of its own (by a quarter at least), and every bucket stays recorded."""
    runner, prompts, rounds = bucketed("llama", device=device), [[3, 1, 4], [2, 7, 1, 8]], \
        [[[1], [2, 2]]]
    assert verify_rounds(runner, SessionStore(4), prompts, rounds) < ATOL
    first, attention = runner.graphs.recorded[(2, 3, 256)], runner.lean.attention
    assert attention.buffers(MAX_SLOTS) is runner.graphs.gathered  # lent where they suffice
    grown = attention.buffers(MAX_SLOTS + 1)  # as a long eager batch would
    assert grown is not runner.graphs.gathered
    assert attention.buffers(MAX_SLOTS + 2) is grown  # a token longer: the same
    assert attention.buffers(MAX_SLOTS * 5 // 4 + 2)[0].shape[0] >= (MAX_SLOTS + 1) * 5 // 4
    assert verify_rounds(runner, SessionStore(4), prompts, rounds) < ATOL
    assert runner.graphs.recorded[(2, 3, 256)] is first and all(
        a is b for a, b in zip(runner.graphs.gathered, attention.fixed))


def test_a_bucket_pads_a_rows_keys_by_less_than_256_or_at_most_a_quarter():
    assert [key_bucket(k, 16) for k in (1, 256, 257, 2048, 2049, 2053, 4097, 8192)] == \
        [256, 256, 512, 2048, 2560, 2560, 5120, 8192]
    assert all(k <= key_bucket(k, 16) <= max(k + 255, 1.25 * k) and key_bucket(k, 16) % 16 == 0
               for k in range(1, 9000))


@pytest.mark.parametrize("device", DEVICES)
def test_a_block_size_that_does_not_divide_256_keeps_whole_blocks_in_a_bucket(device):
    runner = bucketed("llama", block_size=48, device=device)
    prompts = [[(5 * i) % 60 + 1 for i in range(250)], [3, 1, 4]]
    assert verify_rounds(runner, SessionStore(4), prompts, [[[7] * 8, [5]], [[9], [4]]]) < ATOL
    assert {keys % 48 for _, _, keys in runner.graphs.recorded} == {0}


@pytest.mark.parametrize("error", ["host-sync", "out-of-memory"])
def test_a_failed_capture_leaves_its_batch_and_bucket_to_the_eager_forward(monkeypatch, error):
    """What a GPU does when a bucket cannot be recorded: the batch still gets its logits, and
    the bucket is never tried again; after a failure other than for memory (a host sync),
    no bucket not yet recorded is tried either, and those recorded keep replaying. The
    first bucket's capture succeeds (a stand-in graph that runs the bucket's work)."""
    runner = bucketed("llama")
    tries, replays = [], []

    class Replayed:
        def __init__(self, recorded, output):
            self.recorded, self.output = recorded, output

        def replay(self):
            replays.append(self.recorded.bucket)
            self.output.copy_(self.recorded.work())

    def record(self, output):
        tries.append((self.bucket.rows, self.bucket.new, self.bucket.keys))
        if len(tries) == 1:
            return Replayed(self, output)
        if error == "out-of-memory":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (graph pool)")
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.Recorded, "record", record)
    runner.graphs.capture = True
    prompts = [[3, 1, 4], [2, 7, 1, 8], [5, 9, 2]]  # alone: buckets (1, 3), (1, 4), (1, 3)
    rounds = [[[1], [2, 2], [3]], [[5, 5, 5, 5], [6], [7]]]
    assert verify_rounds(runner, SessionStore(4), prompts, rounds) < ATOL
    assert set(runner.graphs.recorded) == {(1, 3, 256)} and len(replays) == 2
    if error == "out-of-memory":  # each bucket tried once, then eager
        assert len(tries) == len(set(tries)) == len(runner.graphs.eager) + 1 > 3
    else:  # the first failure ends the recording
        assert tries == [(1, 3, 256), (1, 4, 256)]


@ON_CUDA
@pytest.mark.parametrize("error", ["host-sync", "out-of-memory"])
def test_a_capture_that_really_fails_leaves_its_batch_to_the_eager_forward(monkeypatch, error):
    """The same with real captures: the bucket of 4 new tokens reads a logit back to the host
    inside its capture (CUDA invalidates the capture) or asks for 32 TiB there (torch's
    OutOfMemoryError). Every batch still gets its logits, then again from the graphs that
    were recorded, and the thread is back on its own stream."""
    work = graphs.Recorded.work

    def failing(self):
        logits = work(self)
        if torch.cuda.is_current_stream_capturing() and self.bucket.new == 4:
            if error == "host-sync":
                float(logits.sum())
            else:
                torch.empty(1 << 45, dtype=torch.uint8, device=logits.device)
        return logits

    monkeypatch.setattr(graphs.Recorded, "work", failing)
    runner, stream = bucketed("llama", device="cuda"), torch.cuda.current_stream()
    prompts = [[3, 1, 4], [2, 7, 1, 8], [5, 9, 2]]  # alone: buckets (1, 3), (1, 4), (1, 3)
    rounds = [[[1], [2, 2], [3]], [[5, 5, 5, 5], [6], [7]]]  # (4, 3), then (4, 5)
    for _ in range(2):  # the second time from the graphs the first recorded
        assert verify_rounds(runner, SessionStore(4), prompts, rounds) < ATOL
    assert torch.cuda.current_stream() == stream
    assert runner.graphs.eager == {(1, 4, 256)}
    assert runner.graphs.failed == (error == "host-sync")  # a host sync: no more recording
    assert set(runner.graphs.recorded) == ({(1, 3, 256)} if error == "host-sync" else
                                           {(1, 3, 256), (4, 3, 256), (4, 5, 256)})


def test_a_capture_that_fails_at_its_end_restores_the_threads_stream(monkeypatch):
    """torch.cuda.graph restores the stream only after a clean end: recorded() puts it back
    (CUDA's calls stood in for, on a CPU); the capture runs on a stream of the graph's own
    device."""
    calls = []

    class Capture:
        def __init__(self, graph, pool, stream, capture_error_mode):
            self.stream = stream

        def __enter__(self):
            calls.append(f"capture stream on {self.stream.device}")

        def __exit__(self, *failure):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: type(
        "Side", (), {"wait_stream": lambda self, other: None, "device": device})())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: type(
        "Main", (), {"wait_stream": lambda self, other: None})())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: calls.append(type(stream)))
    monkeypatch.setattr(graphs, "CAPTURE_STREAMS", {})
    with pytest.raises(RuntimeError, match="capturing"):
        graphs.recorded(lambda: None, "cuda:1")
    # captured on a stream of the pool's device (torch's default capture stream is made on
    # the device current when first asked for: cuda:0), the same for every graph of it
    assert calls[0] == "capture stream on cuda:1" and calls[1].__name__ == "Main"
    assert graphs.capture_stream("cuda:1") is graphs.capture_stream(torch.device("cuda:1"))
    assert graphs.capture_stream("cuda:0") is not graphs.capture_stream("cuda:1")


def test_rotary_embeddings_that_update_on_the_host_are_never_recorded():
    assert graphs_refused(served("llama", "paged").lean) is None
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                          "rope_theta": 10_000.0})
    dynamic = serving_runner(LlamaForCausalLM(config).eval(), "paged", "paged",
                             kv_cache_tokens=4096)
    assert "dynamic" in graphs_refused(dynamic.lean)


def test_the_scratch_block_is_out_of_the_pools_capacity():
    runner = served("llama", "paged")
    before = runner.pool.max_tokens
    GraphedForward(runner.lean, capture=False)
    assert runner.pool.max_tokens == before - runner.pool.block_size


@pytest.mark.parametrize("device", DEVICES)
def test_the_zero_block_check_catches_padding_written_into_block_0(device):
    """The mutant: padding's keys and values into block 0 instead of a scratch block."""
    runner = bucketed("llama", device=device)
    runner.graphs.scratch = 0
    verify_rounds(runner, SessionStore(4), [[3, 1, 4], [2, 7, 1, 8], [5, 5]], [[[1], [2], []]])
    assert not zero_block_is_zero(runner)


def test_batches_outside_every_bucket_run_eager():
    def segments(count, new, start=0, parents=None):
        return [Segment(None, [1] * new, start, 1, parents) for _ in range(count)]

    assert bucket_of(segments(3, 2, start=100), 16).__dict__ == {"rows": 4, "new": 2,
                                                                 "keys": 256}
    assert bucket_of(segments(MAX_ROWS, MAX_NEW, start=1000), 16).rows == MAX_ROWS
    assert bucket_of(segments(MAX_ROWS + 1, 1), 16) is None
    assert bucket_of(segments(1, MAX_NEW + 1), 16) is None
    assert bucket_of(segments(1, 3, parents=(-1, 0)), 16) is None  # a draft tree
    assert bucket_of(segments(1, 1, start=9000), 16) is None
    assert bucket_of(segments(32, 1, start=5000), 16) is None  # 6144 keys a row
    assert bucket_of(segments(32, 1, start=4000), 16).keys == 4096
    assert bucket_of(segments(32, 1, start=4000), 16, slots=65_536) is None  # over the buffers


def test_cudnns_attention_is_kept_out_on_cuda_only():
    """Its plans are per shape (keys' length included): eager batches would build one per
    forward (engine.runner.keep_attention_kernels)."""
    from engine.runner import keep_attention_kernels

    before = torch.backends.cuda.cudnn_sdp_enabled()  # off where a CUDA runner was made
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        keep_attention_kernels(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        keep_attention_kernels(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_every_lean_runner_keeps_its_devices_attention_kernels(monkeypatch):
    from engine import runner as module

    devices = []
    monkeypatch.setattr(module, "keep_attention_kernels", devices.append)
    bucketed("llama")
    assert [device.type for device in devices] == ["cpu"]


def test_a_runner_off_a_gpu_records_no_graphs():
    assert served("llama", "paged").graphs is None


@pytest.mark.parametrize("backend", ["paged", "regions", "bucketed"])
def test_a_forward_off_the_cpu_mixes_no_host_tensor_into_device_work(backend):
    """The lean forward of a model on a device that is not the CPU ('meta': shapes only, no
    GPU needed), which refuses a host tensor mixed into its ops as CUDA does: every tensor a
    plan builds on the host (positions, slots, masks, gather index, the bucket's inputs)
    must reach the model's device. Prefills, a batch laid out in two groups, a sliding
    window, verify steps (on a GPU: eager, grouped, and the buckets CUDA graphs record)."""
    engine = "regions" if backend == "regions" else "paged"
    runner = serving_runner(MODELS["mistral-sliding"]().to("meta"), "paged", engine,
                            kv_cache_tokens=2048, cuda_graphs=False)
    if backend == "bucketed":
        runner.graphs = GraphedForward(runner.lean, capture=False)
    store = SessionStore(8)
    sequences = [store.apply(f"r{i}", sync([], list(range(1, 4 + 7 * i)))) for i in range(3)]
    runner.forward([s.segment(runner, [], 1) for s in sequences])
    long = store.apply("long", sync([], list(range(1, 60))))
    for segments in ([s.segment(runner, [3, 4], 3) for s in sequences] +
                     [long.segment(runner, [], 1)],  # two groups (feed_groups)
                     [s.segment(runner, [5], 2) for s in sequences]):
        logits = runner.forward(segments)
        assert [x.device.type for x in logits] == ["meta"] * len(segments)
    assert backend != "bucketed" or runner.graphs.recorded

"""CUDA graphs of the lean forward over the paged backend, one per batch bucket (GPU only).

A GPU forward of a small batch is bound by its kernel launches, not by the device: on an H200
a Llama-3.2-1B-shaped bfloat16 step launched kernel by kernel took 7-14 ms, the same device
work recorded as a CUDA graph and replayed 2.0 ms (`bench.graphs`, docs/engine.md).
`GraphedForward` records `LeanForward.run` once per bucket and replays it:

- a bucket is (rows, new tokens per row, keys per row): the batch's rows padded to a power of
  two up to `MAX_ROWS`, each row's new tokens to the batch's longest (at most `MAX_NEW`: a
  verify of K <= 8 drafts, a draft step), its keys up to `key_bucket`'s (multiples of
  `MIN_KEYS`, a quarter of a doubling apart past 2048);
- per forward the host writes a few small inputs into the bucket's static buffer in one copy
  (each row's token ids, start, length and block table), and the device derives the rest
  inside the graph: positions, write slots, the gather index and the masks, as
  engine.paged's plan and engine.attention's masks do on the host;
- padding writes its keys and values into a scratch block of its own (block 0 stays the
  zeros that masked keys read) and its outputs are dropped; a padding row sees only its own
  key, so no row is fully masked.

A batch outside every bucket (a prefill chunk, a draft tree, more rows, a longer context)
runs eager, as does everything off a GPU, a bucket whose capture failed, and a model whose
rotary embedding updates on the host (`graphs_refused`). Each bucket's graph is recorded at
its first batch, after warm-ups on a side stream (CUDA's rule); all graphs share one memory
pool, one output buffer and the backend's gather buffers. `capture=False` runs the same
bucketed forward eagerly: the suite checks it against fresh forwards on a CPU.
"""

import logging
from dataclasses import dataclass

import torch

from engine.attention import Queries, longs
from engine.paged import reserve

MAX_ROWS = 64  # cluster/gpu.yaml's max_batch_size
MAX_NEW = 9
MIN_KEYS = 256
MAX_KEYS = 8192
MAX_SLOTS = 131_072  # rows x keys the gather buffers hold at least (64 x 2048, 16 x 8192)

logger = logging.getLogger(__name__)


@dataclass
class Bucket:
    rows: int
    new: int
    keys: int


def bucket_of(segments, block_size: int, slots: int = MAX_SLOTS) -> Bucket | None:
    """The bucket a batch fits with `slots` rows x keys of gather buffer, or None (module
    doc)."""
    new = max(len(s.token_ids) for s in segments)
    keys = max(s.start + len(s.token_ids) for s in segments)
    if len(segments) > MAX_ROWS or new > MAX_NEW or keys > MAX_KEYS or \
            any(s.parents for s in segments):
        return None
    bucket = Bucket(1 << (len(segments) - 1).bit_length(), new, key_bucket(keys, block_size))
    return bucket if bucket.rows * bucket.keys <= slots else None


def key_bucket(keys: int, block_size: int) -> int:
    """Keys rounded up to a multiple of MIN_KEYS, four buckets per doubling past 2048
    (2560, 3072, ...): a bucket pads a row's keys by less than MIN_KEYS or by at most a
    quarter. Every padded key is gathered and attended: powers of two made a 32 x 5 verify
    over 2,052 keys gather 4,096 a row, and an 8B-shaped step slower than eager (23.1
    against 20.5 ms on an H200)."""
    step = max(MIN_KEYS, (1 << (keys - 1).bit_length()) // 8)
    step = -(-step // block_size) * block_size  # whole blocks: the table's width
    return -(-keys // step) * step


class DevicePlan:
    """A bucket's plan for engine.paged's attention, derived on the device from its static
    inputs (every tensor here is the device's and stays put between replays)."""

    def __init__(self, bucket: Bucket, inputs: torch.Tensor, gathered, windows: set,
                 group: int, block_size: int, scratch: int) -> None:
        rows, new, keys = bucket.rows, bucket.new, bucket.keys
        width = keys // block_size
        device = inputs.device
        ids, starts, lengths, tables, _ = inputs.split([rows * new, rows, rows, rows * width,
                                                        rows * new])  # last: Recorded's
        self.ids, tables = ids, tables.view(rows, width)
        step = torch.arange(new, device=device)
        position = starts[:, None] + step  # [rows, new]
        real = step[None, :] < lengths[:, None]
        query_pos = torch.where(real, position, (starts + lengths - 1)[:, None])
        block = tables.gather(1, (position // block_size).clamp_(max=width - 1))
        self.write_slots = torch.where(real, block * block_size + position % block_size,
                                       scratch * block_size + step % block_size).flatten()
        key_pos = torch.arange(keys, device=device)
        gather = tables[:, key_pos // block_size] * block_size + key_pos % block_size
        self.gather = gather.masked_fill_(key_pos >= (starts + lengths)[:, None], 0).flatten()
        self.gathered = gathered
        visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [rows, new, keys]
        distance = query_pos[:, :, None] - key_pos[None, None, :]
        self.masks = {window: (visible if window is None else visible & (distance < window))
                      .repeat(1, group, 1)[:, None] for window in windows}
        self.queries = Queries(rows, new, keys, None, query_pos, query_pos.flatten(), None)


class Recorded:
    """One bucket: its static inputs, and its graph once recorded. The inputs' last rows x new
    entries are the positions whose logits the batch wants (`kept`): they travel in the same
    copy, so no second host-to-device copy waits for the replay."""

    def __init__(self, bucket: Bucket, owner: "GraphedForward") -> None:
        self.bucket, self.owner = bucket, owner
        width = bucket.keys // owner.block_size
        device = owner.logits.device
        self.inputs = torch.zeros(bucket.rows * (2 * bucket.new + 2 + width), dtype=torch.long,
                                  device=device)
        self.wanted = self.inputs[-bucket.rows * bucket.new:]
        self.every = torch.arange(bucket.rows * bucket.new, device=device)
        self.graph = None

    def work(self) -> torch.Tensor:
        """The bucket's device work over its static inputs: the logits of every position."""
        owner = self.owner
        attention = owner.lean.attention
        plan = DevicePlan(self.bucket, self.inputs, owner.gathered, attention.windows,
                          attention.group, owner.block_size, owner.scratch)
        return owner.lean.run(plan.ids, plan, self.every)

    def __call__(self, host_inputs: torch.Tensor, kept: int) -> torch.Tensor:
        """The logits of these inputs' first `kept` wanted positions, [kept, V] (a tensor of
        the caller's own)."""
        self.inputs.copy_(host_inputs)
        if not self.owner.capture:
            return self.work()[self.wanted[:kept]]
        output = self.owner.logits[:self.every.numel()]
        if self.graph is None:
            self.graph = self.record(output)
        self.graph.replay()
        return output[self.wanted[:kept]]

    def record(self, output: torch.Tensor):
        """The graph of `work`, writing into `output` (the graph's own logits die inside the
        capture)."""
        return recorded(lambda: output.copy_(self.work()), self.inputs.device, self.owner.pool)


class GraphedForward:
    """The lean forward of a paged backend, replayed from per-bucket CUDA graphs where a batch
    fits a bucket (module doc): `bucket(segments)` says whether it does, `__call__` runs it."""

    def __init__(self, lean, capture: bool = True) -> None:
        attention = lean.attention
        self.lean, self.capture = lean, capture
        self.block_size = attention.pool.block_size
        # a block of its own for padding's keys and values, held for the runner's life and
        # out of the pool's capacity (a request that needs it is refused as too long)
        self.scratch = attention.pool.allocate(1)[0]
        attention.pool.max_tokens -= self.block_size
        # what every graph reads and writes outside its pool: a replay reaches its buffers by
        # address. The gather buffers are made once, MAX_SLOTS long, and lent to the eager
        # forwards that fit them; a longer eager batch grows buffers of its own, so no
        # recorded graph is ever voided
        keys = attention.pool.keys
        attention.gathered = None
        self.gathered = attention.fixed = tuple(
            keys.new_empty((MAX_SLOTS, *keys.shape[2:])) for _ in range(2))
        self.logits = keys.new_empty(MAX_ROWS * MAX_NEW, lean.model.lm_head.out_features,
                                     dtype=lean.embed.weight.dtype)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.recorded: dict[tuple, Recorded] = {}
        self.eager: set[tuple] = set()  # buckets whose capture failed: they run eager
        self.failed = False  # a capture failed otherwise than out of memory: no more graphs

    def bucket(self, segments) -> Bucket | None:
        """The bucket this batch replays, or None: it runs eager."""
        bucket = bucket_of(segments, self.block_size, self.gathered[0].shape[0])
        if bucket is None:
            return None
        key = (bucket.rows, bucket.new, bucket.keys)
        if key in self.eager or self.failed and key not in self.recorded:
            return None
        return bucket

    def __call__(self, segments, bucket: Bucket) -> list[torch.Tensor]:
        """Each segment's logits, as LeanForward's, from the bucket's graph (recorded at its
        first batch). A capture that fails leaves the batch to the eager forward (raised as
        GraphFailed) and its bucket eager from then on; one that failed otherwise than for
        memory (a host sync: torch warns that a failed capture may leave the graph and its
        allocator in any state) every bucket not yet recorded."""
        reserve(segments)
        key = (bucket.rows, bucket.new, bucket.keys)
        if key not in self.recorded:
            self.recorded[key] = Recorded(bucket, self)
        host, kept = self.host_inputs(segments, bucket)
        try:
            logits = self.recorded[key](host, kept)
        except RuntimeError as error:  # out of memory for the graph's pool included
            if self.recorded[key].graph is not None:
                raise  # a replay's failure is the forward's
            del self.recorded[key]
            self.eager.add(key)
            self.failed = self.failed or not isinstance(error, torch.cuda.OutOfMemoryError)
            logger.warning("CUDA graph of bucket %s not recorded, it runs eager%s: %s", key,
                           " (and no bucket is recorded from now on)" if self.failed else "",
                           error)
            raise GraphFailed from error
        for segment in segments:
            segment.cache.length = segment.start + len(segment.token_ids)
        return list(logits.split([s.num_logits for s in segments]))

    def host_inputs(self, segments, bucket: Bucket) -> tuple[torch.Tensor, int]:
        """The static inputs' values (DevicePlan): token ids, starts, lengths, block tables,
        then the wanted positions; and how many are wanted. Padding rows start at 0 with one
        token, their table the scratch block. Built from host lists: a few small torch ops
        per row cost more (measured: 0.2 against 1.5 ms for 32 rows)."""
        rows, new, width = bucket.rows, bucket.new, bucket.keys // self.block_size
        top = self.lean.embed.num_embeddings - 1
        ids, tables = [0] * (rows * new), [self.scratch] * (rows * width)
        starts, lengths, wanted = [0] * rows, [1] * rows, []
        for row, segment in enumerate(segments):
            fed = segment.token_ids
            ids[row * new:row * new + len(fed)] = [min(t, top) for t in fed]  # as LeanForward
            starts[row], lengths[row] = segment.start, len(fed)
            units = segment.cache.units[:width]  # a rolled-back cache keeps later blocks
            tables[row * width:(row + 1) * width] = units + [0] * (width - len(units))
            end = row * new + len(fed)
            wanted.extend(range(end - segment.num_logits, end))
        padded = wanted + [0] * (rows * new - len(wanted))
        return longs(ids + starts + lengths + tables + padded), len(wanted)


def recorded(work, device, pool=None):
    """work() recorded as a CUDA graph, after warm-ups on a side stream (CUDA's rule:
    allocations and lazy initialisations happen before the capture); returned only once
    recorded, so a failed capture leaves nothing to replay. thread_local: CUDA calls of the
    replica's other threads (sampling on its event loop) do not void the capture. The capture
    runs on one stream of `device` for every graph (capture_stream)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            work()
    torch.cuda.current_stream(device).wait_stream(side)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream(device)
    try:
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream(device),
                              capture_error_mode="thread_local"):
            work()
    except BaseException:
        # a capture whose end fails leaves this thread on the capture's stream: the graph's
        # context restores the stream only after a clean end
        torch.cuda.set_stream(stream)
        raise
    return graph


CAPTURE_STREAMS: dict = {}  # torch.device -> its capture stream


def capture_stream(device):
    """The stream every graph of `device` is captured on. One, as torch's default capture
    stream is one: the caching allocator reuses a block freed in a shared graph pool only
    on the stream it was allocated on, so a stream per capture would keep each graph's peak
    apart. Not torch's default itself, which belongs to whichever device was current when
    it was first made (cuda:0, for a pool on cuda:1)."""
    device = torch.device(device)
    if device not in CAPTURE_STREAMS:
        CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return CAPTURE_STREAMS[device]


def graphs_refused(lean) -> str | None:
    """Why this model's forward cannot be recorded, or None. transformers' dynamic and
    LongRoPE rotary embeddings decide on the host, from the positions' values, whether to
    recompute their frequencies (a device-to-host read a capture forbids), and re-register
    them as new tensors (a replay would read the old ones)."""
    rope_type = getattr(lean.rotary, "rope_type", "default")
    if "dynamic" in rope_type or "longrope" in rope_type:
        return f"rope_type {rope_type!r} updates its frequencies on the host"
    return None


class GraphFailed(RuntimeError):
    """A bucket's capture failed: the batch runs eager (engine.runner), the bucket too."""


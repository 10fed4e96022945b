"""Sampling parameters and the one logits-to-probabilities function both pools use.

Drafter and verifier must turn logits into distributions the same way (temperature, then
top-k, then top-p, the order Hugging Face's logits processors apply them): the rejection
sampler is exact for the distribution the verifier reports, so any mismatch here would change
the output distribution, not just the speed.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. temperature == 0 means greedy decoding."""

    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k truncation
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 64
    stop: tuple[str, ...] = field(default_factory=tuple)
    # penalties (0, 0, 1: none): OpenAI's on the output's tokens, vLLM's repetition penalty
    # (Hugging Face semantics) on the prompt's and the output's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # None: no logprobs; n >= 0: each output token's logprob and its position's top n
    logprobs: int | None = None
    # structured output: llguidance's grammar text the output follows (speculative.grammar)
    grammar: str | None = None
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits first
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's min_tokens: min_tokens_end_ids (the end tokens and stop ids) are masked until
    # the output holds min_tokens tokens
    min_tokens: int = 0
    min_tokens_end_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        errors = []
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            errors.append(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            errors.append(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            errors.append(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            errors.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            errors.append(f"stop must be a list of non-empty strings, got {self.stop!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2 <= value <= 2:
                errors.append(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not \
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            errors.append(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                          f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            errors.append(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                          f"{self.logprobs!r}")
        errors.extend(self.shaping_errors())
        if errors:
            raise ValueError("; ".join(errors))

    def shaping_errors(self) -> list[str]:
        errors = []
        if not all(isinstance(t, int) and t >= 0 and isinstance(b, (int, float))
                   and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias):
            errors.append(f"logit_bias maps token ids >= 0 to biases in [-{MAX_LOGIT_BIAS}, "
                          f"{MAX_LOGIT_BIAS}]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            errors.append(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.min_tokens_end_ids):
            errors.append("min_tokens_end_ids must be token ids >= 0")
        return errors

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != \
            (0, 0, 1)

    @property
    def shaping_ids(self) -> tuple[int, ...]:
        """The token ids logit_bias and min_tokens name (checked against the vocabulary with
        a call's own ids, before a batch's forward: types.check_call)."""
        return tuple(token for token, _ in self.logit_bias) + self.min_tokens_end_ids

    @property
    def law_key(self) -> tuple:
        """What rows drawn together in one batch must share: temperature, top-k, top-p."""
        return self.temperature, self.top_k, self.top_p

    @property
    def shapes_logits(self) -> bool:
        """Whether logit_bias, min_tokens or penalties change the logits (shape_logits)."""
        return self.penalized or bool(self.logit_bias) or (
            self.min_tokens > 0 and bool(self.min_tokens_end_ids))


# a logit divided by the penalty stays finite (1e-300 made it inf, and q NaN: found by fuzzing)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_LOGPROBS = 20  # top logprobs per position (OpenAI's chat limit, as vLLM's default)
MAX_LOGIT_BIAS = 100  # OpenAI's bound on a logit_bias value


@dataclass(frozen=True)
class Shaping:
    """One request's `rows` consecutive rows of a batch's logits, from row `start`: the
    positions after `prompt + output`, row r after drafted[:r] too (shape_logits' terms)."""

    start: int
    rows: int
    params: SamplingParams
    prompt: list[int]
    output: list[int]
    drafted: Sequence[int] = ()


def shape_logits(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
                 output: list[int], drafted: Sequence[int] = ()) -> torch.Tensor:
    """[R, V] logits of R consecutive positions after `prompt + output`, shaped by the
    request as vLLM does before temperature: logit_bias added, then the penalties (penalize:
    row r counts drafted[:r] too), then min_tokens' end ids masked in every row whose output
    so far (output + drafted[:r]) is shorter than min_tokens, unless the mask would leave
    the row nothing (a grammar that allows only an end: the grammar wins). Drafter and
    verifier both shape through shape_batch, so p and q are shaped alike: exact under
    speculation."""
    return shape_batch(logits, [Shaping(0, len(logits), params, prompt, output, drafted)])


def shape_batch(logits: torch.Tensor, shapings: list[Shaping],
                in_place: bool = False) -> torch.Tensor:
    """[N, V] logits with each Shaping's rows shaped as shape_logits shapes one request's
    (the other rows as they were), or `logits` itself when none shapes anything. The
    caller's tensor is untouched, unless in_place: then it is shaped itself (a contiguous
    float32 tensor the caller owns, such as a fresh concatenation). A pool shapes a batch's
    requests together: what each request adds (its bias, its seen columns' penalty terms,
    its held end ids) is worked out on the host, where its token lists are, and each kind of
    shaping is then a few tensor operations for the whole batch, not per request (shaped
    alone, a request with every shaping on cost about 0.17 ms a draft step at a 4k
    vocabulary, most of it those operations' own overhead; measured)."""
    shapings = [shaping for shaping in shapings if shaping.params.shapes_logits]
    if not shapings:
        return logits
    shaped = logits if in_place else logits.to(torch.float32, copy=True)
    add_bias(shaped, shapings)
    add_penalties(shaped, shapings)
    hold_ends(shaped, shapings)
    return shaped


def add_bias(logits: torch.Tensor, shapings: list[Shaping]) -> None:
    """OpenAI's logit_bias added in place, each id once per row (the last value given)."""
    rows, columns, values = [], [], []
    vocab = logits.shape[-1]
    for shaping in shapings:
        if not shaping.params.logit_bias:
            continue
        bias = dict(shaping.params.logit_bias)
        if max(bias) >= vocab:
            raise ValueError(f"logit_bias names token {max(bias)}; the vocabulary has {vocab}")
        for row in range(shaping.start, shaping.start + shaping.rows):
            rows += [row] * len(bias)
            columns += bias
            values += bias.values()
    if rows:
        device, flat = logits.device, logits.view(-1)  # the entries by their flat index
        index = torch.tensor(rows, device=device) * vocab + torch.tensor(columns, device=device)
        flat.index_copy_(0, index, flat.index_select(0, index) + torch.tensor(
            values, dtype=torch.float32, device=device))


def penalize(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
             output: list[int], drafted: Sequence[int] = ()) -> torch.Tensor:
    """[R, V] logits of R consecutive positions after `prompt + output`, penalised as vLLM
    does before temperature: row r counts the output's tokens and drafted[:r] (the tokens
    drafted before it). The repetition penalty (Hugging Face's: a positive logit divided by
    it, a negative one multiplied) hits every token seen in the prompt or before the row;
    then the frequency penalty times each token's count in the output before the row and
    the presence penalty once per token that occurs there are subtracted. A copy; the
    logits themselves when no penalty is set."""
    if not params.penalized:
        return logits
    shaped = logits.to(torch.float32, copy=True)
    add_penalties(shaped, [Shaping(0, len(logits), params, prompt, output, drafted)])
    return shaped


def add_penalties(logits: torch.Tensor, shapings: list[Shaping]) -> None:
    """penalize's terms applied in place to every penalised Shaping's rows. Only the columns
    of tokens seen change (ids past V, a smaller draft vocabulary's, have none): they are
    gathered, penalised and written back (penalising whole rows cost 1.8 ms a call at a 32k
    vocabulary and 8.5 ms at 128k, 5 rows, measured)."""
    terms = [penalty_terms(shaping, logits.shape[-1]) for shaping in shapings
             if shaping.params.penalized]
    terms = [term for term in terms if term is not None]
    if not terms:
        return
    vocab, flat = logits.shape[-1], logits.view(-1)  # the entries by their flat index
    index = torch.from_numpy(np.concatenate([(rows * vocab + columns).ravel()
                                             for rows, columns, _ in terms])).to(logits.device)
    divisor, factor, frequency, presence = torch.from_numpy(
        np.concatenate([term[2] for term in terms], axis=1)).to(logits.device)
    picked = flat.index_select(0, index)
    # a divisor or factor of 1 (a column the repetition penalty leaves alone) keeps its bits
    picked = torch.where(picked > 0, picked / divisor, picked * factor)
    flat.index_copy_(0, index, picked - frequency - presence)


def penalty_terms(shaping: Shaping, vocab: int):
    """(rows [R, 1], columns [1, C], terms [4, R x C]) of a penalised Shaping's R rows and C
    seen columns: each entry's divisor if positive, factor if negative (the repetition
    penalty where seen, else 1), and the frequency and presence amounts subtracted, in
    float32 as the logits' arithmetic takes them; None when nothing was seen."""
    params, rows = shaping.params, shaping.rows
    if len(shaping.drafted) < rows - 1:
        raise ValueError(f"{rows} positions need the {rows - 1} tokens drafted before them")
    steps = np.asarray(shaping.drafted[:rows - 1], dtype=np.int64)
    if steps.size and steps.max() >= vocab:  # the pool drafted it from these logits
        raise IndexError(f"a drafted token {steps.max()} past the vocabulary of {vocab}")
    output = np.asarray(shaping.output, dtype=np.int64)
    output = output[output < vocab]
    repetition = params.repetition_penalty != 1
    prompt = np.asarray(shaping.prompt if repetition else (), dtype=np.int64)
    prompt = prompt[prompt < vocab]
    columns = np.unique(np.concatenate([output, prompt, steps]))
    if not columns.size:
        return None
    counts = np.empty((rows, columns.size), dtype=np.float32)
    counts[:] = np.bincount(np.searchsorted(columns, output), minlength=columns.size)
    for row, column in enumerate(np.searchsorted(columns, steps), start=1):
        counts[row:, column] += 1  # row r also counts drafted[:r]
    present = counts > 0
    terms = np.ones((4, rows, columns.size), dtype=np.float32)
    if repetition:
        seen = present.copy()
        seen[:, np.searchsorted(columns, prompt)] = True  # every prompt id is a column
        terms[0][seen] = terms[1][seen] = params.repetition_penalty
    terms[2] = np.float32(params.frequency_penalty) * counts
    terms[3] = np.float32(params.presence_penalty) * present
    return (np.arange(shaping.start, shaping.start + rows)[:, None], columns[None],
            terms.reshape(4, -1))


def hold_ends(logits: torch.Tensor, shapings: list[Shaping]) -> None:
    """min_tokens in place: each Shaping's rows whose output so far is shorter than its
    min_tokens get its end ids at -inf, but for a row the mask would leave nothing (it keeps
    them). The held entries are set, each row's maximum says whether it has a token left,
    and the entries of rows without one get their values back: small operations and one
    pass over the logits, whatever the batch."""
    rows, columns = [], []
    vocab = logits.shape[-1]
    for shaping in shapings:
        short = min(shaping.params.min_tokens - len(shaping.output), shaping.rows)
        ends = [token for token in shaping.params.min_tokens_end_ids if token < vocab]
        for row in range(shaping.start, shaping.start + max(short, 0)):
            rows += [row] * len(ends)
            columns += ends
    if not rows:
        return
    device, flat = logits.device, logits.view(-1)
    index = torch.tensor(rows, device=device) * vocab + torch.tensor(columns, device=device)
    held = flat.index_select(0, index)
    flat.index_fill_(0, index, float("-inf"))
    room = logits.amax(-1) > float("-inf")  # [N]: a row still has a token to take
    flat.index_copy_(0, index, torch.where(room[index // vocab], float("-inf"), held))


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k and top-p.

    Greedy (temperature 0) gives the one-hot distribution of the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop the low tail whose total mass is <= 1 - top_p; the top token always stays
        drop_sorted = cumulative <= 1 - params.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., V'] logits -> [..., vocab_size]: padded rows get -inf (probability 0), rows beyond
    vocab_size are dropped. A draft padded unlike the target then draws only ids the target
    can score, from the very q it ships."""
    extra = vocab_size - logits.shape[-1]
    if extra > 0:
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
    return logits[..., :vocab_size]


def kept_by_mass(values: torch.Tensor, mass: float) -> torch.Tensor:
    """[n] bool: which of [n] values, most likely first, a q truncated to `mass` keeps: each
    entry whose predecessors hold less than mass (the fewest holding it), zeros left out."""
    before = values.cumsum(-1) - values  # the mass of the entries ahead of each
    return (before < mass) & (values > 0)


# A float32's sign, 8 exponent bits and 2 mantissa bits: 1024 buckets, 4 an octave.
BUCKET_SHIFT = 21
NUM_BUCKETS = 1 << (32 - 1 - BUCKET_SHIFT)
MASS_MARGIN = 1e-6  # far above the rounding of a float32 sum near 1


def value_buckets(probs: torch.Tensor) -> torch.Tensor:
    """[V] float32 -> [V] bucket per entry, in the order of the values: non-negative floats
    order like their bit patterns, so their leading bits bucket them without a sort."""
    return (probs.view(torch.int32) >> BUCKET_SHIFT).clamp_min(0)  # -0.0 joins bucket 0


def lowest_bucket_holding(buckets: torch.Tensor, probs: torch.Tensor, mass: float) -> int:
    """The lowest bucket b such that the entries in buckets >= b hold `mass` (plus a margin),
    read off a histogram of the row's mass; 0 when the row cannot hold it."""
    mass_from_top = torch.bincount(buckets, weights=probs, minlength=NUM_BUCKETS).flip(0)
    taken = int(torch.searchsorted(mass_from_top.cumsum(0), mass + MASS_MARGIN))
    return max(NUM_BUCKETS - 1 - taken, 0)


def sorted_candidates(probs: torch.Tensor, buckets: torch.Tensor,
                      lowest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the entries in buckets >= lowest, most likely first."""
    ids = (buckets >= lowest).nonzero().squeeze(-1)
    values, order = torch.sort(probs[ids], descending=True)
    return values, ids[order]


def fewest_holding_mass(probs: torch.Tensor, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [m], ids [m]) of the fewest most likely entries of a [V] row whose total is
    >= mass, most likely first, zeros left out: what sorting the whole row keeps (up to ties),
    found by sorting only the candidates above a histogram's threshold (one pass over V).

    The candidates are the row's top entries, so their sorted prefix and its sums are the full
    sort's; when they hold the mass, no entry after them would be kept. What is cut is at
    most 1 - mass of q, so acceptance loses at most that much per position.
    """
    probs = probs.float().contiguous()
    buckets = value_buckets(probs)
    lowest = lowest_bucket_holding(buckets, probs, mass)
    values, ids = sorted_candidates(probs, buckets, lowest)
    # summed as the sort's cumsum accumulates (float64); short only at a rounding borderline
    if lowest > 0 and float(values.sum(dtype=torch.float64)) < mass + MASS_MARGIN:
        values, ids = sorted_candidates(probs, buckets, 0)  # the whole row
    keep = kept_by_mass(values, mass)
    return values[keep], ids[keep]


def kept_entries(probs: torch.Tensor, top_k: int, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [m], ids [m]) that a truncated draft q keeps of a [V] row, most likely first,
    zeros left out: its top_k largest entries (0: all), renormalised, then of those the fewest
    holding `mass` (1: all). The caller renormalises what is kept."""
    if 0 < top_k < probs.shape[-1]:
        values, ids = torch.topk(probs, top_k)
        values = values / values.sum()
        keep = kept_by_mass(values, mass) if mass < 1 else values > 0
        return values[keep], ids[keep]
    if mass < 1:
        return fewest_holding_mass(probs, mass)
    ids = probs.nonzero().squeeze(-1)
    return probs[ids], ids


def draft_law(weights: torch.Tensor) -> torch.Tensor:
    """The distributions q that [K, m] shipped draft weights stand for: each row over its sum.

    A drafter ships q in the precision it chooses (float16 halves the bytes); the rounded
    weights are what it sampled from (torch.multinomial draws in proportion to weights), so
    every consumer reads q through this one function. Raises ValueError for weights no
    sampler could have drawn from.
    """
    weights = weights.float()
    totals = weights.sum(-1, keepdim=True)
    # an infinite entry fails the totals' maximum, a NaN or a negative one the minimum (q
    # arrives from the wire, on the host: a scalar's .item() costs less than tensor logic)
    if totals.numel() and not (0 < totals.min().item() and totals.max().item() < float("inf")
                               and weights.min().item() >= 0):
        raise ValueError("draft_probs must be finite, non-negative, with a positive sum per row")
    return weights / totals


def derive_seeds(seed: int | None, n: int) -> list[int | None]:
    """Seeds of n independent samples derived from one request seed (None stays unseeded)."""
    if seed is None:
        return [None] * n
    states = np.random.SeedSequence(seed).spawn(n)
    return [int(state.generate_state(1, dtype=np.uint64)[0] >> 1) for state in states]


def seeded_generator(seed: int, device) -> torch.Generator:
    """A generator on the device its draws run on (a CPU generator cannot draw from CUDA
    probabilities): a seed repeats its tokens on the same kind of device."""
    return torch.Generator(device=device).manual_seed(seed)


def sample_rows(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of [R, m] non-negative weights, drawn in proportion to them (a row
    need not sum to 1), on their device, with no host sync: [R] int64.

    Each row inverts its cumulative sum at one uniform, so a draw takes the same randomness
    whatever m: a seeded draft stays in step when float rounding at the mass boundary keeps
    one entry more or fewer in a truncated q (torch.multinomial draws one exponential per
    entry, and shifted every later draw of the request's generator), a tiny change of the
    weights moves a draw only when its uniform falls that close to a boundary, and a row of
    a 4096-entry vocabulary costs a cumulative sum, not 4096 exponentials.
    """
    uniform = torch.rand(weights.shape[0], 1, generator=generator, dtype=torch.float64,
                         device=weights.device)
    return inverted(weights, uniform)


def sample_each(weights: torch.Tensor, generators: list[torch.Generator],
                rows_each: int = 1) -> torch.Tensor:
    """sample_rows of [R, m] weights, each generator drawing for the next `rows_each` rows
    (the uniforms it would give sample_rows of those rows alone): [R] int64, no host sync."""
    uniform = torch.cat([torch.rand(rows_each, 1, generator=generator, dtype=torch.float64,
                                    device=weights.device) for generator in generators])
    return inverted(weights, uniform)


def inverted(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[R] index of each row of [R, m] weights at which its cumulative sum passes the row's
    uniform [R, 1] times its total."""
    cumulative = weights.double().cumsum(-1)
    index = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True)
    last = cumulative.argmax(-1, keepdim=True)  # the first entry at the total: its last > 0
    return torch.minimum(index, last).squeeze(-1)  # a product rounded up to the row's total


def grouped(keys: list) -> list[list[int]]:
    """The indices of keys, grouped by equal key in first-seen order; None keys left out."""
    groups: dict = {}
    for index, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(index)
    return list(groups.values())


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn from [m] non-negative weights (sample_rows of one row)."""
    return int(sample_rows(probs[None], generator)[0])

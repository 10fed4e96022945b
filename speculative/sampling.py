"""Sampling parameters and the one logits-to-probabilities function both pools use.

Drafter and verifier must turn logits into distributions the same way (temperature, then
min-p, top-k and top-p, the order vLLM's sampler applies them): the rejection
sampler is exact for the distribution the verifier reports, so any mismatch here would change
the output distribution, not just the speed.
"""

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from speculative.options import MAX_PLAIN_STEPS
from speculative.repetition import RepetitionDetection
from speculative.thinking import ThinkingBudget


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. temperature == 0 means greedy decoding."""

    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k truncation
    top_p: float = 1.0
    min_p: float = 0.0  # vLLM's: tokens below min_p x the likeliest one's probability dropped
    seed: int | None = None
    max_tokens: int = 64  # 0: nothing decoded (the completions API's echo of the prompt)
    stop: tuple[str, ...] = field(default_factory=tuple)
    # vLLM's: the stop string (or stop token) that ends the output is kept in its text
    include_stop_str_in_output: bool = False
    # penalties (0, 0, 1: none): OpenAI's on the output's tokens, vLLM's repetition penalty
    # (Hugging Face semantics) on the prompt's and the output's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # None: no logprobs; n >= 0: each output token's logprob and its position's top n
    logprobs: int | None = None
    # vLLM's logprob_token_ids (with logprobs 0): each position's logprobs of these ids
    # instead of its top n
    logprob_token_ids: tuple[int, ...] = ()
    # structured output: llguidance's grammar text the output follows (speculative.grammar)
    grammar: str | None = None
    # vLLM 0.32's grammar after the reasoning: the reasoning's end ids, the grammar holding
    # only on the tokens after their first occurrence in the output (everything allowed
    # before); empty: from the output's first token (speculative.grammar.TokenMasks)
    grammar_after: tuple[int, ...] = ()
    # with grammar_after, vLLM 0.32's implicit ends of the reasoning (qwen3's `<tool_call>`):
    # ids each of which, where it stands first, ends the reasoning as the end ids do, itself
    # the grammar's first token (allowed where it is drawn, then consumed by the grammar)
    grammar_at: tuple[int, ...] = ()
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits first
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's min_tokens: min_tokens_end_ids (the end tokens and stop ids) are masked until
    # the output holds min_tokens tokens
    min_tokens: int = 0
    min_tokens_end_ids: tuple[int, ...] = ()
    # vLLM's allowed_token_ids: every position samples among these ids alone (empty: all)
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words, tokenized (deployments.bad_words): a word's last token is masked
    # where the output so far ends with its other tokens (a one-token word: everywhere)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's cache_salt: the pools' prefix caches share prompt blocks only among requests
    # of the same salt ("": none, every request's)
    cache_salt: str = ""
    # vLLM's repetition_detection: the output ends where its tail repeats a pattern (read
    # by the router alone, at each committed token: speculative.state)
    repetition_detection: RepetitionDetection | None = None
    # vLLM's thinking_token_budget with the reasoning parser's ids: the end ids forced once
    # a thinking section spent it (read by the router alone: speculative.thinking)
    thinking_budget: ThinkingBudget | None = None

    def __post_init__(self) -> None:
        errors = []
        if not isinstance(self.temperature, (int, float)) or not (
                self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            errors.append(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, "
                          f"{MAX_TEMPERATURE}], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            errors.append(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            errors.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.repetition_detection, (RepetitionDetection, type(None))):
            errors.append("repetition_detection must be a RepetitionDetection or None")
        if not isinstance(self.thinking_budget, (ThinkingBudget, type(None))):
            errors.append("thinking_budget must be a ThinkingBudget or None")
        if not isinstance(self.cache_salt, str):
            errors.append(f"cache_salt must be a string, got {self.cache_salt!r}")
        if self.grammar_after and (self.grammar is None or not all(
                isinstance(t, int) and t >= 0 for t in self.grammar_after)):
            errors.append("grammar_after must be token ids >= 0, with a grammar")
        if self.grammar_at and (not self.grammar_after or not all(
                isinstance(t, int) and t >= 0 for t in self.grammar_at)):
            errors.append("grammar_at must be token ids >= 0, with grammar_after")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            errors.append(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or \
                self.max_tokens < 0:
            errors.append(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
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
        given = self.logprob_token_ids
        if given and (self.logprobs != 0 or len(given) > MAX_LOGPROB_TOKEN_IDS
                      or not all(isinstance(t, int) and t >= 0 for t in given)):
            errors.append(f"logprob_token_ids must be up to {MAX_LOGPROB_TOKEN_IDS} token ids "
                          ">= 0, with logprobs 0")
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
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS or not all(
                isinstance(t, int) and t >= 0 for t in self.allowed_token_ids):
            errors.append(f"allowed_token_ids must be up to {MAX_ALLOWED_TOKEN_IDS} token ids "
                          ">= 0")
        words = self.bad_words_ids
        if len(words) > MAX_BAD_WORDS or sum(map(len, words)) > MAX_BAD_WORDS_TOKENS or \
                not all(word and all(isinstance(t, int) and t >= 0 for t in word)
                        for word in words):
            errors.append(f"bad_words_ids must be up to {MAX_BAD_WORDS} non-empty sequences "
                          f"of token ids >= 0, {MAX_BAD_WORDS_TOKENS} ids in all")
        return errors

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seeded(self) -> bool:
        """A sampled request with a seed: its tokens depend on its draws alone, never on
        load or timings (its pool calls are waited for; its K is not learnt)."""
        return self.seed is not None and not self.greedy

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != \
            (0, 0, 1)

    # What shaping and the calls' checks read of the id lists, made once per params (a pool
    # holds a session's for all its calls: deployments.wire.SessionSampling); read in Python
    # at every call and draft step, 4,096 ids cost 0.3 ms a request each time (measured)

    @cached_property
    def shaping_ids(self) -> tuple[int, ...]:
        """The token ids logit_bias, min_tokens, allowed_token_ids, bad_words and the
        grammar's gate (grammar_after, grammar_at) name, each once, sorted: a call checks the
        largest (all are >= 0) against the vocabulary with its own ids, before a batch's
        forward (checks.check_call; a gate id past it never occurs, and its grammar never
        held)."""
        return tuple(sorted({*(token for token, _ in self.logit_bias),
                             *self.min_tokens_end_ids, *self.allowed_token_ids,
                             *(token for word in self.bad_words_ids for token in word),
                             *self.grammar_after, *self.grammar_at}))

    @cached_property
    def allowed_ids(self) -> np.ndarray:
        """allowed_token_ids as sorted distinct int64 ids (speculative.shaping.keep_allowed)."""
        return np.unique(np.asarray(self.allowed_token_ids, dtype=np.int64))

    @cached_property
    def allowed_set(self) -> frozenset[int]:
        """allowed_token_ids as a set (speculative.shaping.unmasked_prefix)."""
        return frozenset(self.allowed_token_ids)

    @cached_property
    def bad_word_ends(self) -> dict[int, dict[tuple[int, ...], tuple[int, ...]]]:
        """bad_words as {n: {a word's other n tokens: the last tokens of the words they
        begin}} (speculative.shaping.ban_words)."""
        ends: dict[int, dict[tuple[int, ...], tuple[int, ...]]] = {}
        for word in self.bad_words_ids:
            before = ends.setdefault(len(word) - 1, {})
            before[tuple(word[:-1])] = before.get(tuple(word[:-1]), ()) + (word[-1],)
        return ends

    @cached_property
    def bad_words_reach(self) -> int:
        """How many of the output's last tokens bad_words read (its longest word's, but one)."""
        return max(map(len, self.bad_words_ids), default=1) - 1

    @property
    def law_key(self) -> tuple:
        """What rows drawn together in one batch must share: temperature, min-p, top-k,
        top-p."""
        return self.temperature, self.min_p, self.top_k, self.top_p

    @property
    def shapes_logits(self) -> bool:
        """Whether logit_bias, min_tokens, penalties, allowed_token_ids or bad_words change the
        logits (speculative.shaping)."""
        return self.penalized or bool(self.logit_bias) or (
            self.min_tokens > 0 and bool(self.min_tokens_end_ids)) or \
            bool(self.allowed_token_ids) or bool(self.bad_words_ids)


# a logit divided by the penalty stays finite (1e-300 made it inf, and q NaN: found by fuzzing)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# below it a positive temperature is no law a float can hold (logits / 1e-30 overflow): a
# call asking for it is refused (the router and the CLI read one as vLLM: served_temperature)
MIN_TEMPERATURE = 1e-5
# vLLM's SamplingParams raises a positive temperature below 1e-2 to 1e-2 (its _MAX_TEMP) and
# only 0 is greedy: 1e-6 samples at 1e-2 there, and 5e-3 does not sample twice as sharp
MIN_SERVED_TEMPERATURE = 1e-2
# above float32's largest (3.4e38) a temperature divides as inf, and a logit masked before
# it (min_tokens, a grammar: -inf) is NaN; long before, every law is uniform to float32
MAX_TEMPERATURE = 1e30
MAX_LOGPROBS = 20  # top logprobs per position (OpenAI's chat limit, as vLLM's default)
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids
MAX_LOGIT_BIAS = 100  # OpenAI's bound on a logit_bias value
# allowed_token_ids' length (every pool call checks the ids against its vocabulary)
MAX_ALLOWED_TOKEN_IDS = 4096
# bad_words' sequences once tokenized (vLLM's default VLLM_MAX_NUM_BAD_WORDS) and their ids
# in all (as vLLM's GPU model runner's MAX_BAD_WORDS_TOTAL_TOKENS)
MAX_BAD_WORDS, MAX_BAD_WORDS_TOKENS = 128, 1024


def served_temperature(temperature: float) -> float:
    """A request's temperature as vLLM serves it: 0 greedy, a positive one at least
    MIN_SERVED_TEMPERATURE."""
    return max(temperature, MIN_SERVED_TEMPERATURE) if temperature > 0 else temperature


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, min-p, top-k and
    top-p.

    Greedy (temperature 0) gives the one-hot distribution of the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.min_p > 0:
        probs = logits.softmax(-1)
        below = probs < params.min_p * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(below, float("-inf"))  # the likeliest token stays
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1:
        # stable: tied logits keep one order whatever the batch's shape (a GPU's sort may
        # otherwise order them by the tensor's shape, and a verify's rows and the target
        # alone could keep different tokens at a tie)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False, stable=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop the low tail whose total mass is <= 1 - top_p; the top token always stays.
        # 1 - top_p in float32, as vLLM's sampler holds top_p (float32(1 - 0.9) is 0.1000000015
        # where vLLM cuts at 0.100000024: a tail of mass between them kept, vLLM's cut)
        drop_sorted = cumulative <= float(np.float32(1) - np.float32(params.top_p))
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


# torch's CPU generator keys its stream by a seed's low 32 bits alone (CUDA's reads all 64):
# the calls of one request take distinct low bits (speculative.round_steps.draw_seed), each a block
# of SEED_BLOCK values, its steps the values after its own (verifier.steps.step_seed)
SEED_LOW_BITS = (1 << 32) - 1
SEED_BLOCK = MAX_PLAIN_STEPS


def step_seed(seed: int, step: int) -> int:
    """The seed of a call's step: the call's own for the first, then the next values of its
    low 32 bits, which a CPU generator reads (SEED_BLOCK: a request's calls leave room for
    their steps); a seeded request's steps draw the same tokens every time."""
    return (seed & ~SEED_LOW_BITS) | ((seed + step) & SEED_LOW_BITS)


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
    uniform [R, 1] times its total; m for a row holding a NaN (a model's NaN or inf logits),
    whose NaN total torch's searchsorted places past every entry, on any device: the
    callers refuse that index (drafter.model, verifier.host.refusing_lawless)."""
    cumulative = weights.double().cumsum(-1)
    total = cumulative[:, -1:].contiguous()
    index = torch.searchsorted(cumulative, uniform * total, right=True)
    # the first entry at the total (the row's last > 0), found by bisection: a cumulative
    # sum of weights >= 0 never decreases (an argmax over it took 60 of 140 us at 16 x 4096)
    last = torch.searchsorted(cumulative, total)
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

"""Prompt logprobs (vLLM's `prompt_logprobs`, and the completions API's `echo` with
logprobs): each prompt token's raw log-probability under the target given the tokens
before it, its rank and the position's top n.

A request's verify calls never ask for these: its prefill computes the last position's
logits only, and a prefix cache hit computes none. So a prompt's logprobs are a forward of
their own, through transformers' modeling with a cache of its own (engine.runner's), fed in
chunks of at most `chunk_tokens` positions (the verifier's max_batch_tokens: a pool runs
each chunk as a job of its own, so other requests' batches run between them) whose logits
stay within CHUNK_LOGITS_BYTES (a 128k vocabulary's float32 row is 0.5 MB: 128 positions).
Their values are the modeling's, within float rounding of the served forward's
(engine.lean), as vLLM's prompt logprobs are its prefill's.
"""

import inspect

import torch

from engine.runner import TransformersCache
from speculative.checks import check_call
from speculative.types import PromptLogprobs, TokenLogprob

CHUNK_LOGITS_BYTES = 64 << 20
CHUNK_TOKENS = 512


class PromptScoring:
    """One prompt's logprobs, a chunk a step (`step`, until `done`), then `result()`."""

    def __init__(self, model, token_ids: list[int], top_n: int, max_positions: int | None,
                 chunk_tokens: int | None = CHUNK_TOKENS) -> None:
        """ValueError for ids outside the vocabulary, a prompt past the context or a top n
        past the vocabulary (before the model runs)."""
        vocab_size = model.config.get_text_config().vocab_size
        check_call(token_ids, vocab_size)
        if max_positions is not None and len(token_ids) > max_positions:
            raise ValueError(f"{len(token_ids)} tokens exceed the target's context of "
                             f"{max_positions}")
        if not 0 <= top_n <= vocab_size:
            raise ValueError(f"prompt logprobs ask for the top {top_n} tokens of a "
                             f"vocabulary of {vocab_size}")
        self.model, self.top_n = model, top_n
        self.ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
        self.chunk = max(1, min(CHUNK_LOGITS_BYTES // (4 * vocab_size),
                                chunk_tokens or len(token_ids)))
        self.cache, self.cache_name = TransformersCache(model.config), cache_kwarg(model)
        self.fed = 0  # the last token predicts nothing: positions 0 .. L - 2 are fed
        self.entries: list[TokenLogprob] = []
        self.ranks: list[int] = []

    @property
    def done(self) -> bool:
        return self.fed >= self.ids.shape[1] - 1

    def step(self) -> None:
        """The next chunk's forward and its rows."""
        start, end = self.fed, min(self.fed + self.chunk, self.ids.shape[1] - 1)
        with torch.inference_mode():
            logits = self.model(input_ids=self.ids[:, start:end], use_cache=True,
                                **{self.cache_name: self.cache}).logits[0]
            entries, ranks = read_rows(logits, self.ids[0, start + 1:end + 1], self.top_n)
        # the cache records its sliding layers' past (TransformersCache: for a rollback),
        # which only a crop trims back to their window: else they held the whole prompt
        self.cache.crop(0)
        self.entries.extend(entries)
        self.ranks.extend(ranks)
        self.fed = end

    def result(self) -> PromptLogprobs:
        self.cache = None  # its keys and values go now, not with the last reference
        return PromptLogprobs(tuple(self.entries), tuple(self.ranks))


def prompt_logprobs(model, token_ids: list[int], top_n: int,
                    max_positions: int | None = None) -> PromptLogprobs:
    """PromptScoring's result, all its steps at once."""
    scoring = PromptScoring(model, token_ids, top_n, max_positions)
    while not scoring.done:
        scoring.step()
    return scoring.result()


def cache_kwarg(model) -> str:
    """The forward's name for its cache: `cache` in newer transformers, which deprecate
    `past_key_values` (the name this project's oldest supported release takes)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"


def read_rows(logits: torch.Tensor, next_ids: torch.Tensor, top_n: int
              ) -> tuple[list[TokenLogprob], list[int]]:
    """Each row's logprob of its next token, that token's rank (vLLM's: the tokens at least
    as likely, itself included, so that one tied with the top n yet not listed among them
    ranks past n; at least 1, a NaN row's too) and the row's top n, with one transfer to the
    host."""
    logprobs = torch.log_softmax(logits.float(), -1)
    picked = logprobs.gather(1, next_ids[:, None])  # [R, 1]
    ranks = (logprobs >= picked).sum(-1).clamp(min=1)
    values, top_ids = torch.topk(logprobs, top_n, dim=-1)  # [R, n]
    rows = len(next_ids)  # ids and ranks < 2**53 travel exactly as float64
    host = torch.cat([picked[:, 0].double(), ranks.double(), next_ids.double(),
                      values.double().flatten(), top_ids.double().flatten()]).tolist()
    picked, ranks, tokens = host[:rows], host[rows:2 * rows], host[2 * rows:3 * rows]
    values, top_ids = host[3 * rows:3 * rows + rows * top_n], host[3 * rows + rows * top_n:]
    entries = [TokenLogprob(int(tokens[r]), picked[r], tuple(
        (int(top_ids[r * top_n + i]), values[r * top_n + i]) for i in range(top_n)))
        for r in range(rows)]
    return entries, [int(rank) for rank in ranks]

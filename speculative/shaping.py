"""The request's shaping of the logits before temperature, as vLLM applies it: vLLM's
allowed_token_ids and bad_words, OpenAI's logit_bias, the presence, frequency and repetition
penalties, and min_tokens.

Drafter and verifier shape p and q through the same function (shape_batch), row r counting
the tokens drafted before it, so speculation stays exact. A pool shapes a batch's requests
together: what each request adds is worked out on the host, where its token lists are, and
each kind of shaping is then a few tensor operations for the whole batch.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from speculative.sampling import SamplingParams


class Counted(NamedTuple):
    """What the penalties read of a prompt and an output (penalty_terms): the sorted ids seen
    in the output (and in the prompt, when it is counted), each one's count in the output,
    whether the prompt holds it, and the output's length. Never changed once made."""

    columns: np.ndarray  # [C] int64, sorted
    counts: np.ndarray  # [C] int64
    prompted: np.ndarray  # [C] bool
    output_len: int


NOTHING_COUNTED = Counted(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, bool), 0)


def counted(base: Counted, prompt: Sequence[int], output: Sequence[int],
            others: np.ndarray = NOTHING_COUNTED.columns) -> Counted:
    """base with `prompt`'s ids and `output`'s tokens added, and columns for the ids `others`
    (neither counted nor marked); new arrays, base is left as it was: a few tokens cost a
    merge, not a count of all the tokens before them."""
    output_ids, output_counts = np.unique(np.asarray(output, dtype=np.int64),
                                          return_counts=True)
    prompt_ids = np.unique(np.asarray(prompt, dtype=np.int64))
    ids = np.union1d(np.union1d(output_ids, prompt_ids), others)
    at = np.searchsorted(base.columns, ids)
    known = np.zeros(len(ids), dtype=bool)
    inside = at < len(base.columns)
    known[inside] = base.columns[at[inside]] == ids[inside]
    new = at[~known]
    columns = np.insert(base.columns, new, ids[~known])
    counts = np.insert(base.counts, new, 0)
    prompted = np.insert(base.prompted, new, False)
    counts[np.searchsorted(columns, output_ids)] += output_counts
    prompted[np.searchsorted(columns, prompt_ids)] = True
    return Counted(columns, counts, prompted, base.output_len + len(output))


class SeenTokens:
    """A request's committed tokens as the penalties count them (Counted), grown with the
    tokens committed since the last call: counting the whole prompt and output at every call
    cost 3.4 ms a verify at 32k output tokens, and as much at each step of a draft (27 ms with
    a repetition penalty over a 100k-token prompt; measured). A pool keeps one on a request's
    sequence (engine.kv.Sequence.counted), made anew when the sequence is rebuilt."""

    def __init__(self, prompt_len: int, with_prompt: bool) -> None:
        self.prompt_len, self.with_prompt = prompt_len, with_prompt
        self.length = 0  # the committed tokens counted
        self.counted = NOTHING_COUNTED

    def of(self, committed: Sequence[int]) -> Counted:
        """The counts of committed[:prompt_len] (when the prompt counts) and of the rest,
        where committed extends the list last passed (one shorter is counted anew)."""
        if len(committed) < self.length:
            self.length, self.counted = 0, NOTHING_COUNTED
        if len(committed) > self.length:
            new, cut = committed[self.length:], max(0, self.prompt_len - self.length)
            prompt = new[:cut] if self.with_prompt else ()
            self.counted = counted(self.counted, prompt, new[cut:])
            self.length = len(committed)
        return self.counted


def committed_history(sampling: SamplingParams, prompt_len: int, sequence,
                      extra: list[int] = ()) -> dict:
    """Shaping's prompt, output and seen for a request whose committed tokens a pool's
    sequence holds (engine.kv.Sequence), its output going on with `extra` (a draft's assumed
    and drafted tokens): a penalised request's committed tokens counted as they grew
    (Sequence.counted) with the committed output's last tokens bad_words read, another's as
    lists of the output's last tokens bad_words read, the ones before them counted as
    `skipped` (logit_bias, min_tokens and allowed_token_ids read no more: the whole output
    copied for each row: 87 us a row at 40k tokens, against 0.8)."""
    committed = sequence.committed
    start = max(prompt_len, len(committed) - sampling.bad_words_reach)
    if sampling.penalized:
        return {"prompt": (), "output": list(extra), "recent": committed[start:],
                "seen": sequence.counted(prompt_len, sampling.repetition_penalty != 1)}
    return {"prompt": (), "output": committed[start:] + list(extra),
            "skipped": start - prompt_len}


@dataclass(frozen=True)
class Shaping:
    """One request's `rows` consecutive rows of a batch's logits, from row `start`: the
    positions after `prompt + output`, row r after drafted[:r] too (shape_logits' terms).
    `seen`: the prompt and the output's first tokens, counted (a pool's SeenTokens); then
    `prompt` is not read, `output` holds only the output's tokens after those, and `recent`
    the last of those (at least the params' bad_words_reach, or all of them). `skipped`: the
    output's first tokens, before `output`, that a request without penalties needs only
    counted (committed_history)."""

    start: int
    rows: int
    params: SamplingParams
    prompt: Sequence[int]
    output: Sequence[int]
    drafted: Sequence[int] = ()
    seen: Counted | None = None
    recent: Sequence[int] = ()
    skipped: int = 0

    @property
    def output_len(self) -> int:
        return len(self.output) + self.skipped + (0 if self.seen is None else
                                                  self.seen.output_len)


def shape_logits(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
                 output: list[int], drafted: Sequence[int] = ()) -> torch.Tensor:
    """[R, V] logits of R consecutive positions after `prompt + output`, shaped by the
    request as vLLM does before temperature: the ids outside allowed_token_ids and the bad
    words' banned ids masked (ban_words: row r reads the output so far, output +
    drafted[:r]), logit_bias added, then the penalties (penalize: row r counts drafted[:r]
    too), then min_tokens' end ids masked in every row whose output so far is shorter than
    min_tokens. A mask that would leave a row nothing leaves it as it was (a grammar that
    allows only an end, or none of the allowed ids: the grammar wins). Drafter and verifier
    both shape through shape_batch, so p and q are shaped alike: exact under speculation."""
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
    keep_allowed(shaped, shapings)
    ban_words(shaped, shapings)
    add_bias(shaped, shapings)
    add_penalties(shaped, shapings)
    hold_ends(shaped, shapings)
    return shaped


def keep_allowed(logits: torch.Tensor, shapings: list[Shaping]) -> None:
    """vLLM's allowed_token_ids in place: each Shaping's rows keep the logits of its allowed
    ids alone (ids past V, a smaller draft vocabulary's, have none), the others -inf, but
    for a row left no finite logit (a grammar that allows none of them), kept whole. Only
    the restricted rows are touched: their allowed entries are gathered, each row whose
    entries hold a finite logit is filled with -inf, and the entries are written back (a
    [N, V] mask and two [N, V] copies, the ids made a tensor for each request: 106 ms a
    draft step of 128 requests of 4,096 ids at a 32k vocabulary, one CPU thread; 15 ms)."""
    restricted = [shaping for shaping in shapings if shaping.params.allowed_token_ids]
    if not restricted:
        return
    vocab, device = logits.shape[-1], logits.device
    spans, rows, columns = [], [], []
    for shaping in restricted:
        ids = shaping.params.allowed_ids  # sorted
        ids = ids[:np.searchsorted(ids, vocab)]
        span = np.arange(shaping.start, shaping.start + shaping.rows)
        spans.append(span)
        rows.append(np.repeat(span, len(ids)))
        columns.append(np.tile(ids, shaping.rows))
    row_of = torch.from_numpy(np.concatenate(rows)).to(device)
    index = row_of * vocab + torch.from_numpy(np.concatenate(columns)).to(device)
    flat = logits.view(-1)
    held = flat.index_select(0, index)
    best = torch.full((len(logits),), float("-inf"), device=device).scatter_reduce_(
        0, row_of, held, "amax")  # [N]: each row's likeliest allowed logit
    span = torch.from_numpy(np.concatenate(spans)).to(device)
    logits.index_fill_(0, span[best[span] > float("-inf")], float("-inf"))
    flat.index_copy_(0, index, held)


def ban_words(logits: torch.Tensor, shapings: list[Shaping]) -> None:
    """vLLM's bad_words (its NoBadWordsLogitsProcessor) in place: in each row, the last
    token of every tokenized word whose other tokens end the output so far (recent + output
    + drafted[:r] for row r; a one-token word's in every row) at -inf, but for a row that
    would leave nothing (masked_unless_emptied)."""
    rows, columns = [], []
    vocab = logits.shape[-1]
    for shaping in shapings:
        if not shaping.params.bad_words_ids:
            continue
        if len(shaping.drafted) < shaping.rows - 1:
            raise ValueError(f"{shaping.rows} positions need the {shaping.rows - 1} tokens "
                             "drafted before them")
        reach = shaping.params.bad_words_reach
        tail = [*shaping.recent, *shaping.output[-reach:]][-reach:] if reach else []
        for row in range(shaping.rows):
            history = tail + list(shaping.drafted[:row])
            ends = [end for end in banned_after(shaping.params, history) if end < vocab]
            rows += [shaping.start + row] * len(ends)
            columns += ends
    masked_unless_emptied(logits, rows, columns)


def banned_after(params: SamplingParams, history: Sequence[int]):
    """The ids bad_words ban after `history` (the output so far): the last token of each word
    whose other tokens end it, by their number (SamplingParams.bad_word_ends)."""
    for length, banned in params.bad_word_ends.items():
        if length <= len(history):
            yield from banned.get(tuple(history[len(history) - length:]), ())


def unmasked_prefix(params: SamplingParams, context: Sequence[int], proposal: list[int],
                    prompt_len: int = 0) -> list[int]:
    """A model-free draft's longest prefix that allowed_token_ids and bad_words leave
    possible after the output so far, context[prompt_len:] (as ban_words reads it: the
    output's tokens, then the proposal's before each; only its last bad_words_reach are
    read, in place). A token they mask has p = 0 and is always rejected, so the
    tokens from it on are not worth verifying; cutting them changes no law (a mask that
    would empty a row is not applied: such a token is cut all the same, only a draft lost)."""
    if not (params.allowed_token_ids or params.bad_words_ids):
        return proposal
    allowed = params.allowed_set if params.allowed_token_ids else None
    reach = params.bad_words_reach
    history = list(context[max(prompt_len, len(context) - reach):]) if reach else []
    for index, token in enumerate(proposal):
        if (allowed is not None and token not in allowed) or token in banned_after(params, history):
            return proposal[:index]
        history.append(token)
    return proposal


def masked_unless_emptied(logits: torch.Tensor, rows: list[int], columns: list[int]) -> None:
    """The (row, column) entries at -inf in place, but in a row that would leave no finite
    logit (those keep their values): the entries are set, each row's maximum says whether it
    has a token left, and the entries of rows without one get their values back."""
    if not rows:
        return
    vocab = logits.shape[-1]
    flat, index = flat_entries(logits, rows, columns)
    held = flat.index_select(0, index)
    flat.index_fill_(0, index, float("-inf"))
    room = logits.amax(-1) > float("-inf")  # [N]: a row still has a token to take
    flat.index_copy_(0, index, torch.where(room[index // vocab], float("-inf"), held))


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
        flat, index = flat_entries(logits, rows, columns)
        flat.index_copy_(0, index, flat.index_select(0, index) + torch.tensor(
            values, dtype=torch.float32, device=logits.device))


def flat_entries(logits: torch.Tensor, rows: list[int], columns: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the [N, V] logits as one flat view, the flat indices of the (row, column) entries)."""
    device, vocab = logits.device, logits.shape[-1]
    return logits.view(-1), torch.tensor(rows, device=device) * vocab + torch.tensor(
        columns, device=device)


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
    amounts = np.concatenate([term[2] for term in terms], axis=1)  # [4, M]
    divisor, factor, frequency, presence = torch.from_numpy(amounts).to(logits.device)
    picked = flat.index_select(0, index)
    # each operation only where some request sets its penalty (a divisor or factor of 1,
    # and an amount of 0, keep a logit's bits)
    if any(shaping.params.repetition_penalty != 1 for shaping in shapings):
        picked = torch.where(picked > 0, picked / divisor, picked * factor)
    if any(shaping.params.frequency_penalty for shaping in shapings):
        picked = picked - frequency
    if any(shaping.params.presence_penalty for shaping in shapings):
        picked = picked - presence
    flat.index_copy_(0, index, picked)


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
    repetition = params.repetition_penalty != 1
    if shaping.seen is None:
        base, prompt = NOTHING_COUNTED, shaping.prompt if repetition else ()
    else:
        base, prompt = shaping.seen, ()
    seen = counted(base, prompt, shaping.output, steps)  # the steps counted per row below
    end = np.searchsorted(seen.columns, vocab)  # ids past V (a smaller draft vocabulary's)
    columns, prompted = seen.columns[:end], seen.prompted[:end]
    if not columns.size:
        return None
    counts = np.empty((rows, columns.size), dtype=np.float32)
    counts[:] = seen.counts[:end]
    for row, column in enumerate(np.searchsorted(columns, steps), start=1):
        counts[row:, column] += 1  # row r also counts drafted[:r]
    present = counts > 0
    terms = np.ones((4, rows, columns.size), dtype=np.float32)
    if repetition:
        marked = present | prompted  # every prompt id is a column
        terms[0][marked] = terms[1][marked] = params.repetition_penalty
    terms[2] = np.float32(params.frequency_penalty) * counts
    terms[3] = np.float32(params.presence_penalty) * present
    return (np.arange(shaping.start, shaping.start + rows)[:, None], columns[None],
            terms.reshape(4, -1))


def hold_ends(logits: torch.Tensor, shapings: list[Shaping]) -> None:
    """min_tokens in place: each Shaping's rows whose output so far is shorter than its
    min_tokens get its end ids at -inf, but for a row the mask would leave nothing (it keeps
    them: masked_unless_emptied): small operations and one pass over the logits, whatever
    the batch."""
    rows, columns = [], []
    vocab = logits.shape[-1]
    for shaping in shapings:
        short = min(shaping.params.min_tokens - shaping.output_len, shaping.rows)
        ends = [token for token in shaping.params.min_tokens_end_ids if token < vocab]
        for row in range(shaping.start, shaping.start + max(short, 0)):
            rows += [row] * len(ends)
            columns += ends
    masked_unless_emptied(logits, rows, columns)

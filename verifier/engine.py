"""The target engine: score K drafted tokens plus the position after them in ONE forward."""

import time
from dataclasses import replace
from itertools import accumulate

import torch

from engine.batch import UNFINISHED, run_alone
from engine.checkpoint import served_positions
from verifier import host
from verifier.prompt_scores import prompt_logprobs
from verifier.steps import Steps, check_steps
from verifier.trees import check_tree_call, matched, tree_scores_of
from engine.kv import SessionStore
from engine.runner import ModelRunner, serving_runner
from engine.scheduler import admitted, in_turns, prepare_within_budget
from speculative.checks import check_call, check_prompt_len
from speculative.token_masks import masked, request_matcher
from speculative.rejection import residual_rows
from speculative.sampling import grouped, logits_to_probs, sample_each, seeded_generator
from speculative.shaping import Shaping, committed_history, shape_batch
from speculative.types import (
    BatchLoad,
    DraftDists,
    PositionLogprobs,
    PromptLogprobs,
    ScoreCall,
    TargetScores,
    TreesUnsupported,
)


class ModelVerifier:
    """Holds the target model and each request's KV cache.

    A call first rolls the request's cache back to the committed prefix (the rejected suffix
    of the previous round is cropped away), or rebuilds it when the call carries the whole
    prefix, then feeds the newly committed tokens and x1..xK. The calls of a batch share ONE
    forward (`engine.batch`: their tokens packed, attention per request), so a call's answer
    is the same whichever calls it is batched with, up to float rounding (a matmul's kernel
    and blocking follow the batch's rows).
    """

    def __init__(self, model, *, max_cached_requests: int = 256,
                 max_cached_tokens: int | None = None, session_ttl_s: float | None = None,
                 engine: str = "auto", attention: str = "auto",
                 kv_cache_tokens: int | None = None, max_batch_tokens: int | None = None,
                 grammar_tokenizer=None, cuda_graphs: bool = True) -> None:
        """grammar_tokenizer: llguidance's tokenizer (speculative.grammar.ll_tokenizer), for
        structured outputs; without it a call with a grammar is refused."""
        # a runner already built (a check sharing one model between engines) or a model
        self.runner = model if isinstance(model, ModelRunner) else \
            serving_runner(model, engine, attention, kv_cache_tokens, max_cached_requests,
                           cuda_graphs=cuda_graphs)
        self.model = self.runner.model
        self.device = self.model.device  # transformers' property walks the parameters
        self.grammar_tokenizer = grammar_tokenizer
        self.max_batch_tokens = max_batch_tokens  # per forward; None: no chunked prefill
        self.max_positions = served_positions(self.model.config)
        # read once: transformers' config answers an attribute through its own
        # __getattribute__, about 1 us a read, on every call of a batch
        self.vocab_size = self.model.config.vocab_size
        self.sessions = SessionStore(max_cached_requests, max_cached_tokens, session_ttl_s)
        self.steps = Steps(self.sessions)  # the calls of several steps between two of them

    async def score(self, call: ScoreCall) -> TargetScores:
        return self.score_now(call)

    async def release(self, request_id: str) -> None:
        self.release_now(request_id)

    async def prompt_logprobs(self, request_id: str, token_ids: list[int],
                              top_n: int) -> PromptLogprobs:
        """The prompt's logprobs (verifier.prompt_scores), as a pool answers them."""
        return prompt_logprobs(self.model, token_ids, top_n, self.max_positions)

    def release_now(self, request_id: str) -> None:
        """The request's session and a call of several steps of it cut short between two
        (its caller gone)."""
        self.steps.forget(request_id)
        self.sessions.release(request_id)

    def score_now(self, call: ScoreCall) -> TargetScores:
        return run_alone(self.score_batch, call)

    @torch.inference_mode()  # no autograd bookkeeping on the batch's many small operations
    def score_batch(self, calls: list[ScoreCall]) -> list[TargetScores | Exception]:
        """Every call's TargetScores, or the ValueError / StaleBase that refused it (a
        RuntimeError: a sampled position without a law); a call of several steps runs its
        next step (verifier.steps) and answers UNFINISHED until its last."""
        steps = self.steps.current(calls)
        try:
            results = run_batch([step for step, _ in steps], self.prepare, self.runner,
                                self.finish, self.sessions, self.max_batch_tokens)
        except Exception:  # a failed forward leaves the batch's caches unknown: rebuild them
            for call in calls:
                self.steps.forget(call.request_id)
                self.sessions.drop(call.request_id)
            raise
        results = host.refusing_lawless(results, self.vocab_size)
        ends = self.steps.cohort_ends([(call, progress) for call, (_, progress)
                                       in zip(calls, steps)])
        return [self.steps.advance(call, result, progress, ends)
                for call, result, (_, progress) in zip(calls, results, steps)]

    def prepare(self, call: ScoreCall, limit: int | None = None):
        """Check the call and bring its sequence to the committed prefix: (segment,
        (q, history)), history the committed prefix as its shaping reads it
        (shaping_history); a feed longer than `limit` is cut (the segment asks no logits)
        and resumed by the same call."""
        vocab_size = self.vocab_size
        check_call(call.sync.new_token_ids + call.draft_token_ids
                   + call.sampling.shaping_ids[-1:],  # the largest (all are >= 0)
                   vocab_size, len(call.draft_token_ids))
        check_steps(call, vocab_size)
        if (call.sampling.logprobs or 0) > vocab_size:  # else its topk fails the batch
            raise ValueError(f"logprobs asks for the top {call.sampling.logprobs} tokens of a "
                             f"vocabulary of {vocab_size}")
        if max(call.sampling.logprob_token_ids, default=0) >= vocab_size:  # else its gather
            raise ValueError(f"logprob_token_ids past a vocabulary of {vocab_size}")
        drafted = list(call.draft_token_ids)
        if call.draft_parents is not None:
            check_tree_call(call)
            if not self.runner.scores_trees:
                raise TreesUnsupported("this verifier's engine (transformers' modeling with "
                                       f"sliding windows) {TreesUnsupported.reason}: draft a "
                                       "chain")
        draft_probs = None
        if not call.sampling.greedy and drafted and not matched(call):
            shape = None if call.draft_probs is None else call.draft_probs.shape
            if shape != (len(drafted), vocab_size):
                raise ValueError(f"sampling needs draft_probs of shape {(len(drafted), vocab_size)}"
                                 f", got {shape}")
            # the one dense [K, V] q of a round, checked before the cache is touched
            draft_probs = call.draft_probs.dense(self.device)
        length = call.sync.committed_len + len(drafted)
        check_prompt_len(call.prompt_len, call.sync.committed_len)
        if self.max_positions is not None and length > self.max_positions:
            raise ValueError(f"{length} tokens exceed the target's context of "
                             f"{self.max_positions} (max_position_embeddings, or LongRoPE's "
                             "original one)")
        sequence = self.sessions.resume(call.request_id, call) or \
            self.sessions.apply(call.request_id, call.sync, call.sampling.cache_salt)
        allowed = self.allowed(call, sequence, drafted)  # before the cache is touched
        segment = sequence.segment(self.runner, drafted, len(drafted) + 1, limit,
                                   call.draft_parents)
        sequence.unfinished = call if segment.num_logits == 0 else None
        return segment, (draft_probs, shaping_history(call, sequence), allowed, sequence)

    def allowed(self, call: ScoreCall, sequence, drafted: list[int]) -> torch.Tensor | None:
        """[K + 1, V] bool: what the request's grammar allows at each position, or None."""
        if call.sampling.grammar is None:
            return None
        matcher = request_matcher(sequence, call.sampling, self.grammar_tokenizer)
        return matcher.masks(sequence.committed[call.prompt_len:], drafted,
                             self.vocab_size, self.device)

    def finish(self, calls: list[ScoreCall], logits: list[torch.Tensor], extras: list
               ) -> list[TargetScores]:
        """Each call's scores from its logits [K + 1, V] (its drafted positions and the one
        after them). Sampled calls sharing a shape (chain or tree, K) and a law (temperature,
        top-k, top-p) turn their logits into probabilities together, and the chains among
        them draw together (draw_recovered_and_bonus): a few ops per batch, not per call. So
        do the greedy calls with as many rows: one argmax (greedy_scores)."""
        # masked by the grammar, the rows logprobs are read from (vLLM's raw_logprobs: after
        # the structured output's bitmask, before logit_bias, penalties and temperature)
        logits = [masked(rows, allowed) for rows, (_, _, allowed, _) in zip(logits, extras)]
        shaped = self.shaped(calls, logits, extras)
        scores: list = [None] * len(calls)
        probs: list = [None] * len(calls)
        for group in grouped([None if call.sampling.greedy else (
                call.draft_parents is None, len(call.draft_token_ids), call.sampling.law_key)
                for call in calls]):
            first = calls[group[0]]
            target_probs = logits_to_probs(torch.stack([shaped[i] for i in group]),
                                           first.sampling)  # [N, K + 1, V]
            for row, index in enumerate(group):
                probs[index] = target_probs[row]
            if first.draft_parents is None:  # chains: one draw over the group's rows
                draft_probs = None if not first.draft_token_ids else \
                    torch.stack([extras[i][0] for i in group])  # [N, K, V]
                drawn = draw_recovered_and_bonus(
                    target_probs, [list(calls[i].draft_token_ids) for i in group],
                    draft_probs, [calls[i].seed for i in group])
                for index, result in zip(group, drawn):
                    scores[index] = result
            else:
                for row, index in enumerate(group):
                    scores[index] = tree_scores_of(calls[index], target_probs[row],
                                                   extras[index][0])
        for group in grouped([len(shaped[i]) if call.sampling.greedy else None
                              for i, call in enumerate(calls)]):
            for index, result in zip(group, greedy_scores([shaped[i] for i in group])):
                scores[index] = result
        return [self.finished(call, scores[i], probs[i], raw, extra)
                for i, (call, raw, extra) in enumerate(zip(calls, logits, extras))]

    @staticmethod
    def shaped(calls: list[ScoreCall], logits: list[torch.Tensor], extras: list
               ) -> list[torch.Tensor]:
        """Each call's logits (masked by its grammar: finish) shaped by its logit_bias,
        penalties and min_tokens (row i counts the tokens drafted before it): the shaped
        calls' rows concatenated and shaped in place by shape_batch, in groups of at most
        SHAPED_GROUP_BYTES of logits."""
        logits = list(logits)
        groups: list[list[int]] = []  # the shaped calls, each group within the bytes
        size = 0
        for i, (_, history, _, _) in enumerate(extras):
            if history is None:
                continue
            nbytes = 4 * logits[i].numel()
            if groups and size + nbytes <= SHAPED_GROUP_BYTES:
                groups[-1].append(i)
                size += nbytes
            else:
                groups.append([i])
                size = nbytes
        for group in groups:
            sizes = [len(logits[i]) for i in group]
            batch = torch.cat([logits[i] for i in group]).float()  # this method's own copy
            batch = shape_batch(batch, [
                Shaping(start, rows, calls[i].sampling, drafted=calls[i].draft_token_ids,
                        **extras[i][1])
                for i, start, rows in zip(group, [0, *accumulate(sizes)], sizes)], in_place=True)
            for i, rows in zip(group, batch.split(sizes)):
                logits[i] = rows
        return logits

    @staticmethod
    def finished(call: ScoreCall, scores: TargetScores, target_probs, raw: torch.Tensor,
                 extra) -> TargetScores:
        """scores with what the call asked beside them: the bonus position's law, a tree's
        size, the prefix cache's hit, logprobs (of the raw logits, masked by the grammar)."""
        _, _, _, sequence = extra
        if call.return_bonus_probs and target_probs is not None:
            # the router tests a pre-drafted token against it
            scores = replace(scores, bonus_probs=DraftDists.of_row(target_probs[-1]).to("cpu"))
        if call.draft_parents is not None:
            scores = replace(scores, tree_nodes=len(call.draft_token_ids))
        if call.sampling.grammar_after:  # masked after the reasoning (allowed): said
            scores = replace(scores, grammar_gated=True,
                             grammar_at_gated=bool(call.sampling.grammar_at))
        if sequence.cached_tokens:  # reported once, by the call whose cache took them; a
            # rebuild may take its own output back too: usage counts the prompt's tokens
            scores = replace(scores, cached_tokens=min(sequence.cached_tokens, call.prompt_len))
            sequence.cached_tokens = 0
        if call.sampling.logprobs is None:
            return scores
        [scores] = host.to_host([scores])  # the logprobs need the chosen ids now
        tree = call.draft_parents is not None
        chosen = scores.target_token_ids if call.sampling.greedy or matched(call) else \
            scores.recovered_token_ids if tree else \
            scores.recovered_token_ids + (scores.bonus_token_id,)  # one per row either way
        drafted_rows = [parent + 1 for parent in call.draft_parents] if tree else None
        return replace(scores, logprobs=position_logprobs(
            raw, list(call.draft_token_ids), list(chosen), call.sampling.logprobs,
            drafted_rows, call.sampling.logprob_token_ids))


def greedy_scores(logits: list[torch.Tensor]) -> list[TargetScores]:
    """Each call's target argmax at each of its rows, from N calls' logits of equal shape
    [R, V]: one argmax over them, kept on the device (Parts of one [N, R] block) until the
    batch's one transfer."""
    ids = torch.stack(logits).argmax(-1)  # [N, R]
    if not host.deferred():
        return [TargetScores(target_token_ids=tuple(row)) for row in ids.tolist()]
    block = ids.double()  # ids < 2**53 travel exactly
    return [TargetScores(target_token_ids=host.Part(block, i, 0, block.shape[1]))
            for i in range(len(logits))]


def position_logprobs(logits: torch.Tensor, drafted: list[int], chosen: list[int],
                      top_n: int, drafted_rows: list[int] | None = None,
                      given: tuple[int, ...] = ()) -> PositionLogprobs:
    """The raw log-probabilities of [K + 1, V] logits at the drafted and the chosen tokens,
    and each row's top n (given: at those ids instead, in their order: vLLM's
    logprob_token_ids), with one transfer to the host (ids < 2**53 travel exactly as
    float64). drafted_rows: the row each drafted token is read at (a tree's: its parent's;
    None: a chain's, row i for token i)."""
    logprobs = torch.log_softmax(logits.float(), -1)
    k, device = len(drafted), logprobs.device
    rows = torch.arange(len(chosen), device=device)
    at = rows[:k] if drafted_rows is None else torch.tensor(drafted_rows, device=device)
    # a draw from a NaN row is id V (speculative.sampling.inverted), past the row's end: its
    # logprob is read at the last id (NaN either way), not out of bounds, which failed the
    # whole batch (on a GPU, a device-side assert); the call's answer never outputs it
    last = logprobs.shape[-1] - 1
    tokens = torch.tensor(drafted + [min(token, last) for token in chosen], dtype=torch.long,
                          device=device)
    if given:
        ids = torch.tensor(given, device=device).expand(logprobs.shape[0], -1)  # [K + 1, n]
        values, top_n = logprobs.gather(1, ids), len(given)
    else:
        values, ids = torch.topk(logprobs, top_n, dim=-1)  # [K + 1, n]
    host = torch.cat([logprobs[torch.cat([at, rows]), tokens].double(),
                      values.double().flatten(), ids.double().flatten()]).tolist()
    picked, values, ids = host[:2 * k + 1], host[2 * k + 1:][:(k + 1) * top_n], \
        host[2 * k + 1 + (k + 1) * top_n:]
    top = tuple(tuple((int(ids[r * top_n + i]), values[r * top_n + i]) for i in range(top_n))
                for r in range(k + 1))
    return PositionLogprobs(drafted=tuple(picked[:k]), chosen=tuple(picked[k:]), top=top)


# Shaped calls' logits are concatenated in groups of at most this many bytes: on a CPU a
# larger tensor is fresh pages at every allocation (one 42 MB copy took 22 ms, sixteen of
# 2.6 MB 5 ms: 16 calls x 5 rows of a 128k vocabulary, measured), and below it a group of a
# small vocabulary's calls is the whole batch.
SHAPED_GROUP_BYTES = 8 << 20


def shaping_history(call, sequence) -> dict | None:
    """Shaping's prompt, output and seen of the committed prefix when the call's sampling
    shapes the logits (speculative.shaping.committed_history), else None."""
    if not call.sampling.shapes_logits:
        return None
    return committed_history(call.sampling, call.prompt_len, sequence)


def run_batch(calls, prepare, runner, finish, sessions: SessionStore,
              max_tokens: int | None = None) -> list:
    """Each call's answer (or refusal): the calls in turns of one per request
    (engine.scheduler), each turn prepared within the token budget, admitted, one packed
    forward, finished together (finish(calls, logits, extras) -> scores); a call whose feed
    was cut answers UNFINISHED."""
    def one_turn(turn: list) -> list:
        started = time.perf_counter()
        results: list = [None] * len(turn)
        ready = prepare_within_budget(turn, prepare, results, max_tokens, lambda call: len(
            call.sync.new_token_ids) + len(call.draft_token_ids))
        # a cut feed (chunked prefill) reserves its call's whole feed at its first chunk:
        # refused, it is refused before any chunk is computed; admitted, a later chunk is
        # refused only to make room for an older request's call (engine.scheduler.admitted:
        # its progress lost with its session, rebuilt exact)
        ends = [segment.start + len(segment.token_ids) if segment.num_logits else
                turn[index].sync.committed_len + len(turn[index].draft_token_ids)
                for index, segment, _ in ready]
        ready = admitted(ready, [segment for _, segment, _ in ready], ends, turn, results,
                         sessions)
        if not ready:
            return results
        logits = runner.forward([segment for _, segment, _ in ready])
        load = BatchLoad(len(ready), sum(len(segment.token_ids) for _, segment, _ in ready))
        with host.one_transfer():  # the draws and picks of every call stay on the device...
            done = []  # (index, logits, extra) of the calls whose feed was not cut
            for (index, segment, extra), rows in zip(ready, logits):
                if segment.num_logits == 0:
                    results[index] = UNFINISHED
                else:
                    done.append((index, rows, extra))
            for (index, _, _), scores in zip(done, finish(
                    [turn[index] for index, _, _ in done], [rows for _, rows, _ in done],
                    [extra for _, _, extra in done])):
                results[index] = scores
        # ...and reach the host together: one sync, after which the time is the batch's
        return host.to_host(results, lambda: {
            "load": load, "compute_seconds": time.perf_counter() - started})

    def one_guarded_turn(turn: list) -> list:
        with sessions.batch(call.request_id for call in turn):
            return one_turn(turn)

    return in_turns(calls, one_guarded_turn)


def draw_recovered_and_bonus(target_probs, drafted: list[list[int]], draft_probs,
                             seeds: list[int]) -> list[TargetScores]:
    """For each of N chains of K drafted tokens: p_i(x_i), a residual draw per position and a
    bonus draw, all the router needs.

    target_probs: [N, K + 1, V]; draft_probs: [N, K, V] (None when K = 0), both on the
    model's device, where the draws run too (one draw over the N (K + 1) rows, one transfer
    to the host). Each chain draws its K + 1 uniforms from its own seeded generator, as
    sample_rows of its rows alone would, so its draws do not depend on the chains beside it.
    Every residual is drawn, used or not, so the draws do not depend on where the router's
    coins reject.
    """
    n, k = target_probs.shape[0], target_probs.shape[1] - 1
    device = target_probs.device
    rows = target_probs if k == 0 else \
        torch.cat([residual_rows(target_probs[:, :k], draft_probs), target_probs[:, k:]], 1)
    draws = sample_each(rows.flatten(0, 1), [seeded_generator(seed, device) for seed in seeds],
                        k + 1).view(n, k + 1)
    tokens = torch.tensor(drafted, dtype=torch.long, device=device).view(n, k, 1)
    at_draft = target_probs[:, :k].gather(2, tokens).squeeze(2)  # [N, K]
    # ids < 2**53 and probabilities travel exactly as float64
    block = torch.cat([draws.double(), at_draft.double()], 1)  # [N, 2K + 1]
    scores = [TargetScores(recovered_token_ids=host.Part(block, i, 0, k),
                           bonus_token_id=host.Part(block, i, k, k + 1, scalar=True),
                           draft_target_probs=host.Part(block, i, k + 1, 2 * k + 1))
              for i in range(n)]
    # a batch's calls reach the host with the batch's (verifier.host); a lone draw at once
    return scores if host.deferred() else host.to_host(scores)

"""A draft engine around any Hugging Face causal LM, with per-request KV caches."""

import time

import torch

from drafter.draft import Draft, processed
from engine.kv import SessionStore
from engine.runner import ModelRunner, serving_runner
from engine.batch import UNFINISHED, run_alone
from engine.scheduler import admitted, in_turns, prepare_within_budget
from speculative.checks import check_call, check_confidence, check_prompt_len, check_tree_width
from speculative.token_masks import matcher_after
from speculative.options import MAX_SPECULATIVE_TOKENS
from speculative.draft_truncation import kept_entries
from speculative.sampling import (
    fit_vocab,
    grouped,
    logits_to_probs,
    sample_each,
    sample_rows,
    seeded_generator,
)
from speculative.tree import allocate_siblings
from speculative.types import BatchLoad, DraftBlock, DraftDists, ProposeCall, StaleBase


class ModelDrafter:
    """Proposes K tokens autoregressively with the draft model.

    `vocab_size` is the vocabulary the pools agree on (the target's embedding rows; default:
    the draft's own). Each q may be made smaller for the wire before it is sampled from:
    `draft_top_k` > 0 keeps its top entries, `draft_q_mass` < 1 the fewest top entries that
    hold that mass (both: top-k first), and `draft_q_dtype` float16 rounds it to half
    precision. A truncated q is built sparse (ids and weights) without sorting the vocabulary,
    and a block travels in the smaller of its sparse and dense forms. The output stays exact
    because the token is drawn from the very q that is shipped. Past the draft's own context
    length it drafts nothing: those rounds are the target's alone.

    `draft_confidence` > 0 ends a block early (EAGLE-2's dynamic draft length) once the
    product of its drafted tokens' probabilities under the draft's own law (q as shipped;
    greedy: the shaped softmax) falls below it; a block keeps at least one token. The rule
    reads the draft's side only, so a shorter block is as exact as any K.
    """

    def __init__(self, model, *, vocab_size: int | None = None, max_cached_requests: int = 256,
                 draft_top_k: int = 0, draft_q_mass: float = 1.0,
                 draft_q_dtype: str = "float32", max_cached_tokens: int | None = None,
                 session_ttl_s: float | None = None, engine: str = "auto", attention: str = "auto",
                 kv_cache_tokens: int | None = None, grammar_tokenizer=None,
                 draft_confidence: float = 0.0, cuda_graphs: bool = True,
                 max_batch_tokens: int | None = None) -> None:
        """grammar_tokenizer: llguidance's tokenizer over `vocab_size` (the target's), for
        structured outputs; without it a request with a grammar gets no draft.
        max_batch_tokens: the tokens a batch's first forward feeds; a longer feed (a long
        prompt's prefill) is fed in chunks over several batches (None: no bound)."""
        # a runner already built (a check sharing one model between engines) or a model
        self.runner = model if isinstance(model, ModelRunner) else \
            serving_runner(model, engine, attention, kv_cache_tokens, max_cached_requests,
                           cuda_graphs=cuda_graphs)
        self.model = self.runner.model
        self.device = self.model.device  # transformers' property walks the parameters
        self.grammar_tokenizer = grammar_tokenizer
        self.vocab_size = vocab_size or self.model.config.vocab_size
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.draft_top_k, self.draft_q_mass = draft_top_k, draft_q_mass
        self.truncates = 0 < draft_top_k < self.vocab_size or draft_q_mass < 1
        self.draft_q_dtype = {"float32": torch.float32, "float16": torch.float16}[draft_q_dtype]
        self.sessions = SessionStore(max_cached_requests, max_cached_tokens, session_ttl_s)
        check_confidence(draft_confidence)
        self.draft_confidence = draft_confidence
        self.max_batch_tokens = max_batch_tokens

    async def propose(self, call: ProposeCall) -> DraftBlock:
        return self.propose_now(call)

    async def release(self, request_id: str) -> None:
        self.sessions.release(request_id)

    def propose_now(self, call: ProposeCall) -> DraftBlock:
        return run_alone(self.propose_batch, call)

    @torch.inference_mode()  # as ModelVerifier.score_batch
    def propose_batch(self, calls: list[ProposeCall]) -> list[DraftBlock | Exception]:
        """Every call's DraftBlock, or the ValueError / StaleBase that refused it. The calls
        draft together: step i is one forward over every call still drafting."""
        try:
            return self.draft_together(calls)
        except Exception:  # a failed forward leaves the batch's caches unknown: rebuild them
            for call in calls:
                self.sessions.drop(call.request_id)
            raise

    def draft_together(self, calls: list[ProposeCall]) -> list[DraftBlock | Exception]:
        """The calls in turns of one per request (engine.scheduler), each turn's drafts
        stepped together."""
        return in_turns(calls, self.draft_turn)

    def draft_turn(self, calls: list[ProposeCall]) -> list[DraftBlock | Exception]:
        with self.sessions.batch(call.request_id for call in calls):
            return self.draft_blocks(calls)

    def draft_blocks(self, calls: list[ProposeCall]) -> list[DraftBlock | Exception]:
        started = time.perf_counter()
        results: list = [None] * len(calls)
        drafts, prefills = self.start_drafts(calls, results)
        active, fed = self.first_feeds(drafts + prefills, calls, results)
        self.feed_only(fed, results)
        drafts = [(index, draft) for index, draft, _ in active]
        first_tokens = self.draft_steps(active)
        load = BatchLoad(len(drafts), first_tokens)
        elapsed = time.perf_counter() - started
        for index, draft in drafts:
            if draft.width > 1:
                self.add_siblings(draft)
            tokens, parents, q_rows = draft.tree()
            # q leaves the device here, on the worker thread, not on the event loop
            probs = DraftDists.stack(q_rows, self.vocab_size).compact().to("cpu") \
                if q_rows else None
            results[index] = DraftBlock(tokens, probs, elapsed, load=load, parents=parents,
                                        confidences=tuple(draft.confidences)
                                        if draft.reports else None)
        return results

    def start_drafts(self, calls: list[ProposeCall], results: list) -> tuple[list, list]:
        """(call index, Draft) of each call that drafts, and of each that drafts none but
        feeds its prefix (its empty block goes into `results` now); a refusal goes into
        `results`."""
        drafts, prefills = [], []
        for index, call in enumerate(calls):
            try:
                draft = self.start_draft(call)
            except (ValueError, StaleBase) as error:
                results[index] = error.with_traceback(None)  # keeps no frame alive
                continue
            if draft.num_tokens == 0:
                results[index] = DraftBlock((), None,
                                            context_full=self.room(draft.sequence, []) == 0)
                if self.room(draft.sequence, draft.assumed) != 0:
                    prefills.append((index, draft))
            else:
                drafts.append((index, draft))
        return drafts, prefills

    def room(self, sequence, assumed: list[int]) -> int | None:
        """Tokens the draft model's own context leaves to draft after the sequence and the
        assumed tokens (the last drafted token is never fed), None without a bound. None
        left (a target with a longer context): the call drafts nothing and feeds nothing,
        since a pool sized to that context (regions) would refuse the feed, and the
        request's later calls only grow it."""
        if self.max_positions is None:
            return None
        return max(0, self.max_positions + 1 - len(sequence.committed) - len(assumed))

    def first_feeds(self, drafts: list[tuple[int, "Draft"]], calls: list[ProposeCall],
                    results: list) -> tuple[list[tuple], list[tuple]]:
        """(call index, Draft, its first Segment) of each call that drafts now, and of each
        whose segment only feeds: a call that drafts none (a request's first, beside the
        target's first verify: its prefill overlaps the target's instead of adding to the
        round that drafts first), or one whose feed the batch's token budget cut (chunked
        prefill, as the verifier's: engine.scheduler; it answers UNFINISHED and the same
        call goes on from its cache in the next batch). The budget goes to the shortest
        feeds first; each call's cache reserves blocks for its whole block up front, in the
        order the calls came, or the call is refused in `results` (engine.scheduler.admitted).
        """
        # Feeding the committed tail also covers the "all K accepted" case: the drafter never
        # fed its own last token x_K, so it is fed now together with the bonus token (or, for
        # a pre-draft, together with the assumed block under verification).
        refused: list = [None] * len(drafts)  # the budget's order and cuts: the verifier's
        ready = prepare_within_budget(
            [draft for _, draft in drafts], lambda draft, limit: (draft.sequence.segment(
                self.runner, draft.assumed, 1, limit), None), refused, self.max_batch_tokens,
            lambda draft: len(draft.call.sync.new_token_ids) + len(draft.assumed))
        for (index, _), refusal in zip(drafts, refused):
            if refusal is not None:
                results[index] = refusal
        entries = [(*drafts[position], segment) for position, segment, _ in ready]
        entries.sort(key=lambda entry: entry[0])  # admitted in the order the calls came
        for _, draft, segment in entries:
            draft.sequence.unfinished = draft.call if segment.num_logits == 0 else None
        # the whole block's positions (its last token is never fed), a cut feed's too: as
        # the verifier's (engine.run_batch), a call is refused before its first chunk or not
        ends = [len(draft.sequence.committed) + len(draft.assumed) + max(draft.num_tokens, 1)
                - 1 for _, draft, _ in entries]
        entries = admitted(entries, [segment for _, _, segment in entries], ends, calls,
                           results, self.sessions)
        drafting, feeds = [], []
        for entry in entries:
            (drafting if entry[1].num_tokens and entry[2].num_logits else feeds).append(entry)
        return drafting, feeds

    def feed_only(self, fed: list[tuple], results: list) -> None:
        """One forward for the segments that only feed (first_feeds); their logits are not
        used. A cut feed answers UNFINISHED, a call that drafts none its empty block."""
        if not fed:
            return
        started = time.perf_counter()
        self.runner.forward([segment for _, _, segment in fed])
        elapsed = time.perf_counter() - started
        for index, _, segment in fed:
            results[index] = UNFINISHED if segment.num_logits == 0 else \
                DraftBlock((), None, elapsed)

    def draft_steps(self, active: list[tuple]) -> int:
        """Draft each (call index, Draft, Segment) to its full block: step i is one forward
        over every draft still drafting. Returns the tokens the first forward fed."""
        first_tokens = 0
        while active:
            segments = [segment for _, _, segment in active]
            first_tokens = first_tokens or sum(len(s.token_ids) for s in segments)
            logits = self.runner.forward(segments)
            drafts = [draft for _, draft, _ in active]
            # each draft's next position under its grammar and shaping, once for the step
            lines = processed(drafts, fit_vocab(torch.stack([rows[0] for rows in logits]),
                                                self.vocab_size))  # [drafts, V]
            tokens = self.next_tokens(drafts, lines)
            active, lines, tokens = self.without_lawless(active, lines, tokens)
            self.note_probs([draft for _, draft, _ in active], lines, tokens)
            still = []
            for (index, draft, _), token in zip(active, tokens):
                draft.took(token)
                if len(draft.token_ids) < draft.num_tokens and \
                        draft.confidence >= draft.threshold:
                    # the cache holds committed + assumed + the draft before `token`, which
                    # the step drew: it is fed next
                    still.append((index, draft, draft.sequence.next_segment(
                        self.runner, token)))
            active = still
        return first_tokens

    def without_lawless(self, active: list[tuple], lines: torch.Tensor, tokens: list[int]
                        ) -> tuple[list[tuple], torch.Tensor, list[int]]:
        """(active, lines, tokens) less the drafts whose step drew id V: a law holding NaN
        (the draft's logits NaN or inf: sampling.inverted) has no token to draw, so the
        block ends before the step, its q row dropped (shipped, id V failed the verify)."""
        kept = [row for row, token in enumerate(tokens) if token < self.vocab_size]
        if len(kept) == len(tokens):
            return active, lines, tokens
        for row in set(range(len(tokens))) - set(kept):
            active[row][1].q_rows.pop()
        return [active[row] for row in kept], lines[kept], [tokens[row] for row in kept]

    def note_probs(self, drafts: list["Draft"], lines: torch.Tensor, tokens: list[int]) -> None:
        """What a step's drafts whose block length follows their confidence (or that report
        it), or that are trees, keep of it: the drawn token's probability (and a greedy tree
        the ids its siblings will come from, not the logits); the others pay nothing."""
        rows = [i for i, draft in enumerate(drafts)
                if draft.width > 1 or draft.threshold > 0 or draft.reports]
        if not rows:
            return
        picked = [drafts[i] for i in rows]
        probs = self.drafted_probs(picked, lines[rows], [tokens[i] for i in rows])
        for draft, i, prob in zip(picked, rows, probs):
            draft.confidence *= prob
            if draft.reports:
                draft.confidences.append(draft.confidence)
            if draft.width > 1:  # a tree's siblings are drawn once the chain is
                # (a tree has no grammar or shaping: its line is the draft's own logits)
                top = lines[i].topk(draft.width).indices if draft.call.sampling.greedy else None
                draft.levels.append((prob, top))

    def drafted_probs(self, drafts: list["Draft"], lines: torch.Tensor,
                      tokens: list[int]) -> list[float]:
        """Each draft's probability of the token it has just drawn (before `took`), under
        its own law: q as it will ship when sampled, the shaped softmax of its line [V]
        (processed) when greedy."""
        probs = []
        for draft, line, token in zip(drafts, lines, tokens):
            if draft.call.sampling.greedy:
                probs.append(line.float().softmax(-1)[token])
                continue
            weights, ids = draft.q_rows[-1]
            weights = weights.float()
            drawn = weights[token] if ids is None else weights[ids == token].sum()
            probs.append(drawn / weights.sum())
        return torch.stack(probs).tolist()  # one host sync for the step

    def add_siblings(self, draft: "Draft") -> None:
        """A tree's other children at the main chain's nodes (speculative.tree), as many as
        its node budget allows, placed where the draft itself expects them to pay
        (allocate_siblings: reached and unsure), then drawn. Each count depends on the main
        chain's tokens, never on the siblings it places, so they keep the law they are
        tested under."""
        probs = [prob for prob, _ in draft.levels][:len(draft.token_ids)]
        nodes = min(draft.nodes or draft.width * len(draft.token_ids), MAX_SPECULATIVE_TOKENS)
        budget = nodes - len(draft.token_ids)  # a verifier scores at most that many
        counts = allocate_siblings(probs, draft.width - 1, budget)
        draft.siblings = [self.siblings(draft, level, count) if count else []
                          for level, count in enumerate(counts)]

    def siblings(self, draft: "Draft", level: int, others: int) -> list[int]:
        """`others` children besides the main chain's token at `level`: greedy, the next
        most likely tokens; sampled, drawn one after another from the same q with the ones
        before removed, the main token the first."""
        token = draft.token_ids[level]
        if draft.call.sampling.greedy:  # the level's top `width` ids, kept as it was drafted
            return [t for t in draft.levels[level][1].tolist() if t != token][:others]
        weights, ids = draft.q_rows[level]
        rest = weights.float().clone()
        drawn = []
        for _ in range(others):
            rest[(ids == token) if ids is not None else token] = 0
            if not rest.sum() > 0:
                break
            index = sample_rows(rest[None], draft.generator)
            token = int(index if ids is None else ids[index])
            drawn.append(token)
        return drawn

    def start_draft(self, call: ProposeCall) -> "Draft":
        check_call(call.sync.new_token_ids + call.assumed_token_ids
                   + call.sampling.shaping_ids[-1:],  # the largest (all are >= 0)
                   self.vocab_size, call.num_speculative_tokens)
        check_prompt_len(call.prompt_len, call.sync.committed_len)
        check_confidence(call.draft_confidence)
        if call.tree_width > 1:
            check_tree_width(call)  # before the session moves
        sequence = self.sessions.resume(call.request_id, call) or \
            self.sessions.apply(call.request_id, call.sync, call.sampling.cache_salt)
        assumed = list(call.assumed_token_ids)
        num_tokens = call.num_speculative_tokens
        if (room := self.room(sequence, assumed)) is not None:
            num_tokens = min(num_tokens, room)
        matcher = None
        if call.sampling.grammar is not None:  # follows the output and the assumed tokens
            if self.grammar_tokenizer is not None:
                matcher = matcher_after(sequence, call.sampling, self.grammar_tokenizer,
                                        sequence.committed[call.prompt_len:] + assumed)
            if matcher is None:
                num_tokens = 0
        width = call.tree_width
        if width > 1:
            if self.max_positions is not None and len(sequence.committed) + \
                    (call.tree_nodes or width * num_tokens) > self.max_positions:
                width = 1  # the nodes would pass the context's end: a chain fits
        threshold = self.draft_confidence if call.draft_confidence is None else \
            call.draft_confidence
        return Draft(call, sequence, assumed, num_tokens,
                     seeded_generator(call.seed, self.device), matcher=matcher,
                     width=width, nodes=call.tree_nodes, threshold=threshold,
                     reports=call.draft_confidence is not None)

    def next_tokens(self, drafts: list["Draft"], lines: torch.Tensor) -> list[int]:
        """Each draft's next token from its line [V] (its logits under its grammar and
        shaping: processed), one host sync for the step (and one per batch cut by top-k):
        greedy drafts take their argmax together (no q); sampled ones draw from the q they
        ship, those sharing a law as one batch of rows."""
        greedy = [row for row, draft in enumerate(drafts) if draft.call.sampling.greedy]
        # [greedy drafts]; when all are, the lines themselves, not an indexed copy
        parts = [(lines if len(greedy) == len(drafts) else lines[greedy]).argmax(-1)] \
            if greedy else []
        sampled = []  # alone: any draft when q is cut by mass (rows of any length)
        for rows in grouped([None if draft.call.sampling.greedy else (row,)
                             if self.draft_q_mass < 1 else draft.call.sampling.law_key
                             for row, draft in enumerate(drafts)]):
            sampled += rows
            parts.append(self.draw_from([drafts[row] for row in rows], logits_to_probs(
                lines[rows], drafts[rows[0]].call.sampling)))
        by_row = dict(zip(greedy + sampled, torch.cat(parts).tolist()))
        return [int(by_row[row]) for row in range(len(drafts))]

    def draw_from(self, drafts: list["Draft"], probs: torch.Tensor) -> torch.Tensor:
        """[R] tokens on the device, each row of [R, V] probs drawn with its draft's generator
        through the q it ships (kept in its q_rows); rows cut to different lengths one by one."""
        weights, ids = self.shipped_q(probs)
        if weights is None:
            return torch.cat([self.draw_from([d], row[None]) for d, row in zip(drafts, probs)])
        index = sample_each(weights.float(), [draft.generator for draft in drafts])  # [R]
        for row, draft in enumerate(drafts):
            draft.q_rows.append((weights[row], None if ids is None else ids[row]))
        return index if ids is None else ids.gather(-1, index[:, None]).squeeze(-1)

    def shipped_q(self, probs: torch.Tensor) -> tuple:
        """[R, V] q as it travels (the wire's precision): (weights [R, m], ids [R, m]) cut and
        renormalised, (weights [R, V], None) uncut, (None, None) for rows cut unequally."""
        if not self.truncates:
            return probs.to(self.draft_q_dtype), None
        if len(probs) == 1:
            values, ids = kept_entries(probs[0], self.draft_top_k, self.draft_q_mass)
            if not len(values):  # a NaN row keeps nothing: dense, it draws id V (refused)
                return probs.to(self.draft_q_dtype), None
            return (values / values.sum()).to(self.draft_q_dtype)[None], ids[None]
        if self.draft_q_mass < 1 or not 0 < self.draft_top_k < probs.shape[-1]:
            return None, None
        values, ids = torch.topk(probs, self.draft_top_k)
        if not bool((values > 0).all()):  # one host sync
            return None, None
        values = values / values.sum(-1, keepdim=True)  # as kept_entries, then renormalised
        return (values / values.sum(-1, keepdim=True)).to(self.draft_q_dtype), ids

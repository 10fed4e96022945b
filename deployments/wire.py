"""Conversions between the loop's dataclasses and the protobuf messages of specserve.proto.

A pool checks every message against its limits (deployments.limits) before it decodes it.
"""

import threading
from collections import OrderedDict

from deployments.wire_tensors import dists_from_proto, dists_to_proto
from protos import specserve_pb2 as pb
from speculative.checks import check_tree
from speculative.sampling import SamplingParams
from speculative.tree import check_confidences
from speculative.types import (
    BatchLoad,
    DraftBlock,
    DraftDists,
    PositionLogprobs,
    PrefixSync,
    PromptLogprobs,
    ProposeCall,
    ScoreCall,
    StaleBase,
    TargetScores,
    TokenLogprob,
)

def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        logprobs=params.logprobs is not None, top_logprobs=params.logprobs or 0,
        grammar=params.grammar or "", logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens, min_tokens_end_ids=params.min_tokens_end_ids,
        cache_salt=params.cache_salt, allowed_token_ids=params.allowed_token_ids,
        bad_words=[pb.TokenIds(ids=word) for word in params.bad_words_ids],
        logprob_token_ids=params.logprob_token_ids, grammar_after_ids=params.grammar_after,
        grammar_at_ids=params.grammar_at,
    )


def sampling_from_proto(message: pb.SamplingParams) -> SamplingParams:
    """Validated: a bad value raises ValueError (the servicer's INVALID_ARGUMENT)."""
    return SamplingParams(
        temperature=message.temperature, top_k=message.top_k, top_p=message.top_p or 1.0,
        min_p=message.min_p, presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty or 1.0,
        logprobs=message.top_logprobs if message.logprobs else None,
        grammar=message.grammar or None,
        logit_bias=tuple(sorted(message.logit_bias.items())), min_tokens=message.min_tokens,
        min_tokens_end_ids=tuple(message.min_tokens_end_ids), cache_salt=message.cache_salt,
        allowed_token_ids=tuple(message.allowed_token_ids),
        bad_words_ids=tuple(tuple(word.ids) for word in message.bad_words),
        logprob_token_ids=tuple(message.logprob_token_ids),
        grammar_after=tuple(message.grammar_after_ids), grammar_at=tuple(message.grammar_at_ids),
    )


class SessionSampling:
    """A pool replica's copy of each session's sampling parameters, validated once: a
    message that carries them (a session's start, or a rebuild) sets them; one that leaves
    them out gets its session's. Bounded, least recently used first out: a call whose
    session's parameters are gone is answered REBUILD, and the router's resend of the whole
    prefix brings them again (exact: a cache miss)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.params: OrderedDict[str, SamplingParams] = OrderedDict()

    def of(self, message: pb.ProposeRequest | pb.ScoreRequest) -> SamplingParams:
        """The call's parameters; ValueError when they are malformed, StaleBase when the
        message leaves them out and the session's are not here."""
        request_id = message.request_id
        if message.HasField("sampling"):
            self.params[request_id] = sampling_from_proto(message.sampling)
            if len(self.params) > self.capacity:
                self.params.popitem(last=False)
        elif request_id not in self.params:
            raise StaleBase(f"no sampling parameters held for {request_id!r}")
        self.params.move_to_end(request_id)
        return self.params[request_id]

    def forget(self, request_id: str) -> None:
        self.params.pop(request_id, None)

    def __len__(self) -> int:
        return len(self.params)


# a whole-prefix sync's ids made into a message once for the choices that share their tuple
# (speculative.state.PoolView.prefix_sync: one request's prompt), then copied into each call's
# (128k tokens: 2.1 ms to make and 1.5 to nest, against 0.7 to copy); held by the tuple's
# identity (the entry keeps the tuple: its id stays its own), the last few prompts long enough
# for it to matter
SHARED_SYNC_TOKENS = 1024
SHARED_SYNC_PROMPTS = 4


class SharedSyncs:
    """The messages of the last few long whole-prefix syncs, by their ids' tuple."""

    def __init__(self, capacity: int = SHARED_SYNC_PROMPTS,
                 min_tokens: int = SHARED_SYNC_TOKENS) -> None:
        self.capacity, self.min_tokens = capacity, min_tokens
        self.held: OrderedDict[int, tuple[tuple, pb.PrefixSync]] = OrderedDict()
        self.lock = threading.Lock()  # the router's loop alone, but a bench may use threads

    def ids(self, token_ids) -> pb.PrefixSync | None:
        """A message with token_ids as its new_token_ids (and nothing else) for a long tuple,
        made at its first use; None for another (then made in place)."""
        if not isinstance(token_ids, tuple) or len(token_ids) < self.min_tokens:
            return None
        key = id(token_ids)
        with self.lock:
            held = self.held.get(key)
            if held is not None and held[0] is token_ids:
                self.held.move_to_end(key)
                return held[1]
        message = pb.PrefixSync(new_token_ids=token_ids)
        with self.lock:
            self.held[key] = (token_ids, message)
            self.held.move_to_end(key)
            while len(self.held) > self.capacity:
                self.held.popitem(last=False)
        return message


SHARED_SYNCS = SharedSyncs()


def fill_sync(message: pb.PrefixSync, sync: PrefixSync) -> None:
    """Set a call's (empty) sync field to `sync`."""
    shared = SHARED_SYNCS.ids(sync.new_token_ids) if sync.known_len == 0 else None
    if shared is not None:
        message.CopyFrom(shared)
    else:
        message.new_token_ids.extend(sync.new_token_ids)
    message.known_len, message.known_hash = sync.known_len, sync.known_hash
    message.admitted_at = sync.admitted_at


def sync_to_proto(sync: PrefixSync) -> pb.PrefixSync:
    message = pb.PrefixSync()
    fill_sync(message, sync)
    return message


def sync_from_proto(message: pb.PrefixSync) -> PrefixSync:
    return PrefixSync(message.known_len, message.known_hash, tuple(message.new_token_ids),
                      message.admitted_at)


def session_sampling(call: ProposeCall | ScoreCall) -> pb.SamplingParams | None:
    """The sampling parameters a call carries: those of a call that starts the pool's
    session (its sync carries the whole prefix); the others leave them out (the pool keeps
    them with the session, and a pool that lost them answers REBUILD)."""
    return sampling_to_proto(call.sampling) if call.sync.known_len == 0 else None


def propose_to_proto(call: ProposeCall) -> pb.ProposeRequest:
    message = pb.ProposeRequest(
        request_id=call.request_id,
        num_speculative_tokens=call.num_speculative_tokens,
        sampling=session_sampling(call),
        seed=call.seed,
        assumed_token_ids=call.assumed_token_ids,
        prompt_len=call.prompt_len,
        tree_width=call.tree_width,
        tree_nodes=call.tree_nodes,
        draft_confidence=call.draft_confidence,
    )
    fill_sync(message.sync, call.sync)  # in place: passed nested, it was copied once more
    return message


def propose_from_proto(message: pb.ProposeRequest,
                       sampling: SamplingParams | None = None) -> ProposeCall:
    """sampling: the session's, when the message leaves them out (else the message's)."""
    return ProposeCall(
        request_id=message.request_id,
        sync=sync_from_proto(message.sync),
        num_speculative_tokens=message.num_speculative_tokens,
        sampling=sampling or sampling_from_proto(message.sampling),
        seed=message.seed,
        assumed_token_ids=tuple(message.assumed_token_ids),
        prompt_len=message.prompt_len,
        tree_width=max(1, message.tree_width),
        tree_nodes=message.tree_nodes,
        draft_confidence=message.draft_confidence if message.HasField("draft_confidence")
        else None,
    )


def block_to_proto(block: DraftBlock) -> pb.ProposeResponse:
    response = pb.ProposeResponse(token_ids=block.token_ids, parents=block.parents or (),
                                  compute_us=round(block.compute_seconds * 1e6),
                                  confidences=block.confidences or (),
                                  context_full=block.context_full)
    if block.draft_probs is not None:
        response.draft_probs.CopyFrom(dists_to_proto(block.draft_probs))
    if block.load is not None:
        response.load.CopyFrom(load_to_proto(block.load))
    return response


def block_from_proto(message: pb.ProposeResponse, wire_bytes: int = 0) -> DraftBlock:
    """The block of an answer; wire_bytes: its call's and its own serialised size."""
    probs = dists_from_proto(message.draft_probs) if message.HasField("draft_probs") else None
    if probs is not None:
        check_block_q(message.token_ids, probs)
    parents = tuple(message.parents) or None
    if parents is not None:
        check_tree(parents, len(message.token_ids))
    confidences = tuple(message.confidences) or None
    check_confidences(confidences, parents, len(message.token_ids))
    return DraftBlock(tuple(message.token_ids), probs, message.compute_us / 1e6,
                      load=load_from_proto(message), parents=parents,
                      confidences=confidences, wire_bytes=wire_bytes,
                      context_full=message.context_full)


def check_block_q(token_ids, probs: DraftDists) -> None:
    """ValueError unless q has a row per drafted token (node) and holds each in its vocabulary
    (else the verifier, or accept(), refused the round: the request failed, not its draft)."""
    if len(probs) != len(token_ids) or token_ids and not \
            0 <= min(token_ids) <= max(token_ids) < probs.vocab_size:
        raise ValueError(f"draft_probs ({len(probs)} rows over {probs.vocab_size} ids) unlike "
                         f"the {len(token_ids)} drafted tokens")


def load_to_proto(load: BatchLoad) -> pb.BatchLoad:
    return pb.BatchLoad(batch_size=load.batch_size, batch_tokens=load.batch_tokens)


def load_from_proto(message) -> BatchLoad | None:
    if not message.HasField("load"):
        return None
    return BatchLoad(message.load.batch_size, message.load.batch_tokens)


def score_to_proto(call: ScoreCall) -> pb.ScoreRequest:
    message = pb.ScoreRequest(
        request_id=call.request_id,
        draft_token_ids=call.draft_token_ids,
        sampling=session_sampling(call),
        seed=call.seed,
        prompt_len=call.prompt_len,
        return_bonus_probs=call.return_bonus_probs,
        draft_parents=call.draft_parents or (),
        steps=call.steps if call.steps > 1 else 0,
        stop_token_ids=call.stop_token_ids if call.steps > 1 else (),
    )
    fill_sync(message.sync, call.sync)
    if call.draft_probs is not None:
        message.draft_probs.CopyFrom(dists_to_proto(call.draft_probs))
    return message


def score_from_proto(message: pb.ScoreRequest,
                     sampling: SamplingParams | None = None) -> ScoreCall:
    """sampling: the session's, when the message leaves them out (else the message's)."""
    has_probs = message.HasField("draft_probs")
    return ScoreCall(
        request_id=message.request_id,
        sync=sync_from_proto(message.sync),
        draft_token_ids=tuple(message.draft_token_ids),
        sampling=sampling or sampling_from_proto(message.sampling),
        draft_probs=dists_from_proto(message.draft_probs) if has_probs else None,
        seed=message.seed,
        prompt_len=message.prompt_len,
        return_bonus_probs=message.return_bonus_probs,
        draft_parents=tuple(message.draft_parents) or None,
        steps=message.steps or 1,
        stop_token_ids=tuple(message.stop_token_ids),
    )


def scores_to_proto(scores: TargetScores) -> pb.ScoreResponse:
    response = pb.ScoreResponse(compute_us=round(scores.compute_seconds * 1e6),
                                cached_tokens=scores.cached_tokens,
                                tree_nodes=scores.tree_nodes,
                                continued_token_ids=scores.continued_token_ids,
                                grammar_gated=scores.grammar_gated,
                                grammar_at_gated=scores.grammar_at_gated)
    if scores.accept_probs:  # a sampled tree
        response.sampled.accept_probs.extend(scores.accept_probs)
        response.sampled.recovered_token_ids.extend(scores.recovered_token_ids)
    elif scores.bonus_token_id is None:
        response.greedy.target_token_ids.extend(scores.target_token_ids)
    else:
        response.sampled.draft_target_probs.extend(scores.draft_target_probs)
        response.sampled.recovered_token_ids.extend(scores.recovered_token_ids)
        response.sampled.bonus_token_id = scores.bonus_token_id
        if scores.bonus_probs is not None:
            response.sampled.bonus_probs.CopyFrom(dists_to_proto(scores.bonus_probs))
    if scores.load is not None:
        response.load.CopyFrom(load_to_proto(scores.load))
    if scores.logprobs is not None:
        response.logprobs.CopyFrom(logprobs_to_proto(scores.logprobs))
    return response


def logprobs_to_proto(logprobs: PositionLogprobs) -> pb.PositionLogprobs:
    top_n = len(logprobs.top[0]) if logprobs.top else 0
    return pb.PositionLogprobs(
        drafted=logprobs.drafted, chosen=logprobs.chosen, top_n=top_n,
        top_ids=[token for row in logprobs.top for token, _ in row],
        top_logprobs=[logprob for row in logprobs.top for _, logprob in row])


def logprobs_from_proto(message: pb.ScoreResponse) -> PositionLogprobs | None:
    if not message.HasField("logprobs"):
        return None
    got, n = message.logprobs, message.logprobs.top_n
    positions = len(got.chosen)
    if positions != len(got.drafted) + 1 or len(got.top_ids) != positions * n \
            or len(got.top_logprobs) != positions * n:
        raise ValueError("logprobs shaped unlike their K + 1 positions")
    pairs = list(zip(got.top_ids, got.top_logprobs))
    return PositionLogprobs(tuple(got.drafted), tuple(got.chosen),
                            tuple(tuple(pairs[r * n:(r + 1) * n]) for r in range(positions)))


def scores_from_proto(message: pb.ScoreResponse, wire_bytes: int = 0) -> TargetScores:
    """The scores of an answer; wire_bytes: its call's and its own serialised size."""
    timing = {"compute_seconds": message.compute_us / 1e6, "load": load_from_proto(message),
              "logprobs": logprobs_from_proto(message), "cached_tokens": message.cached_tokens,
              "tree_nodes": message.tree_nodes, "wire_bytes": wire_bytes,
              "continued_token_ids": tuple(message.continued_token_ids),
              "grammar_gated": message.grammar_gated,
              "grammar_at_gated": message.grammar_at_gated}
    kind = message.WhichOneof("scores")
    if kind == "greedy":
        return TargetScores(target_token_ids=tuple(message.greedy.target_token_ids), **timing)
    if kind == "sampled":
        sampled = message.sampled
        if sampled.accept_probs:  # a tree: one draw per row
            if len(sampled.recovered_token_ids) != len(sampled.accept_probs) + 1:
                raise ValueError("a tree's scores need one draw per row")
            return TargetScores(accept_probs=tuple(sampled.accept_probs),
                                recovered_token_ids=tuple(sampled.recovered_token_ids),
                                **timing)
        bonus_probs = None
        if sampled.HasField("bonus_probs"):
            bonus_probs = dists_from_proto(sampled.bonus_probs)
            if len(bonus_probs) != 1:
                raise ValueError("bonus_probs must be one row, p(K+1)")
        return TargetScores(draft_target_probs=tuple(sampled.draft_target_probs),
                            recovered_token_ids=tuple(sampled.recovered_token_ids),
                            bonus_token_id=sampled.bonus_token_id, bonus_probs=bonus_probs,
                            **timing)
    raise ValueError("a score response without scores")


def prompt_logprobs_to_proto(scores: PromptLogprobs, top_n: int) -> pb.PromptLogprobsResponse:
    return pb.PromptLogprobsResponse(
        logprobs=[entry.logprob for entry in scores.entries], ranks=scores.ranks, top_n=top_n,
        top_ids=[token for entry in scores.entries for token, _ in entry.top],
        top_logprobs=[logprob for entry in scores.entries for _, logprob in entry.top])


def prompt_logprobs_from_proto(message: pb.PromptLogprobsResponse,
                               token_ids: list[int]) -> PromptLogprobs:
    """The logprobs of the prompt `token_ids` the message answers (rows: its tokens after
    the first), checked for their shape."""
    rows, top_n = len(token_ids) - 1, message.top_n
    if not len(message.logprobs) == len(message.ranks) == rows or \
            not len(message.top_ids) == len(message.top_logprobs) == rows * top_n:
        raise ValueError(f"prompt logprobs of {len(message.logprobs)} rows of {top_n} for a "
                         f"prompt of {len(token_ids)} tokens")
    ids, values = list(message.top_ids), list(message.top_logprobs)
    entries = tuple(TokenLogprob(token_ids[r + 1], message.logprobs[r], tuple(
        zip(ids[r * top_n:(r + 1) * top_n], values[r * top_n:(r + 1) * top_n])))
        for r in range(rows))
    return PromptLogprobs(entries, tuple(message.ranks))

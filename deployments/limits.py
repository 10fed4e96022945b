"""What a pool accepts, checked on a message before it is decoded: sizes, shapes, ids and
lengths come from message fields a caller controls, so a few kilobytes must not be able to
ask for gigabytes, or queue a call the engine will refuse. And the bounds on the messages
of a stream."""

from dataclasses import dataclass

from protos import specserve_pb2 as pb
from speculative.checks import check_call
from speculative.options import MAX_SPECULATIVE_TOKENS
from speculative.sampling import MAX_LOGPROBS

MAX_REQUEST_ID_CHARS = 256
# a prompt logprobs answer's row at its largest: its logprob and rank, and MAX_LOGPROBS top
# ids and logprobs (a float 4 bytes, an id or rank a varint of up to 5)
PROMPT_LOGPROBS_ROW_BYTES = 9 + 9 * MAX_LOGPROBS


@dataclass(frozen=True)
class Limits:
    """What a pool accepts: the vocabulary both pools agree on (the target's), the longest
    committed prefix plus draft (the target's context) and the largest K."""

    vocab_size: int
    context: int | None
    max_speculative_tokens: int = MAX_SPECULATIVE_TOKENS

    def message_bytes(self) -> int:
        """The largest legal message: a dense float32 q with its ids over K + 1 positions,
        a whole context of ids, and room for the rest; or a whole context's prompt
        logprobs, with their top MAX_LOGPROBS."""
        positions = self.max_speculative_tokens + 1
        context = self.context or 0
        return max(positions * self.vocab_size * 8 + 5 * context,
                   PROMPT_LOGPROBS_ROW_BYTES * context) + (1 << 16)

    def stream_message_bytes(self) -> int:
        """The largest message of a pool's direct stream: one legal call (or answer), or
        calls packed up to STREAM_MESSAGE_BYTES (their framing and cancels beside them)."""
        return max(self.message_bytes(), STREAM_MESSAGE_BYTES + (1 << 20))


# a stream message carries the calls (or answers) that wait together, as many as fit this
# budget; a call larger than it goes alone (a pool's port takes any one legal call, and a
# message of this budget: Limits.stream_message_bytes)
STREAM_MESSAGE_BYTES = 4 << 20


def in_messages(items: list, budget: int = STREAM_MESSAGE_BYTES) -> list[list]:
    """items (protobuf messages) in order, cut into runs whose sizes add up to at most
    budget (an item larger than it alone in its run)."""
    if len(items) <= 1:
        return [items]
    runs, run, size = [], [], 0
    for item in items:
        item_size = item.ByteSize()
        if run and size + item_size > budget:
            runs.append(run)
            run, size = [], 0
        run.append(item)
        size += item_size
    runs.append(run)
    return runs


def message_size_options(max_bytes: int) -> list[tuple[str, int]]:
    """gRPC server or channel options bounding messages both ways to max_bytes."""
    return [("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes)]


def check_request(request_id: str, sync: pb.PrefixSync, token_ids, k: int,
                  limits: Limits) -> None:
    """ValueError unless the call's id, prefix, ids (the new committed ones and token_ids:
    drafted or assumed) and K are within `limits`."""
    check_request_id(request_id)
    most = limits.max_speculative_tokens
    if not 0 <= k <= most or len(token_ids) > most:
        raise ValueError(f"at most {most} speculative tokens, got {max(k, len(token_ids))}")
    length = sync.known_len + len(sync.new_token_ids) + len(token_ids)
    if sync.known_len < 0 or limits.context is not None and length > limits.context:
        raise ValueError(f"the prefix and draft ({length} tokens) exceed the context of "
                         f"{limits.context}")
    check_call(list(sync.new_token_ids) + list(token_ids), limits.vocab_size)


def check_request_id(request_id: str) -> None:
    """ValueError unless a call's (or a release's) request_id is 1 to MAX_REQUEST_ID_CHARS
    characters."""
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} characters")


def check_dists(message: pb.Distributions, positions: int, vocab_size: int) -> None:
    """ValueError unless q is [positions, entries] over this vocabulary, dense or sparse."""
    if message.vocab_size != vocab_size:
        raise ValueError(f"draft_probs.vocab_size is {message.vocab_size}, this pool's "
                         f"vocabulary has {vocab_size}")
    shape = list(message.probs.shape)
    if len(shape) != 2 or shape[0] != positions or not 0 <= shape[1] <= vocab_size:
        raise ValueError(f"draft_probs must be [{positions}, <= {vocab_size}], got {shape}")
    if message.HasField("ids"):
        if list(message.ids.shape) != shape:
            raise ValueError("draft_probs.ids must have the shape of draft_probs.probs")
    elif shape[1] != vocab_size:
        raise ValueError(f"dense draft_probs must have {vocab_size} entries per position")


def check_prompt_logprobs(message: pb.PromptLogprobsRequest, limits: Limits) -> None:
    """ValueError unless the prompt's id and ids (at least one, within the vocabulary and
    the context) and its top n (at most MAX_LOGPROBS) are within `limits`."""
    check_request(message.request_id, pb.PrefixSync(new_token_ids=message.token_ids), (), 0,
                  limits)
    if not message.token_ids:
        raise ValueError("prompt logprobs need a prompt of at least one token")
    if message.top_n > MAX_LOGPROBS:
        raise ValueError(f"prompt logprobs take a top n of at most {MAX_LOGPROBS}, got "
                         f"{message.top_n}")


def check_propose(message: pb.ProposeRequest, limits: Limits) -> None:
    check_request(message.request_id, message.sync, message.assumed_token_ids,
                  message.num_speculative_tokens, limits)


def check_score(message: pb.ScoreRequest, limits: Limits) -> None:
    check_request(message.request_id, message.sync, message.draft_token_ids, 0, limits)
    if message.HasField("draft_probs"):
        check_dists(message.draft_probs, len(message.draft_token_ids), limits.vocab_size)

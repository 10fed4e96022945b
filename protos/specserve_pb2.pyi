from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[Status]
    REBUILD: _ClassVar[Status]
OK: Status
REBUILD: Status

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Distributions(_message.Message):
    __slots__ = ("ids", "probs", "vocab_size")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ids: Tensor
    probs: Tensor
    vocab_size: int
    def __init__(self, ids: _Optional[_Union[Tensor, _Mapping]] = ..., probs: _Optional[_Union[Tensor, _Mapping]] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "grammar", "logit_bias", "min_tokens", "min_tokens_end_ids", "min_p", "cache_salt", "allowed_token_ids", "bad_words", "logprob_token_ids", "grammar_after_ids", "grammar_at_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_END_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_AFTER_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_AT_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: bool
    top_logprobs: int
    grammar: str
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    min_tokens_end_ids: _containers.RepeatedScalarFieldContainer[int]
    min_p: float
    cache_salt: str
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar_after_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar_at_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., min_tokens_end_ids: _Optional[_Iterable[int]] = ..., min_p: _Optional[float] = ..., cache_salt: _Optional[str] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., logprob_token_ids: _Optional[_Iterable[int]] = ..., grammar_after_ids: _Optional[_Iterable[int]] = ..., grammar_at_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefixSync(_message.Message):
    __slots__ = ("known_len", "known_hash", "new_token_ids", "admitted_at")
    KNOWN_LEN_FIELD_NUMBER: _ClassVar[int]
    KNOWN_HASH_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    known_len: int
    known_hash: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    admitted_at: float
    def __init__(self, known_len: _Optional[int] = ..., known_hash: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., admitted_at: _Optional[float] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("request_id", "sync", "num_speculative_tokens", "sampling", "seed", "assumed_token_ids", "prompt_len", "tree_width", "tree_nodes", "draft_confidence")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sync: PrefixSync
    num_speculative_tokens: int
    sampling: SamplingParams
    seed: int
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    tree_width: int
    tree_nodes: int
    draft_confidence: float
    def __init__(self, request_id: _Optional[str] = ..., sync: _Optional[_Union[PrefixSync, _Mapping]] = ..., num_speculative_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ..., tree_width: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., draft_confidence: _Optional[float] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("status", "token_ids", "draft_probs", "replica_id", "direct_address", "compute_us", "load", "parents", "confidences", "context_full")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FULL_FIELD_NUMBER: _ClassVar[int]
    status: Status
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: Distributions
    replica_id: str
    direct_address: str
    compute_us: int
    load: BatchLoad
    parents: _containers.RepeatedScalarFieldContainer[int]
    confidences: _containers.RepeatedScalarFieldContainer[float]
    context_full: bool
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[Distributions, _Mapping]] = ..., replica_id: _Optional[str] = ..., direct_address: _Optional[str] = ..., compute_us: _Optional[int] = ..., load: _Optional[_Union[BatchLoad, _Mapping]] = ..., parents: _Optional[_Iterable[int]] = ..., confidences: _Optional[_Iterable[float]] = ..., context_full: _Optional[bool] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "sync", "draft_token_ids", "sampling", "draft_probs", "seed", "prompt_len", "return_bonus_probs", "draft_parents", "steps", "stop_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    RETURN_BONUS_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sync: PrefixSync
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    draft_probs: Distributions
    seed: int
    prompt_len: int
    return_bonus_probs: bool
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    steps: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., sync: _Optional[_Union[PrefixSync, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., draft_probs: _Optional[_Union[Distributions, _Mapping]] = ..., seed: _Optional[int] = ..., prompt_len: _Optional[int] = ..., return_bonus_probs: _Optional[bool] = ..., draft_parents: _Optional[_Iterable[int]] = ..., steps: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("status", "replica_id", "direct_address", "compute_us", "load", "greedy", "sampled", "logprobs", "cached_tokens", "tree_nodes", "continued_token_ids", "grammar_gated", "grammar_at_gated")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_GATED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_AT_GATED_FIELD_NUMBER: _ClassVar[int]
    status: Status
    replica_id: str
    direct_address: str
    compute_us: int
    load: BatchLoad
    greedy: GreedyScores
    sampled: SampledScores
    logprobs: PositionLogprobs
    cached_tokens: int
    tree_nodes: int
    continued_token_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar_gated: bool
    grammar_at_gated: bool
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., replica_id: _Optional[str] = ..., direct_address: _Optional[str] = ..., compute_us: _Optional[int] = ..., load: _Optional[_Union[BatchLoad, _Mapping]] = ..., greedy: _Optional[_Union[GreedyScores, _Mapping]] = ..., sampled: _Optional[_Union[SampledScores, _Mapping]] = ..., logprobs: _Optional[_Union[PositionLogprobs, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., continued_token_ids: _Optional[_Iterable[int]] = ..., grammar_gated: _Optional[bool] = ..., grammar_at_gated: _Optional[bool] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("drafted", "chosen", "top_n", "top_ids", "top_logprobs")
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    drafted: _containers.RepeatedScalarFieldContainer[float]
    chosen: _containers.RepeatedScalarFieldContainer[float]
    top_n: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, drafted: _Optional[_Iterable[float]] = ..., chosen: _Optional[_Iterable[float]] = ..., top_n: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GreedyScores(_message.Message):
    __slots__ = ("target_token_ids",)
    TARGET_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    target_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, target_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SampledScores(_message.Message):
    __slots__ = ("draft_target_probs", "recovered_token_ids", "bonus_token_id", "bonus_probs", "accept_probs")
    DRAFT_TARGET_PROBS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BONUS_PROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_PROBS_FIELD_NUMBER: _ClassVar[int]
    draft_target_probs: _containers.RepeatedScalarFieldContainer[float]
    recovered_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bonus_token_id: int
    bonus_probs: Distributions
    accept_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, draft_target_probs: _Optional[_Iterable[float]] = ..., recovered_token_ids: _Optional[_Iterable[int]] = ..., bonus_token_id: _Optional[int] = ..., bonus_probs: _Optional[_Union[Distributions, _Mapping]] = ..., accept_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class BatchLoad(_message.Message):
    __slots__ = ("batch_size", "batch_tokens")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    batch_tokens: int
    def __init__(self, batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ...) -> None: ...

class PromptLogprobsRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "top_n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_n: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., top_n: _Optional[int] = ...) -> None: ...

class PromptLogprobsResponse(_message.Message):
    __slots__ = ("logprobs", "ranks", "top_n", "top_ids", "top_logprobs", "replica_id", "compute_us")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    top_n: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    replica_id: str
    compute_us: int
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., top_n: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., replica_id: _Optional[str] = ..., compute_us: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "ended")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ended: bool
    def __init__(self, request_id: _Optional[str] = ..., ended: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class ProposeEntry(_message.Message):
    __slots__ = ("tag", "call")
    TAG_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    tag: int
    call: ProposeRequest
    def __init__(self, tag: _Optional[int] = ..., call: _Optional[_Union[ProposeRequest, _Mapping]] = ...) -> None: ...

class ProposeBatch(_message.Message):
    __slots__ = ("entries", "cancel")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[ProposeEntry]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, entries: _Optional[_Iterable[_Union[ProposeEntry, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeAnswer(_message.Message):
    __slots__ = ("tag", "response", "error")
    TAG_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tag: int
    response: ProposeResponse
    error: CallError
    def __init__(self, tag: _Optional[int] = ..., response: _Optional[_Union[ProposeResponse, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ...) -> None: ...

class ProposeAnswers(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[ProposeAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[ProposeAnswer, _Mapping]]] = ...) -> None: ...

class ScoreEntry(_message.Message):
    __slots__ = ("tag", "call")
    TAG_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    tag: int
    call: ScoreRequest
    def __init__(self, tag: _Optional[int] = ..., call: _Optional[_Union[ScoreRequest, _Mapping]] = ...) -> None: ...

class ScoreBatch(_message.Message):
    __slots__ = ("entries", "cancel")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[ScoreEntry]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, entries: _Optional[_Iterable[_Union[ScoreEntry, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreAnswer(_message.Message):
    __slots__ = ("tag", "response", "error")
    TAG_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tag: int
    response: ScoreResponse
    error: CallError
    def __init__(self, tag: _Optional[int] = ..., response: _Optional[_Union[ScoreResponse, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ...) -> None: ...

class ScoreAnswers(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[ScoreAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[ScoreAnswer, _Mapping]]] = ...) -> None: ...

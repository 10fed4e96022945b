"""What a request body may ask, checked before any work (the prompt's own size is checked
against the router's max_prompt_bytes and the context), and the vLLM fields this server
refuses rather than ignores (deployments.openai_api); the stream's options."""

from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, Field, field_validator,
                      model_validator)

from deployments.chat_messages import encodable
from deployments.formats import without_nulls
from deployments.tools import FieldError
from speculative.repetition import MAX_PATTERN_SIZE, RepetitionDetection, repetition_error
from speculative.sampling import MAX_LOGPROBS

# stop strings: as many as lm-evaluation-harness sends (a task's and the end text: 6 for
# humaneval; vLLM bounds none), their characters bounded in all at OpenAI's 4 x 256: each
# output token checks the held text against every prefix of each (speculative.driver)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
MAX_STOP_TOTAL_CHARS = 4 * MAX_STOP_CHARS
MAX_MESSAGES = 1024
# tool calls in all of a chat's messages: each is answered by a tool message, so a
# conversation within MAX_MESSAGES holds fewer (without a bound, 2 MiB of calls, 44k, took
# 0.17 s of the event loop to validate)
MAX_TOOL_CALLS = MAX_MESSAGES
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CACHE_SALT = 1024  # characters, as vLLM 0.32's bound
MAX_PROMPT_CACHE_KEY = 1024  # characters (OpenAI's prompt_cache_key)
MAX_REQUEST_ID = 256  # characters (vLLM's request_id: each chunk of a stream repeats it)
MAX_TEMPLATE_KWARGS = 64  # chat_template_kwargs' entries
MAX_DOCUMENTS = 64  # a chat's documents (vLLM's, for RAG templates), each of text fields
# a request's own chat template (characters; vLLM bounds none): the longest templates
# checkpoints ship (Llama 3.1's with its tools, Command R's) are under 16k
MAX_CHAT_TEMPLATE = 64 * 1024
# vLLM's earlier constraint fields (refused: ignored, the output would be unconstrained)
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object",
          "structural_tag")
# vLLM's fields not served here (and OpenAI's deprecated `functions`, which tools replace,
# and its audio output), each of which changes the answer or what it carries, and the
# values that ask for nothing (vLLM's defaults, as this server behaves): any other is
# refused, by a body that does not declare the field (a chat's chat_template is its own)
UNSERVED = {"chat_template": (None,),
            "functions": (None, []), "logits_processors": (None, []),
            "prompt_embeds": (None,),
            "modalities": (None, ["text"]), "audio": (None,)}
MAX_CHOICES = 128  # n, as OpenAI's bound; the router's max_running_requests bounds it too


def refuse_unserved(body: dict, declared=()) -> None:
    """FieldError for the first of vLLM's earlier constraint fields (GUIDED) given, then for
    the first field of UNSERVED, not among the body's `declared` fields, at a value that asks
    for something."""
    if guided := sorted(key for key in GUIDED if body.get(key) is not None):
        raise FieldError(guided[0], "vLLM's earlier field, not served here: give the "
                         "constraint as structured_outputs or response_format")
    if unserved := sorted(key for key, served in UNSERVED.items()
                          if key in body and key not in declared and body[key] not in served):
        value = repr(body[unserved[0]])  # a template or functions may be long
        value = value if len(value) <= 80 else value[:77] + "..."
        raise FieldError(unserved[0], f"{value} is not supported by this server")


def served_prompt_logprobs(value: int | None, stream: bool) -> int | None:
    """vLLM's prompt_logprobs, a top n of at most MAX_LOGPROBS (its -1, the whole
    vocabulary, is not served), and not with a stream unless 0 (as vLLM); else ValueError."""
    if value is None:
        return None
    if value == -1:  # vLLM's: the whole vocabulary
        raise ValueError(f"-1 (every token) is not served: give a top n of at most "
                         f"{MAX_LOGPROBS}")
    if not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"must be an integer in [0, {MAX_LOGPROBS}], got {value}")
    if value > 0 and stream:
        raise ValueError("`prompt_logprobs` are not available when `stream=True`")
    return value


def check_logprob_token_ids(body) -> None:
    """FieldError unless vLLM's logprob_token_ids, when given, come with logprobs asked (a
    chat's `logprobs: true`, a completion's `logprobs: n`: the ids' logprobs replace the top
    n) and an output to score (not a completion's echo of its prompt alone), as vLLM's."""
    if body.logprob_token_ids is None:
        return
    if body.top_logprobs_asked() is None:
        raise FieldError("logprob_token_ids", "needs logprobs (a chat's true, a completion's "
                                              "a count)")
    if body.max_tokens_or(1) == 0:
        raise FieldError("logprob_token_ids", "not with max_tokens 0: no output token to "
                                              "score")


def needing(value, info, field: str, message: str):
    """A field's value, refused (ValueError(message)) when it is set and the field it needs
    is not (a validator's info.data: the fields declared before it)."""
    if value is not None and not info.data.get(field):
        raise ValueError(message)
    return value


class StreamOptions(BaseModel):
    # a last chunk with no choices, the usage and the speculative counters (as OpenAI)
    include_usage: bool = False
    # with include_usage, every chunk carries its choice's usage so far (vLLM's)
    continuous_usage_stats: bool = False

    @model_validator(mode="before")
    @classmethod
    def null_is_the_default(cls, data):  # as the body's own fields
        return without_nulls(data)


class RepetitionDetectionArg(BaseModel):
    """vLLM's repetition_detection (speculative.repetition): its fields (unknown ones
    ignored, as vLLM's) and refusals, each naming the field."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0  # 0: 1
    min_count: int = 0

    @model_validator(mode="after")
    def as_vllm_takes_it(self):
        error = repetition_error(self.max_pattern_size, self.min_pattern_size, self.min_count)
        if error is not None:
            raise FieldError("repetition_detection", error)
        if self.max_pattern_size > MAX_PATTERN_SIZE:
            raise FieldError("repetition_detection.max_pattern_size",
                             f"at most {MAX_PATTERN_SIZE} here, got {self.max_pattern_size}")
        return self

    def detection(self) -> RepetitionDetection | None:
        """What the router checks; None for vLLM's off (max_pattern_size 0)."""
        if not self.max_pattern_size:
            return None
        return RepetitionDetection(self.max_pattern_size, self.min_pattern_size,
                                   self.min_count)


def budget_value(value):
    """vLLM's thinking_token_budget: a non-negative integer, -1 (and null) unlimited."""
    if value is None or value == -1 and type(value) is int:
        return None
    if type(value) is not int or value < 0:
        raise FieldError("thinking_token_budget", "`thinking_token_budget` must be a "
                         "non-negative integer or -1 for unlimited.")
    return value


def check_thinking_budget(body) -> None:
    """FieldError for a thinking_token_budget with logprobs: vLLM's of a forced id are the
    model's own (its raw logprobs, before the forcing), which no call here computes (the
    router commits those ids itself: speculative.thinking)."""
    if body.thinking_token_budget is not None and (
            body.top_logprobs_asked() is not None or body.logprob_token_ids):
        raise FieldError("thinking_token_budget", "not served with logprobs: a forced "
                         "id's logprob would be the model's, which is not computed here")


class VllmAnswerFields(BaseModel):
    """vLLM's fields of both endpoints that shape the answer, not its sampling."""

    # the answer's id, "cmpl-<id>" ("chatcmpl-<id>"), never the pools' sessions' key
    request_id: Annotated[str, Field(max_length=MAX_REQUEST_ID),
                          AfterValidator(lambda text: encodable(text, "request_id"))] | None = None
    # with truncate_prompt_tokens: "left" (the last k: the whole ids cut, a BOS too) or
    # "right" (the first k); unset: vLLM's default, the tokenizer's left truncation
    # (deployments.prompts.PromptReader.truncated)
    truncation_side: Literal["left", "right"] | None = None
    # a streamed choice's chunk waits for this many tokens (its first and last go at once:
    # deployments.held_text.StreamInterval); unread without a stream
    stream_interval: int | None = Field(default=None, ge=1)
    # the output ends (finish_reason "repetition") where its tail is a pattern repeated
    # min_count times (speculative.repetition); max_pattern_size 0: off
    repetition_detection: RepetitionDetectionArg | None = None
    # the end-of-thinking ids forced once a thinking section spent this many tokens
    # (speculative.thinking); needs the router's reasoning parser (its ids)
    thinking_token_budget: Annotated[int | None, BeforeValidator(budget_value)] = None

    @field_validator("repetition_detection")
    @classmethod
    def detecting(cls, value):  # vLLM's off (max_pattern_size 0) is no detection
        return value if value is not None and value.max_pattern_size else None

"""OpenAI-compatible request bodies (completions, chat completions): what they accept and
refuse, and the sampling parameters and constraint they ask for (the responses:
deployments.responses)."""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from deployments.chat_messages import ChatMessage, encodable
from deployments.formats import ResponseFormat, StructuredOutputs, constraint_of, without_nulls
from deployments.predictions import PredictionField
from deployments.tools import (MAX_TOOLS, FieldError, Tool, ToolChoice, ToolError, ToolUse,
                               tool_use)
from deployments.request_bounds import (MAX_CACHE_SALT, MAX_PROMPT_CACHE_KEY, MAX_CHAT_TEMPLATE,
                                        MAX_CHOICES, MAX_DOCUMENTS, MAX_LOGIT_BIAS_ENTRIES,
                                        MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                                        MAX_STOP_TOTAL_CHARS, MAX_TEMPLATE_KWARGS, MAX_TOOL_CALLS,
                                        StreamOptions, VllmAnswerFields, check_logprob_token_ids,
                                        check_thinking_budget, needing, refuse_unserved,
                                        served_prompt_logprobs)
from deployments.router_args import TreeArg
from drafter.registry import router_side_kinds
from speculative.options import MAX_PLAIN_STEPS, MAX_SPECULATIVE_TOKENS
from speculative.sampling import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, MAX_LOGIT_BIAS,
                                  MAX_LOGPROB_TOKEN_IDS, MAX_LOGPROBS, MAX_REPETITION_PENALTY,
                                  MIN_REPETITION_PENALTY, SamplingParams, served_temperature)


class SamplingFields(VllmAnswerFields):
    """The fields both endpoints share: sampling, n, streaming and the speculative extensions
    (and vLLM's that shape the answer: VllmAnswerFields)."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: str | None = None
    user: str | None = None  # OpenAI's end-user id: typed (as vLLM's), not used
    max_tokens: int | None = Field(default=None, ge=0)  # 0: the prompt alone (`decodes`)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    # extension (as vLLM; 0 or -1: every token); <= vocabulary
    top_k: int = Field(default=0, ge=-1, le=2**31 - 1)
    min_p: float = Field(default=0.0, ge=0, le=1)  # extension (as vLLM)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    # extension (as vLLM, Hugging Face semantics): > 1 discourages the prompt's and output's
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY,
                                      le=MAX_REPETITION_PENALTY)
    seed: int | None = Field(default=None, ge=-2**63, lt=2**63)  # int64, as vLLM
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False  # extension (as vLLM): the stop kept in the text
    skip_special_tokens: bool = True  # extension (as vLLM): false writes special tokens out
    # extension (as vLLM): the prompt's last k tokens only (-1: as many as leave room for the
    # output's max tokens)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extension: K, or "auto" for the router's adaptive K (default: the router's setting)
    num_speculative_tokens: Annotated[int, Field(ge=0, le=MAX_SPECULATIVE_TOKENS)] | \
        Literal["auto"] | None = None
    pipelined: bool | None = None  # extension: draft during verification (router default)
    # extension: the tokens a round without a draft asks the verifier for (router default)
    plain_steps: int | None = Field(default=None, ge=1, le=MAX_PLAIN_STEPS)
    # extension: "model" (the drafter pool, the default) or a kind the router runs itself
    drafter: str | None = None
    # extension: a draft tree per round, {"width": b, "depth": d}, or "auto" (chosen per
    # round against the chain; router default: its own)
    speculative_tree: TreeArg | None = None
    return_token_ids: bool = False  # extension (as vLLM): each choice carries its token ids
    ignore_eos: bool = False  # extension (as vLLM): do not stop at the model's end tokens
    # extension (as vLLM): the place among the waiting under the router's priority policy
    priority: int = Field(default=0, ge=-2**63, lt=2**63)
    # extension (as vLLM): the n best beams of a beam search (deployments.beams), ranked by
    # cumulative logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)  # NaN: no ranking
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)  # extension (as vLLM)
    # OpenAI's: token id (a JSON key, so a string, read as an integer) -> a bias in
    # [-100, 100] added to its logit
    logit_bias: dict[Annotated[int, Field(ge=0)],
                     Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = \
        Field(default=None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    # extension (as vLLM): the end tokens and stop ids cannot end the output before this
    min_tokens: int = Field(default=0, ge=0)
    # extension (as vLLM): every position samples among these ids alone
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    # extension (as vLLM): words the output never holds (deployments.bad_words)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = \
        Field(default=None, max_length=MAX_BAD_WORDS)
    # extension (as vLLM): logprobs name each token "token_id:<id>", not by its text
    return_tokens_as_token_ids: bool = False
    # extension (as vLLM): the pools' prefix caches share prompt blocks only among requests
    # of the same salt (a tenant's cache hits then say nothing of another's prompts)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)
    # OpenAI's: requests of one key (a conversation's turns, a user's) are placed together on
    # the pools, their prefix caches shared (deployments.placement.prefix_route_key)
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_PROMPT_CACHE_KEY)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # extension (as vLLM)
    # OpenAI's completions' echo: the prompt before the output (vLLM's chat's: the last
    # message's text before the content, ChatCompletionRequest.echoed); best_of beyond n
    # (vLLM's chat's too): refused rather than ignored, as it changes the answer
    echo: bool = False
    best_of: int | None = None
    # extension (as vLLM): each prompt token's logprob and its position's top n
    # (deployments.prompt_logprobs); not with a stream (as vLLM, for n > 0)
    prompt_logprobs: int | None = None
    # extension (as vLLM): each output token's position's logprobs of these ids, not its top n
    logprob_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS)

    @model_validator(mode="before")
    @classmethod
    def null_is_the_default(cls, data):
        """OpenAI's fields are nullable (temperature, n, stream, ...): null means the default,
        as in vLLM."""
        if isinstance(data, dict):
            refuse_unserved(data, cls.model_fields)
        return without_nulls(data)

    @field_validator("prompt_logprobs")
    @classmethod
    def prompt_logprobs_served(cls, value, info):
        return served_prompt_logprobs(value, info.data.get("stream"))

    @field_validator("suffix", check_fields=False)  # completions'
    @classmethod
    def unsupported(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def best_of_n(cls, value, info):
        n = info.data.get("n", 1)
        if value is None or value == n:
            return value
        if value < n:  # a bound the client broke, as OpenAI's and vLLM's say
            raise ValueError(f"best_of must be at least n ({n}), got {value}")
        raise ValueError("best_of is not supported beyond n (each choice is returned)")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def keeps_a_token(cls, value):
        if value == 0:
            raise ValueError("keeps no prompt token: give -1 (the context) or k >= 1")
        return value

    @model_validator(mode="after")
    def decodes(self):  # max_tokens 0: a completion's echo, the prompt alone (as vLLM's)
        if self.max_tokens_or(1) == 0 and (not self.echo or hasattr(self, "messages")):
            raise FieldError("max_tokens", "must be at least 1, got 0 (0 is served with echo "
                                           "on /v1/completions: the prompt alone)")
        check_logprob_token_ids(self)
        check_thinking_budget(self)
        return self

    @field_validator("stream_options")
    @classmethod
    def only_when_streaming(cls, value, info):
        if value is not None and not value.model_fields_set:
            return None  # an empty {}, which vLLM takes without a stream too
        return needing(value, info, "stream", "stream_options is only allowed when stream "
                                              "is true")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Each chunk with its choice's usage so far: asked with include_usage (as vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @field_validator("drafter")
    @classmethod
    def known_drafter(cls, value):
        kinds = ["model", *router_side_kinds()]
        if value is not None and value not in kinds:
            raise ValueError(f"drafter must be one of {kinds}")
        return None if value == "model" else value

    @field_validator("stop")
    @classmethod
    def stop_list(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS
                                                    for s in stops) or \
                sum(map(len, stops)) > MAX_STOP_TOTAL_CHARS:
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings of at "
                             f"most {MAX_STOP_CHARS} characters, {MAX_STOP_TOTAL_CHARS} in all")
        return [encodable(s, "stop") for s in stops]

    @field_validator("bad_words")
    @classmethod
    def bad_words_encodable(cls, value):
        return value and [encodable(word, "bad_words") for word in value]

    def sampling(self, default_max_tokens: int, defaults: dict | None = None
                 ) -> SamplingParams:
        """The request's sampling parameters, with its own seed (each choice's is derived
        from it: speculative.frontend); `defaults`: the values of the fields it left unset
        (or null) where the target's generation_config.json recommends them."""
        given = {name: getattr(self, name) for name in ("temperature", "top_k", "top_p",
                                                        "min_p", "repetition_penalty")}
        given.update({name: value for name, value in (defaults or {}).items()
                      if name not in self.model_fields_set})
        max_tokens = self.max_tokens_or(default_max_tokens)
        temperature = served_temperature(given["temperature"])
        # int64 -> its bits, unsigned; -1 is no seed, as vLLM takes it (a new draw each time)
        seed = None if self.seed in (None, -1) else self.seed % 2**64
        return SamplingParams(temperature=temperature, top_k=max(given["top_k"], 0),
                              top_p=given["top_p"], min_p=given["min_p"], seed=seed,
                              max_tokens=max_tokens,
                              stop=tuple(self.stop or ()),
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty,
                              repetition_penalty=given["repetition_penalty"],
                              logprobs=0 if self.logprob_token_ids else self.top_logprobs_asked(),
                              logprob_token_ids=tuple(dict.fromkeys(self.logprob_token_ids or ())),
                              logit_bias=tuple(sorted((self.logit_bias or {}).items())),
                              min_tokens=self.min_tokens, cache_salt=self.cache_salt or "",
                              allowed_token_ids=tuple(self.allowed_token_ids or ()),
                              repetition_detection=self.repetition_detection and
                              self.repetition_detection.detection())

    def max_tokens_or(self, default: int) -> int:
        given = self.max_completion_tokens or self.max_tokens  # max_tokens may be 0
        return default if given is None else given

    def top_logprobs_asked(self) -> int | None:
        """None: no logprobs; n: each token's logprob and its position's top n."""
        return None

    def constraint(self) -> tuple[str, str, object] | None:
        """(the field, the kind, the spec) of the output's constraint, if any: one of
        response_format and structured_outputs' fields; ValueError for more than one."""
        return constraint_of(self.response_format, self.structured_outputs)


class CompletionRequest(SamplingFields, PredictionField):
    # a prompt (text or token ids), or a batch of them: n choices each
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True  # extension (as vLLM): a text prompt gets BOS and the like
    suffix: str | None = None  # OpenAI's, refused rather than ignored (as echo: above)

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @field_validator("logprobs", mode="before")
    @classmethod
    def false_is_off(cls, value):
        # a count, yet clients send chat's boolean: false (JSON's, an int to pydantic as 0)
        # would ask for every token's logprob
        return None if value is False else value

    @field_validator("prompt", mode="before")
    @classmethod
    def batch_in_bounds(cls, value):
        """A batch beyond MAX_CHOICES prompts refused before each is read (540k one-letter
        prompts in 2 MiB took 0.25 s of the event loop to validate, then were refused)."""
        batch = isinstance(value, list) and value and not isinstance(value[0], int)
        if batch and len(value) > MAX_CHOICES:
            raise ValueError(f"a batch takes up to {MAX_CHOICES} prompts, not {len(value)}")
        return value

    @field_validator("prompt")
    @classmethod
    def non_empty(cls, value):
        for prompt in prompt_list(value):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if isinstance(prompt, str):
                encodable(prompt, "prompt")
        return value

    @model_validator(mode="after")
    def choices_in_bounds(self):
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"the prompts times n make {len(self.prompts()) * self.n} "
                             f"choices; the limit is {MAX_CHOICES}")
        return self

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt)


def prompt_list(prompt) -> list:
    """A completions prompt's prompts: one (text, token ids, or an empty list), or a
    batch's."""
    one = isinstance(prompt, str) or not prompt or isinstance(prompt[0], int)
    return [prompt] if one else list(prompt)


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
DocumentText = Annotated[str, AfterValidator(lambda text: encodable(text, "documents"))]
TemplateText = Annotated[str, Field(max_length=MAX_CHAT_TEMPLATE),
                         AfterValidator(lambda text: encodable(text, "chat_template"))]


class ChatCompletionRequest(SamplingFields, PredictionField):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    add_special_tokens: bool = False  # extension (as vLLM): the chat template has its own
    # extensions (as vLLM): the template's opening of the assistant's turn, or instead the
    # last message continued (a reply the client has begun: the output carries on from it)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking, say); those it
    # does not read are dropped, as vLLM drops them (deployments.prompts.template_kwargs)
    chat_template_kwargs: dict[str, Any] | None = Field(default=None,
                                                        max_length=MAX_TEMPLATE_KWARGS)
    # vLLM's: the request's own chat template, rendered where the router trusts request
    # templates (its trust_request_chat_template), else refused as vLLM's refuses it
    # (deployments.chat_templates)
    chat_template: TemplateText | None = None
    # vLLM's: documents a RAG template writes into the prompt (Command R's, Granite's), each
    # a dict of texts ({"title": ..., "text": ...}); a template that reads none drops them
    documents: list[dict[DocumentText, DocumentText]] | None = Field(default=None,
                                                                      max_length=MAX_DOCUMENTS)
    # vLLM's: false, a reasoning parser's reasoning is split off and not sent
    # (deployments.reasoning)
    include_reasoning: bool = True
    # OpenAI's, passed to the chat template as vLLM passes it (template_kwargs)
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: the prompt the chat template rendered, as the answer's `prompt_text` (streamed:
    # on each choice's first chunk)
    return_prompt_text: bool = False

    def template_kwargs(self) -> dict:
        """chat_template_kwargs as vLLM gives them to the template: reasoning_effort's over
        its own, and enable_thinking (false for "none") where they give none."""
        given = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            given["reasoning_effort"] = self.reasoning_effort
            given.setdefault("enable_thinking", self.reasoning_effort != "none")
        return given

    def echoed(self) -> str:
        """vLLM's chat echo, put before each choice's content: the last message's text when
        its role is the reply's (without the generation prompt, its own), else ""."""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last.role
        return last.content or "" if self.echo and last.role == role else ""

    @field_validator("messages", mode="before")
    @classmethod
    def tool_calls_in_bounds(cls, value):
        """At most MAX_TOOL_CALLS tool calls in all, counted before any is validated."""
        if isinstance(value, list) and len(value) <= MAX_MESSAGES:
            calls = sum(len(m["tool_calls"]) for m in value if isinstance(m, dict) and
                        isinstance(m.get("tool_calls"), list))
            if calls > MAX_TOOL_CALLS:
                raise ValueError(f"the messages hold {calls} tool calls; the limit is "
                                 f"{MAX_TOOL_CALLS}")
        return value

    @model_validator(mode="after")
    def one_ending(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false (the "
                             "template would open a new turn after the message)")
        if self.continue_final_message and not (self.messages[-1].content or "").strip():
            raise ValueError("continue_final_message needs a last message with text to "
                             "continue")
        return self

    @field_validator("top_logprobs")
    @classmethod
    def needs_logprobs(cls, value, info):
        # 0 alone asks for nothing: vLLM's default, sent by clients that send every field
        return needing(value or None, info, "logprobs", "top_logprobs needs logprobs: true")

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_use(self) -> ToolUse | None:
        """The tools in effect (deployments.tools); ToolError for a bad tool_choice."""
        return tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)

    def constraint(self) -> tuple[str, str, object] | None:
        """SamplingFields', or the grammar of a forced tool call (not both)."""
        found, use = super().constraint(), self.tool_use()
        forced = use.constraint() if use is not None else None
        if found is not None and forced is not None:
            raise ToolError("tool_choice", f"give one constraint: {found[0]} or a forced "
                                           "tool call, not both")
        return found or forced

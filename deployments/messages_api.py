"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), served
beside OpenAI's as vLLM serves it, as a translation over the chat path: the request read
here and turned into a chat request (ChatCompletionRequest validates it, its errors named
back in the Messages' fields), the chat answer turned into a message, whole or as its
stream of events (deployments.messages_events).

Served: user and assistant messages of text, tool_use and tool_result blocks (thinking
blocks sent back are dropped, as the chat drops an earlier answer's reasoning), a system
prompt, system messages among the messages (as vLLM 0.32 reads them: inline_system),
stop_sequences, temperature, top_p, top_k, tools and tool_choice,
output_config.format (a JSON schema), output_config.effort and thinking (as vLLM maps them:
deployments.messages_api.reasoning_effort), and vLLM's extensions the chat takes. metadata
is read and ignored.
Refused with a 400 naming the field: images, documents and any other block, a message's
empty list of blocks, server tools (those with a `type` other than "custom"), a tool_result
in an assistant's message (a tool_use in a user's), and any block but text in a system
prompt or system message.
"""

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deployments.ingress import BadRequest, invalid_body
from deployments.openai_api import ChatCompletionRequest
from deployments.tokenize_api import TokenizeChat, tokenized
from deployments.tools import FieldError

# the chat request's fields (vLLM's extensions) a Messages request passes on as they are;
# any other unknown field is ignored, as the chat schema ignores one
PASSED = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
          "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias",
          "include_stop_str_in_output", "skip_special_tokens", "cache_salt",
          "truncate_prompt_tokens", "truncation_side", "chat_template_kwargs",
          "include_reasoning",
          "structured_outputs", "allowed_token_ids", "bad_words", "num_speculative_tokens",
          "pipelined", "plain_steps", "drafter", "speculative_tree", "priority",
          "prompt_cache_key")
ROLES = ("user", "assistant", "system")
EFFORTS = ("low", "medium", "high", "xhigh", "max")  # output_config.effort's, as vLLM's
THINKING = ("enabled", "disabled", "adaptive")  # thinking's types
DISPLAYS = ("summarized", "omitted", "updates")  # thinking.display's (read and ignored)
MIN_BUDGET = 1024  # Anthropic's least budget_tokens, and vLLM's
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and tool: named
# Claude Code's first system block: a hash per request, which vLLM drops (it would change
# the prompt's prefix every turn, and the prefix cache would miss)
BILLING_HEADER = "x-anthropic-billing-header"
# the chat's field names (as an error's param or message gives them) -> the Messages'
RENAMED = [(re.compile(r"\bstop\b"), "stop_sequences"),
           (re.compile(r"\btools(\[\d+\]|\.\d+)\.function\.parameters\b"), r"tools\1.input_schema"),
           (re.compile(r"\btools(\[\d+\]|\.\d+)\.function\b"), r"tools\1"),
           (re.compile(r"\btool_choice\.function\b"), "tool_choice"),
           (re.compile(r"\bresponse_format(\.json_schema)?(\.[\w.]+)?"), "output_config.format")]
RESPONSE_FORMAT = RENAMED[-1]  # named in a message's text too (two constraints refused)


def block_kind(block, place: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise FieldError(place, "must be a content block (an object with its type)")
    return kind


def refused_block(kind: str, place: str) -> FieldError:
    return FieldError(f"{place}.type", f"{kind!r} blocks are not served here: this server "
                      "takes text, tool_use and tool_result blocks (no images or documents)")


def text_of(block: dict, place: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise FieldError(f"{place}.text", "is required, as a string")
    return text


def block_texts(blocks: list, place: str) -> list[str]:
    """The texts of `place`'s list of text blocks (FieldError naming any other block)."""
    texts = []
    for index, block in enumerate(blocks):
        where = f"{place}[{index}]"
        if (kind := block_kind(block, where)) != "text":
            raise refused_block(kind, where)
        texts.append(text_of(block, where))
    return texts


def system_text(system: str | list | None, place: str = "system") -> str | None:
    """The system prompt's text: its text blocks joined (as vLLM joins them, with nothing
    between), Claude Code's billing header dropped (as vLLM drops it)."""
    if system is None or isinstance(system, str):
        return system or None
    return "".join(text for text in block_texts(system, place)
                   if not text.startswith(BILLING_HEADER)) or None


def inline_system(content, place: str) -> str | None:
    """A system message's text (None: it adds no message), as vLLM 0.32 reads one among the
    messages: a string (the billing header dropped there too), or text blocks as the system
    prompt's. vLLM skips its other blocks; they are refused here, as in the system prompt."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content or None
    if not isinstance(content, list):
        raise FieldError(f"{place}.content", "must be a string or a list of text blocks")
    return system_text(content, f"{place}.content")


def tool_call(block: dict, place: str) -> dict:
    """An earlier answer's tool_use block as the chat's assistant tool call."""
    for name in ("id", "name"):
        if not isinstance(block.get(name), str):
            raise FieldError(f"{place}.{name}", "is required, as a string")
    if not isinstance(block.get("input", {}), dict):
        raise FieldError(f"{place}.input", "must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}}


def tool_message(block: dict, place: str) -> dict:
    """A tool_result block as the chat's tool message: its content a string, or its text
    blocks joined by newlines (as vLLM joins them)."""
    if not isinstance(block.get("tool_use_id"), str):
        raise FieldError(f"{place}.tool_use_id", "is required, as a string")
    content = block.get("content")
    if content is None or isinstance(content, str):
        return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content or ""}
    if not isinstance(content, list):
        raise FieldError(f"{place}.content", "must be a string or a list of text blocks")
    texts = block_texts(content, f"{place}.content")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": "\n".join(texts)}


def block_messages(role: str, blocks: list, place: str) -> list[dict]:
    """A message's blocks as chat messages, as vLLM translates them: a user's tool results
    first (each a tool message), then its text; an assistant's text (empty blocks skipped,
    the rest joined by newlines) and its tool calls; thinking blocks dropped."""
    texts, calls, results = [], [], []
    for index, block in enumerate(blocks):
        where = f"{place}.content[{index}]"
        kind = block_kind(block, where)
        if kind == "text":
            texts += [text] if (text := text_of(block, where)) else []
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind == "tool_use" and role == "assistant":
            calls.append(tool_call(block, where))
        elif kind == "tool_result" and role == "user":
            results.append(tool_message(block, where))
        else:
            raise refused_block(kind, where) if kind not in ("tool_use", "tool_result") \
                else FieldError(f"{where}.type", f"a {kind} block belongs in "
                                f"{'an assistant' if kind == 'tool_use' else 'a user'} message")
    if role == "user":
        return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])
    message = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    return [{**message, "tool_calls": calls}] if calls else [message]


def message_of(role: str, content, place: str) -> list[dict]:
    """A user's or assistant's message as chat messages."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if isinstance(content, list) and content:  # an empty list is refused, as vLLM's
        return block_messages(role, content, place)
    raise FieldError(f"{place}.content", "must be a string or a non-empty list of blocks")


def chat_messages(system, given: list, merged: bool = False) -> tuple[list[dict], list[str]]:
    """(the chat's messages, each one's place in the request): the system prompt first, then
    each message's (FieldError naming what is refused). A system message is one in its place,
    or, `merged` (the template wants the system prompt first: PromptReader.system_first), its
    text is added to the system prompt's, as vLLM 0.32 merges it (joined with nothing
    between); that one's place is then the first part's."""
    top = system_text(system)
    texts, messages, places = [top] if top is not None else [], [], []
    first = ["system"] if top is not None else []  # the merged system message's place
    for index, message in enumerate(given):
        place = f"messages[{index}]"
        if not isinstance(message, dict):
            raise FieldError(place, "must be an object with its role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise FieldError(f"{place}.role", f"must be one of {list(ROLES)}, not {role!r}")
        if role != "system":
            added = message_of(role, content, place)
        elif (text := inline_system(content, place)) is None:
            continue
        elif merged:
            texts, first = texts + [text], first or [place]
            continue
        else:
            added = [{"role": "system", "content": text}]
        messages += added
        places += [place] * len(added)
    if not texts:
        return messages, places
    return [{"role": "system", "content": "".join(texts)}, *messages], first[:1] + places


def chat_tool(tool, index: int) -> dict:
    """A client tool (name, description, input_schema) as the chat's function tool."""
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise FieldError(f"tools[{index}].type", f"{kind!r} tools are not served here: only "
                         "client tools (name, description, input_schema)")
    if not isinstance(tool.get("input_schema"), dict):
        raise FieldError(f"tools[{index}].input_schema", "is required, as an object")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    function.update({key: tool[key] for key in ("description", "strict")
                     if tool.get(key) is not None})
    return {"type": "function", "function": function}


def chat_tool_choice(choice) -> tuple[Any, bool | None]:
    """(the chat's tool_choice, its parallel_tool_calls) for Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    disable = choice.get("disable_parallel_tool_use") if isinstance(choice, dict) else None
    if disable is not None and not isinstance(disable, bool):
        raise FieldError("tool_choice.disable_parallel_tool_use", "must be a boolean")
    parallel = None if disable is None else not disable
    if kind in TOOL_CHOICES:
        return TOOL_CHOICES[kind], parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise FieldError("tool_choice", "give {\"type\": \"auto\"}, {\"type\": \"any\"}, "
                     "{\"type\": \"none\"} or {\"type\": \"tool\", \"name\": ...}")


def response_format(output_config: dict | None) -> dict | None:
    """output_config.format (a JSON schema) as the chat's response_format."""
    form = (output_config or {}).get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") != "json_schema" or \
            not isinstance(form.get("schema"), dict):
        raise FieldError("output_config.format", "give {\"type\": \"json_schema\", "
                         "\"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {"name": "json_schema",
                                                   "schema": form["schema"]}}


def reasoning_effort(output_config: dict | None, thinking: dict | None) -> str | None:
    """The chat's reasoning_effort, as vLLM 0.32 maps them: output_config.effort, over it
    "none" for thinking disabled (vLLM's default; vLLM probes the template and sends "low"
    where it would ignore "none", this server does not). Thinking enabled sets the chat's
    thinking_token_budget (MessagesRequest.chat_fields), which without the router's
    reasoning parser is the chat's 400 (vLLM's, whose engine refuses a budget without a
    reasoning config). Adaptive pins nothing, as vLLM. FieldError naming a value vLLM
    refuses."""
    effort = (output_config or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise FieldError("output_config.effort", f"must be one of {list(EFFORTS)}")
    if thinking is None:
        return effort
    kind = thinking.get("type")
    if kind not in THINKING:
        raise FieldError("thinking.type", f"must be one of {list(THINKING)}")
    if thinking.get("display") not in (None, *DISPLAYS):
        raise FieldError("thinking.display", f"must be one of {list(DISPLAYS)}")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (type(budget) is not int or budget < MIN_BUDGET):
        raise FieldError("thinking.budget_tokens", "is required with thinking enabled, "
                         f"as an integer of at least {MIN_BUDGET}")
    return "none" if kind == "disabled" else effort


def renamed(error: BadRequest, places: list[str]) -> BadRequest:
    """A chat request's refusal in the Messages' names: a chat message's place (system, or
    messages[i] of the request), tools[i].input_schema, stop_sequences, ..."""
    message, param = str(error), error.param
    found = re.match(r"messages(?:\.|\[)(\d+)\]?", param or "")
    if found is not None:
        index = int(found.group(1))
        place = places[index] if index < len(places) else "messages"
        message, param = message.replace(param, place, 1), place
    elif param is not None:
        given = param
        for pattern, name in RENAMED:
            param = pattern.sub(name, param)
        message = message.replace(given, param)
    message = RESPONSE_FORMAT[0].sub(RESPONSE_FORMAT[1], message)
    return BadRequest(message, error.status, param, error.headers)


class CountTokensRequest(BaseModel):
    """Anthropic's count_tokens request: the prompt a Messages request with these fields
    renders (the module's docstring)."""

    model_config = ConfigDict(extra="allow")  # the chat's extensions (PASSED) ride along

    model: str
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    output_config: dict | None = None
    # with output_config.effort, the chat's reasoning_effort (reasoning_effort(): an
    # enabled one's budget_tokens checked, then the chat's thinking_token_budget)
    thinking: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def nulls(cls, data):
        """null is the default (as the chat's fields)."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    def chat_fields(self, merged: bool = False) -> tuple[dict, list[str]]:
        """(the chat request's body, each message's place in this request); merged: system
        messages merged into the system prompt (chat_messages)."""
        messages, places = chat_messages(self.system, self.messages, merged)
        chat = {key: value for key, value in (self.model_extra or {}).items()
                if key in PASSED and value is not None}
        choice, parallel = chat_tool_choice(self.tool_choice)
        optional = {"tools": None if self.tools is None else
                    [chat_tool(tool, index) for index, tool in enumerate(self.tools)],
                    "tool_choice": choice, "parallel_tool_calls": parallel,
                    "response_format": response_format(self.output_config),
                    "reasoning_effort": reasoning_effort(self.output_config, self.thinking)}
        chat.update({key: value for key, value in optional.items() if value is not None})
        chat.update({"model": self.model, "messages": messages})
        return chat, places

    def chat_request(self, schema=ChatCompletionRequest,
                     merged: bool = False) -> tuple[ChatCompletionRequest, list[str]]:
        """(the chat request this asks for, as `schema`, each message's place); BadRequest
        naming the Messages' field where the chat refuses it. merged: system messages merged
        into the system prompt (the model's template wants it first:
        PromptReader.system_first)."""
        try:
            chat, places = self.chat_fields(merged)
        except FieldError as error:
            raise BadRequest(str(error), param=error.param) from None
        try:
            return schema.model_validate(chat), places
        except ValidationError as error:
            raise renamed(invalid_body(error), places) from None


async def counted(prompts, body: CountTokensRequest) -> dict:
    """count_tokens's answer: the prompt's tokens, as /tokenize counts the chat's (a
    prompt past the context is counted, not refused)."""
    chat, _ = body.chat_request(TokenizeChat, merged=prompts.system_first)
    return {"input_tokens": (await tokenized(prompts, chat))["count"]}


class MessagesRequest(CountTokensRequest):
    """Anthropic's Messages request, as this server reads it (the module's docstring)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict | None = None  # read and ignored (its user_id names no one here)

    def chat_fields(self, merged: bool = False) -> tuple[dict, list[str]]:
        chat, places = super().chat_fields(merged=merged)
        budget = (self.thinking or {}).get("budget_tokens")
        enabled = (self.thinking or {}).get("type") == "enabled"
        if enabled and budget >= self.max_tokens:
            raise FieldError("thinking.budget_tokens", "must be less than max_tokens")
        if enabled:  # as vLLM maps it (reasoning_effort()): without a parser, its 400
            chat["thinking_token_budget"] = budget
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "stop": self.stop_sequences}
        chat.update({key: value for key, value in optional.items() if value is not None})
        chat.update({"max_tokens": self.max_tokens, "stream": self.stream})
        if self.stream:  # the usage so far on every chunk: message_start's input_tokens
            chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return chat, places

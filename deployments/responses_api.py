"""OpenAI's Responses API (`POST /v1/responses`) as a translation over the chat path: the
request read here and turned into a chat request (ChatCompletionRequest validates it, its
errors named back in the Responses' fields); the chat answer turned into a Response, whole
or as its stream of events (deployments.responses_events).

Served: a text or message input, instructions, function tools and their calls and results,
text.format, the sampling fields, top_logprobs, truncation (auto: deployments.truncation),
reasoning.effort (the chat's reasoning_effort, as vLLM passes it; a summary is checked and
echoed, none written), and vLLM's extensions the chat takes.
Refused with a 400 naming the field: what needs state or services this server does not
keep (prompt templates, item references, built-in tools), what a Response has no place for
(vLLM's prompt_logprobs and return_token_ids) and input images, files and audio.
previous_response_id continues a stored Response's conversation, conversation a stored
conversation (deployments.conversation_turns), and background runs one later
(deployments.background), where the router keeps them (its responses_store, as vLLM's
VLLM_ENABLE_RESPONSES_API_STORE: deployments.response_store); without, they are refused too
and nothing is stored (`store` is read and ignored, as vLLM without its store).
"""

import math
import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from deployments.chat_messages import encodable
from deployments.ingress import BadRequest, invalid_body
from deployments.openai_api import ChatCompletionRequest, ReasoningEffort
from deployments.tools import FieldError

# fields of OpenAI's that need state or services this server does not have, and vLLM's that
# ask for what a Response cannot carry: the values that ask for nothing, and why any other
# is refused (naming the field); previous_response_id and background are refused where no
# response store keeps them (deployments.responses_events.answer_shape)
STATELESS = "this server stores no responses"
UNCARRIED = "a Response has no field for it: ask /v1/chat/completions"
REFUSED = {"prompt": ((None,), "this server keeps no prompt templates: give the input"),
           # the chat's extensions that add what a Response has no field for (passed on,
           # they would be dropped from the answer: silently unanswered)
           "prompt_logprobs": ((None,), UNCARRIED),
           "return_token_ids": ((None, False), UNCARRIED)}
# the chat request's fields a Responses request passes on as they are (the sampling
# fields, and vLLM's extensions the chat takes); any other unknown field is ignored, as the
# chat schema ignores one
PASSED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
          "logit_bias", "include_stop_str_in_output", "skip_special_tokens", "cache_salt",
          "truncate_prompt_tokens", "truncation_side", "chat_template_kwargs",
          "include_reasoning",
          "structured_outputs", "allowed_token_ids", "bad_words",
          "return_tokens_as_token_ids", "num_speculative_tokens", "pipelined", "plain_steps",
          "drafter", "speculative_tree", "priority", "prompt_cache_key")
ROLES = ("user", "system", "developer", "assistant")
# a message's content parts that carry text, and where
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
LOGPROBS = "message.output_text.logprobs"  # what `include` names to get them
# reasoning's fields as OpenAI's Reasoning (vLLM's type) takes them: effort the chat's
# reasoning_effort; a summary (generate_summary its old name) is read and written by none
EFFORTS = get_args(ReasoningEffort)
SUMMARIES = ("auto", "concise", "detailed")
# the chat's field names (as an error's param or message gives them) -> the Responses'
RENAMED = [(re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
           (re.compile(r"\bresponse_format(\.json_schema)?(\.[\w.]+)?"), "text.format"),
           (re.compile(r"\btools(\[\d+\]|\.\d+)\.function\b"), r"tools\1"),
           (re.compile(r"\btool_choice\.function\b"), "tool_choice"),
           (re.compile(r"\blogprobs\b"), "include")]


def refused_background(asked: "ResponsesRequest", stores: bool) -> None:
    """BadRequest for a `background` request this router cannot run: without a response
    store (`stores`: the router's responses_store, as vLLM's needs its store), or with
    `store: false` (vLLM's rule and error). Streamed, it is served: its events kept in the
    store (deployments.background_stream)."""
    if not asked.background:
        return
    if not stores:
        raise BadRequest("background: not served: this server answers in the foreground (the "
                         "router's responses_store runs background responses)",
                         param="background")
    if asked.store is False:
        raise BadRequest("background can only be used when `store` is true",
                         param="background")


class ResponsesChat(ChatCompletionRequest):
    """The chat request a Responses request translates to: the chat's, with its
    `truncation` (auto: its oldest turns dropped to fit the context, deployments.truncation)."""

    truncation: Literal["auto", "disabled"] = "disabled"


def chat_messages(instructions: str | None, given: str | list,
                  previous: list[dict] = ()) -> tuple[list, list]:
    """(the chat's messages, each one's place in the request): instructions first as a
    system message, then the `previous` conversation (a stored Response's: its own
    instructions are not carried over, as OpenAI's), then the input's items (FieldError
    naming an item that is refused)."""
    messages, places = [], []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
        places.append("instructions")
    messages += previous
    places += ["previous_response_id"] * len(previous)
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}], places + ["input"]
    calls_open = False  # the last message is an assistant's to which calls may be added
    for index, item in enumerate(given):
        place = f"input[{index}]"
        if not isinstance(item, dict):
            raise FieldError(place, "must be an object (a message or an item)")
        kind = item.get("type", "message")
        if kind == "reasoning":  # an earlier answer's reasoning: not given to the template
            continue
        if kind == "function_call" and calls_open:
            messages[-1].setdefault("tool_calls", []).append(function_call(item, place))
            continue
        if kind == "message":
            message = input_message(item, place)
        elif kind == "function_call":
            message = {"role": "assistant", "content": None,
                       "tool_calls": [function_call(item, place)]}
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": text_field(item, "call_id", place),
                       "content": parts_text(item.get("output"), f"{place}.output")}
        else:
            raise FieldError(f"{place}.type", f"{kind!r} items are not served here (no "
                             "stored responses, built-in tools or files): give message, "
                             "function_call and function_call_output items")
        messages.append(message)
        places.append(place)
        calls_open = message["role"] == "assistant"
    return messages, places


def input_message(item: dict, place: str) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise FieldError(f"{place}.role", f"must be one of {list(ROLES)}, not {role!r}")
    return {"role": role, "content": parts_text(item.get("content"), f"{place}.content")}


def function_call(item: dict, place: str) -> dict:
    """An earlier answer's function_call item as the chat's assistant tool call."""
    return {"id": text_field(item, "call_id", place), "type": "function",
            "function": {"name": text_field(item, "name", place),
                         "arguments": text_field(item, "arguments", place)}}


def text_field(item: dict, name: str, place: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise FieldError(f"{place}.{name}", "is required, as a string")
    return value


def parts_text(content, place: str) -> str:
    """A content's text: a string, or its text parts joined by newlines (as the chat joins
    them); FieldError naming a part that is not text (images, files, audio)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(place, "must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        # a type that is no string (a list, an object: unhashable) names no text part
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        text = part.get(key) if key is not None else None
        if not isinstance(text, str):
            raise FieldError(f"{place}[{index}]", f"a part of type {kind!r} is not served: "
                             "this server takes text only (input_text, output_text), no "
                             "images, files or audio")
        texts.append(text)
    return "\n".join(texts)


def chat_tool(tool, index: int) -> dict:
    """A Responses function tool (flat) as the chat's (nested); FieldError for another."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise FieldError(f"tools[{index}].type", f"{kind!r} tools are not served here: only "
                         "function tools (no built-in tools such as web_search)")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                if tool.get(key) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice  # none, auto, required (the chat checks which)
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise FieldError("tool_choice", "give none, auto, required or {\"type\": \"function\", "
                     "\"name\": ...}: built-in and allowed_tools choices are not served")


def echoable(value: Any, path: str) -> None:
    """Every text in `value` (nested keys and values) one UTF-8 can encode and every number
    finite, since the Response echoes it whole (a lone surrogate, or the NaN or Infinity that
    Python's JSON reads, failed the answer's encoding: a 500; streamed, a dropped stream or
    events no strict JSON parser reads); a FieldError names the innermost field holding one."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise FieldError(path, "contains text that is not valid Unicode (a lone "
                             "surrogate?)") from None
    elif isinstance(value, float) and not math.isfinite(value):
        raise FieldError(path, "must be a finite number (JSON has no NaN or Infinity)")
    elif isinstance(value, dict):
        for key, item in value.items():
            echoable(key, path)  # checked before it names a path
            echoable(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            echoable(item, f"{path}[{index}]")


def response_format(text: dict | None) -> dict | None:
    """text.format as the chat's response_format (json_schema's fields nested)."""
    form = (text or {}).get("format")  # checked by ResponsesRequest.known_format
    if form is None or form["type"] != "json_schema":
        return form
    nested = {key: form[key] for key in ("name", "description", "schema", "strict")
              if form.get(key) is not None}
    return {"type": "json_schema", "json_schema": nested}


def renamed_text(text: str) -> str:
    for pattern, name in RENAMED:
        text = pattern.sub(name, text)
    return text


def renamed(error: BadRequest, places: list[str] | None = None) -> BadRequest:
    """A chat request's refusal in the Responses' names: the field (max_output_tokens, not
    max_tokens; a message's item of input; text.format, ...) and the message's text."""
    message, param = str(error), error.param
    found = re.match(r"messages(?:\.|\[)(\d+)\]?", param or "")
    if param is not None and param.startswith("messages"):
        index = int(found.group(1)) if found else None
        place = places[index] if places and index is not None and index < len(places) \
            else "input"
        message = message.replace(param, place, 1)
        param = place
    else:
        param = None if param is None else renamed_text(param)
        message = renamed_text(message)
    return BadRequest(message, error.status, param, error.headers)


class ResponsesRequest(BaseModel):
    """OpenAI's Responses request, as this server reads it (the module's docstring)."""

    # the chat's extensions (PASSED) ride along; other unknown fields are ignored
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: dict | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    # without a response store, read and ignored; with one, stored unless false
    store: bool | None = None
    previous_response_id: str | None = None  # refused without a response store
    # "conv_..." or {"id": "conv_..."} (deployments.conversation_turns), as previous_response_id
    conversation: str | dict | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    max_tool_calls: int | None = None  # echoed (as vLLM): it bounds built-in tools, none here
    # echoed (as vLLM's): every request is served alike
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    # effort: the chat's reasoning_effort; summaries: read, checked and echoed, none written
    reasoning: dict | None = None
    background: bool = False  # served where a response store keeps them (refused_background)
    # auto: the oldest turns dropped where the prompt does not fit (deployments.truncation)
    truncation: Literal["auto", "disabled"] = "disabled"

    @model_validator(mode="before")
    @classmethod
    def refused_and_nulls(cls, data):
        """Fields that need what this server does not have refused, naming them; null is
        the default (as the chat's fields)."""
        if isinstance(data, dict):
            if refused := sorted(key for key, (served, _) in REFUSED.items()
                                 if key in data and data[key] not in served):
                raise FieldError(refused[0], f"not served: {REFUSED[refused[0]][1]}")
            data = {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("text", "tools", "tool_choice")
    @classmethod
    def echoed_whole(cls, value, info):
        """What the Response echoes as it was given: texts UTF-8 can encode, finite numbers."""
        echoable(value, info.field_name)
        return value

    @field_validator("metadata", "user", "previous_response_id")
    @classmethod
    def echoed_text(cls, value, info):
        """Text the Response echoes: what UTF-8 can encode (its answer is UTF-8 JSON)."""
        texts = [] if value is None else [value] if isinstance(value, str) else \
            [text for pair in value.items() for text in pair]
        for text in texts:
            encodable(text, info.field_name)
        return value

    @field_validator("reasoning")
    @classmethod
    def known_reasoning(cls, value):
        """reasoning's effort and summary: values OpenAI's Reasoning takes, else a 400
        naming the field (as vLLM's, whose request reads it as that type)."""
        for name, known in (("effort", EFFORTS), ("summary", SUMMARIES),
                            ("generate_summary", SUMMARIES)):
            if value is not None and value.get(name) is not None and \
                    value[name] not in known:
                raise FieldError(f"reasoning.{name}", f"must be one of {list(known)}")
        return value

    def reasoning_echoed(self) -> dict | None:
        """The Response's reasoning: the effort and summary asked for (vLLM echoes them)."""
        given = self.reasoning
        return None if given is None else {
            "effort": given.get("effort"),
            "summary": given.get("summary") or given.get("generate_summary")}

    @field_validator("conversation")
    @classmethod
    def conversation_named(cls, value):
        if isinstance(value, dict) and not isinstance(value.get("id"), str):
            raise FieldError("conversation.id", "is required, as a string")
        # an id its 404 names (and the Response echoes): one UTF-8 can encode
        echoable(value, "conversation")
        return value

    @field_validator("text")
    @classmethod
    def known_format(cls, value):
        """text.format: text, json_object, or json_schema with its name and schema (as
        OpenAI requires them: the Response echoes the format, and clients read it)."""
        form = value.get("format") if value is not None else None
        if form is None:
            return value
        kind = form.get("type") if isinstance(form, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise FieldError("text.format.type", "must be text, json_object or json_schema")
        for name, wanted in (("name", str), ("schema", dict)):
            if kind == "json_schema" and not isinstance(form.get(name), wanted):
                raise FieldError(f"text.format.{name}", "a format of type json_schema needs "
                                 f"it, as {'a string' if wanted is str else 'an object'}")
        return value

    def chat_fields(self, previous: list[dict] = ()) -> tuple[dict, list[str]]:
        """(the chat request's body, each message's place in this request), after the
        `previous` conversation."""
        messages, places = chat_messages(self.instructions, self.input, previous)
        chat = {key: value for key, value in (self.model_extra or {}).items()
                if key in PASSED and value is not None}
        chat.update({"model": self.model, "messages": messages, "stream": self.stream,
                     "parallel_tool_calls": self.parallel_tool_calls,
                     "truncation": self.truncation})
        if self.stream:  # the usage goes with response.completed
            chat["stream_options"] = {"include_usage": True}
        optional = {"temperature": self.temperature, "top_p": self.top_p,
                    "max_tokens": self.max_output_tokens,
                    "tools": None if self.tools is None else
                    [chat_tool(tool, index) for index, tool in enumerate(self.tools)],
                    "tool_choice": chat_tool_choice(self.tool_choice),
                    "response_format": response_format(self.text),
                    "reasoning_effort": (self.reasoning or {}).get("effort")}
        if LOGPROBS in (self.include or ()) or self.top_logprobs is not None:
            optional.update(logprobs=True, top_logprobs=self.top_logprobs)
        chat.update({key: value for key, value in optional.items() if value is not None})
        return chat, places

    def chat_request(self, previous: list[dict] = ()) -> tuple[ResponsesChat, list[str],
                                                                list[dict]]:
        """(the chat request this asks for after the `previous` conversation, each
        message's place, its messages as given to it); BadRequest naming the Responses'
        field where the chat schema refuses it."""
        try:
            chat, places = self.chat_fields(previous)
        except FieldError as error:
            raise BadRequest(str(error), param=error.param) from None
        try:
            return ResponsesChat.model_validate(chat), places, chat["messages"]
        except ValidationError as error:
            raise renamed(invalid_body(error), places) from None


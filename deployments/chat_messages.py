"""A chat request's messages: their fields, OpenAI's array form of a content, and what the
chat template is given of each."""

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from deployments.ingress import BadRequest
from deployments.tools import MAX_TOOLS, ToolCall


def encodable(text: str, field: str) -> str:
    """Text that UTF-8 can encode (JSON may carry lone surrogates, which tokenizers reject)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{field} contains text that is not valid Unicode (a lone "
                         "surrogate?)") from None
    return text


# the kinds of content part that carry text, and where: OpenAI's text part, and the
# refusal part of an assistant's earlier answer sent back (vLLM reads its text too)
TEXT_PARTS = {"text": "text", "refusal": "refusal"}


def joined_parts(content):
    """OpenAI's array form of a message's content as one text: its text parts joined by
    newlines, as vLLM joins them (ValueError for any other kind of part)."""
    if not isinstance(content, list):
        return content
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get(TEXT_PARTS[kind]) if kind in TEXT_PARTS else None
        if not isinstance(text, str):
            raise ValueError(f"content part {index} is not a text part ({{'type': 'text', "
                             f"'text': ...}}, or a refusal's {{'type': 'refusal', 'refusal': "
                             f"...}}): this server takes no images, audio or files")
        texts.append(text)
    return "\n".join(texts)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | None = None  # None only beside an assistant's tool_calls
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=256)  # a tool result's call
    # OpenAI's participant's name, handed to the template as vLLM hands it (it may write it)
    name: str | None = Field(default=None, max_length=256)

    @field_validator("content", mode="before")
    @classmethod
    def text_parts(cls, value):
        return joined_parts(value)

    @field_validator("content")
    @classmethod
    def valid_text(cls, value):
        return None if value is None else encodable(value, "content")

    @model_validator(mode="after")
    def tool_fields(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only beside tool_calls)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        texts = [self.tool_call_id or "", self.name or ""]
        for call in self.tool_calls or ():
            texts += [call.function.name, call.function.arguments]
        for text in texts:
            encodable(text, "name, tool_calls and tool_call_id")
        return self

    def for_template(self) -> dict:
        message = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


SHORT_CALL_ID = 9  # Mistral's templates take tool call ids of 9 letters and digits only
OPENAI_CALL_ID = "call_" + "0" * 24


def call_id_length(tokenizer, template: str | None = None) -> int | None:
    """SHORT_CALL_ID where the chat template (`template`, apply_chat_template's; None: the
    model's) refuses a tool call id of OpenAI's length and takes one of 9 characters
    (Mistral's raise on any other, and vLLM writes its ids so for Mistral models); None
    otherwise. Probed by rendering a call and its result."""
    def renders(call_id: str) -> bool:
        call = {"id": call_id, "type": "function", "function": {"name": "f", "arguments": {}}}
        messages = [{"role": "user", "content": "x"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call_id, "content": "1"}]
        try:
            tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
        except Exception:  # a template raises on what it refuses
            return False
        return True

    if not (template or getattr(tokenizer, "chat_template", None)) or renders(OPENAI_CALL_ID):
        return None
    return SHORT_CALL_ID if renders("a" * SHORT_CALL_ID) else None


def with_call_ids_cut(messages: list[dict], length: int) -> list[dict]:
    """The messages (for_template's) with each tool call's id and each tool result's
    tool_call_id cut to its last `length` characters, as vLLM cuts a client's ids for a
    Mistral template (those the router wrote are that long already)."""
    def cut(message: dict) -> dict:
        if message.get("tool_call_id") is not None:
            message = {**message, "tool_call_id": message["tool_call_id"][-length:]}
        if message.get("tool_calls"):
            message = {**message, "tool_calls": [{**call, "id": call["id"][-length:]}
                                                 if call.get("id") else call
                                                 for call in message["tool_calls"]]}
        return message

    return [cut(message) for message in messages]


# what the router gives a chat template itself: no chat_template_kwargs may set these (nor
# apply_chat_template's template and tokenize, which vLLM refuses there too)
TEMPLATE_SET = {"messages", "tools", "documents", "add_generation_prompt",
                "continue_final_message", "chat_template", "tokenize"}


def template_kwargs(given: dict, reads: frozenset | None, specials: set, pattern) -> dict:
    """The chat_template_kwargs a template reads (`reads`: its variables; vLLM drops the
    rest); BadRequest for one the router sets itself (TEMPLATE_SET, the special tokens'
    texts: `specials`) or a value other than a JSON scalar, or a text holding a special
    token's (`pattern`: it would write the token where a message's text cannot), or one
    that is not valid Unicode (the tokenizer's TypeError on the prompt was a 500)."""
    for key, value in given.items():
        if key in TEMPLATE_SET or key in specials:
            raise BadRequest(f"chat_template_kwargs may not set {key!r}: the server sets it",
                             param="chat_template_kwargs")
        try:
            if isinstance(value, str):
                encodable(value, f"chat_template_kwargs[{key!r}]")
        except ValueError as error:
            raise BadRequest(str(error), param="chat_template_kwargs") from None
        if value is not None and not isinstance(value, (bool, int, float, str)) or \
                isinstance(value, str) and pattern is not None and pattern.search(value):
            raise BadRequest(f"chat_template_kwargs[{key!r}] must be a number, a boolean, "
                             "null or a text without special tokens",
                             param="chat_template_kwargs")
    return {key: value for key, value in given.items() if reads is None or key in reads}


def template_variables(template) -> frozenset[str] | None:
    """The undeclared variables of a chat template (of each, for a dict of named ones), as
    transformers' environment parses it; None where it does not parse."""
    import jinja2.meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    if not template:
        return frozenset()
    found = set()
    try:
        for text in template.values() if isinstance(template, dict) else [template]:
            environment = _compile_jinja_template(text).environment
            found |= jinja2.meta.find_undeclared_variables(environment.parse(text))
    except Exception:  # a template transformers' own environment cannot parse
        return None
    return frozenset(found)


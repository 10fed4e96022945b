"""The texts of a model's special tokens inside a chat request: read as text in a message's
content (OpenAI reads them so), refused where the template writes them outside one (they
would become the tokens)."""

import functools
import json
import re
import secrets

from deployments.ingress import BadRequest
from deployments.tool_parsers import CALL_CLOSE, CALL_OPEN


@functools.lru_cache(maxsize=8)
def special_pattern(tokenizer) -> re.Pattern | None:
    """A pattern of the texts of the tokenizer's special tokens (longest first), but a tool
    call's tags, which the output keeps and clients send back; None without any."""
    added = (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
    texts = sorted({token.content for token in added if token.special and token.content
                    and token.content not in (CALL_OPEN, CALL_CLOSE)}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def marked_contents(messages: list[dict], pattern: re.Pattern | None) -> dict[str, str]:
    """{marker: text} of the messages (for_template's, changed in place) whose content holds
    a special token's text: that text becomes a marker, between its leading and trailing
    whitespace, so that a template that trims a content (Llama 3's) trims it as it would the
    text, and transformers ends a continued message after it as it would."""
    marked = {}
    for message in messages if pattern is not None else ():
        content = message.get("content")
        if isinstance(content, str) and pattern.search(content):
            marker = f"SPECSERVE{secrets.token_hex(8)}CONTENT"
            kept = content.strip()
            start = len(content) - len(content.lstrip())
            marked[marker] = kept
            message["content"] = content[:start] + marker + content[start + len(kept):]
    return marked


def check_special_texts(body, pattern: re.Pattern | None) -> None:
    """BadRequest naming the field when a text the template renders outside a message's
    content (its name, a call's id, name or arguments, a tool's description or schema, a
    document) holds a special token's text: it would become the token (Mistral's templates write a
    call's id)."""
    if pattern is None:
        return
    fields = []
    for index, message in enumerate(body.messages):
        fields.append((f"messages[{index}].tool_call_id", message.tool_call_id or ""))
        fields.append((f"messages[{index}].name", message.name or ""))
        for at, call in enumerate(message.tool_calls or ()):
            fields.append((f"messages[{index}].tool_calls[{at}].id", call.id))
            # as the template gets them too: arguments parsed, so an escape (\u003c) in
            # their JSON is the character that a template's tojson writes out
            rendered = json.dumps(call.for_template()["function"]["arguments"],
                                  ensure_ascii=False)
            fields.append((f"messages[{index}].tool_calls[{at}]",
                           call.function.name + call.function.arguments + rendered))
    for index, document in enumerate(body.documents or ()):
        fields.append((f"documents[{index}]", "".join(key + text
                                                       for key, text in document.items())))
    for index, tool in enumerate(body.tools or ()):
        fields.append((f"tools[{index}]", json.dumps(tool.model_dump(), ensure_ascii=False)))
    for field, text in fields:
        if found := pattern.search(text):
            raise BadRequest(f"{field} contains {found.group()!r}, the text of one of the "
                             "model's special tokens, which the chat template would render "
                             "as the token itself", param=field)

"""OpenAI-compatible response bodies: errors, whole answers, their choices and the chunks of
a stream."""

import functools
import json
import time

from speculative.stats import SpecStats

# items of a long list encoded per json.dumps call: a call is C that holds the GIL while it
# runs, so a thread that encoded a whole answer at once stalled the event loop as long (a
# chat choice's logprobs with their top 20: about 25 us a token)
PIECE_ITEMS = 256
# how deep a response's long lists lie: its body, its choices, a choice, the choice's logprobs
PIECE_DEPTH = 4
WHOLE = {"ensure_ascii": False, "allow_nan": False, "separators": (",", ":")}  # JSONResponse's

ERROR_TYPES = {401: ("invalid_request_error", "invalid_api_key"),
               404: ("invalid_request_error", "model_not_found"),  # a model (as OpenAI)
               413: ("invalid_request_error", "request_too_large"),
               429: ("requests", "rate_limit_exceeded")}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error shape; type and code as OpenAI sends them for that status."""
    default = "invalid_request_error" if status < 500 else "server_error"
    kind, code = ERROR_TYPES.get(status, (default, None))
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion_body(request_id: str, model: str, choices: list[dict], usage: dict,
                    stats: SpecStats, chat: bool, created: int | None = None,
                    prompt_token_ids: list[int] | None = None) -> dict:
    """The response: OpenAI's fields, specserve's `speculative` block and vLLM's per-request
    speculative metrics (`metrics.speculative_decoding`); a chat's prompt_token_ids (vLLM's
    return_token_ids) on the body."""
    body = {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "speculative": stats.as_dict(),
        "metrics": stats.vllm_metrics(),
    }
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = prompt_token_ids
    return body


def choice_body(index: int, text: str | None, finish_reason: str | None, stop_reason,
                chat: bool, token_ids: list[int] | None = None, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None,
                prompt_token_ids: list[int] | None = None) -> dict:
    """One choice; stop_reason (as vLLM) is the stop token id or string, None at length; a
    completion's prompt_token_ids (vLLM's return_token_ids) on its choice."""
    if chat:
        body = {"index": index, "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason, "logprobs": logprobs}
        if tool_calls:
            body["message"]["tool_calls"] = tool_calls
    else:
        body = {"index": index, "text": text, "finish_reason": finish_reason,
                "logprobs": logprobs}
    body["stop_reason"] = stop_reason
    if token_ids is not None:
        body["token_ids"] = token_ids
    if prompt_token_ids is not None and not chat:
        body["prompt_token_ids"] = prompt_token_ids
    return body


class DeltaChunks:
    """One streamed choice's text-delta chunks, serialised: the JSON around the text is built
    once per stream (every chunk of a stream has the same id, created and model, as
    OpenAI's) and a delta costs one string's encoding."""

    HOLE = "\x00delta\x00"

    def __init__(self, request_id: str, model: str, index: int, chat: bool,
                 created: int | None = None, reasoning: bool = False) -> None:
        # reasoning: the chunks carry the delta as the choice's reasoning (a chat's)
        text, thought = (None, self.HOLE) if reasoning else (self.HOLE, None)
        whole = json.dumps(chunk_body(request_id, model, index, text, None, chat,
                                      created=created, reasoning=thought))
        # the last one: the id before it (a client's request_id) may hold the hole's text too
        self.head, self.tail = whole.rsplit(json.dumps(self.HOLE), 1)

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text) + self.tail


def chunk_body(request_id: str, model: str, index: int, text: str | None,
               finish_reason: str | None, chat: bool, *, role: str | None = None,
               stop_reason=None, token_ids: list[int] | None = None,
               logprobs: dict | None = None, tool_calls: list[dict] | None = None,
               created: int | None = None, prompt_token_ids: list[int] | None = None,
               reasoning: str | None = None, prompt_text: str | None = None) -> dict:
    """One choice's chunk; created: the request's (OpenAI: the same on every chunk), else
    now; prompt_token_ids where vLLM puts them (a chat's on the chunk, else on its choice);
    reasoning: a chat's reasoning delta (deployments.reasoning), in vLLM's field."""
    if chat:
        delta = {"role": role} if role else {}
        if text is not None:
            delta["content"] = text
        if reasoning is not None:
            delta["reasoning"] = reasoning
        if tool_calls:  # each whole, with its index (deployments.tools.call_deltas)
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish_reason}
    # on every chunk, null where none, as OpenAI's and vLLM's chunks (a client reading
    # choice["logprobs"] must not meet a KeyError): its tokens' (deployments.choices:
    # stream_choice), and the stop that ended the choice (vLLM's)
    choice["logprobs"] = logprobs
    choice["stop_reason"] = stop_reason if finish_reason is not None else None
    if finish_reason is not None and token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None and not chat:
        choice["prompt_token_ids"] = prompt_token_ids
    body = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [choice],
    }
    if prompt_token_ids is not None and chat:
        body["prompt_token_ids"] = prompt_token_ids
    if prompt_text is not None:  # vLLM's return_prompt_text, on a chat's first chunk
        body["prompt_text"] = prompt_text
    return body


def json_text(value, **options) -> str:
    """json.dumps(value, **options), made a piece at a time: a list longer than PIECE_ITEMS
    in slices, and the containers PIECE_DEPTH deep an item at a time."""
    pieces: list[str] = []
    encode_into(value, pieces, PIECE_DEPTH, functools.partial(json.dumps, **options),
                options.get("separators") or (", ", ": "))
    return "".join(pieces)


def encode_into(value, pieces: list[str], depth: int, dumps, separators) -> None:
    item, key = separators
    if isinstance(value, list) and len(value) > PIECE_ITEMS:
        slices = (dumps(value[at:at + PIECE_ITEMS])[1:-1]
                  for at in range(0, len(value), PIECE_ITEMS))
        pieces.append("[" + item.join(slices) + "]")
    elif depth and isinstance(value, dict) and all(isinstance(name, str) for name in value):
        pieces.append("{")
        for at, (name, field) in enumerate(value.items()):
            pieces.append((item if at else "") + dumps(name) + key)
            encode_into(field, pieces, depth - 1, dumps, separators)
        pieces.append("}")
    elif depth and isinstance(value, list):
        pieces.append("[")
        for at, member in enumerate(value):
            pieces.append(item if at else "")
            encode_into(member, pieces, depth - 1, dumps, separators)
        pieces.append("]")
    else:
        pieces.append(dumps(value))

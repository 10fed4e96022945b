"""A Responses request's `truncation: "auto"` (OpenAI's: an input past the model's context
window is fitted to it "by dropping items from the beginning of the conversation"): where
the rendered prompt and the output's room (max_output_tokens, or one token) do not fit
the context, its oldest turns are dropped, whole, and the rest rendered again. A turn is a
user message and what follows it up to the next (the assistant's answers, its calls and
their results: a call is never dropped without its result, nor a result without its call),
so what is kept starts at a user message, as every chat template takes it (Gemma's and
Mistral's refuse a conversation that starts with the assistant). System and developer
messages (the instructions first) are kept, and the last user turn always: where even that
leaves no room for the output, the prompt alone is fitted and the output cut to the room
it leaves, as a disabled truncation's is; where it alone passes the context, the prompt is
refused as a disabled truncation's is. The request's stored conversation keeps every
message (deployments.responses_events): each later turn is fitted again, as OpenAI's input
items keep the whole conversation."""

from collections.abc import Callable

KEPT_ROLES = ("system", "developer")  # never dropped


def auto_truncated(body) -> bool:
    """Whether a chat body asks for its oldest turns dropped to fit (a Responses request's
    truncation: "auto"; deployments.responses_api.ResponsesChat)."""
    return getattr(body, "truncation", "disabled") == "auto"


def turn_starts(messages) -> list[int]:
    """The index of each user message: where a turn starts."""
    return [index for index, message in enumerate(messages) if message.role == "user"]


def without_turns(body, starts: list[int], dropped: int):
    """The body with its first `dropped` turns left out (and any message before the first
    user message), its system and developer messages kept."""
    if dropped == 0:
        return body
    messages = [message for index, message in enumerate(body.messages)
                if index >= starts[dropped] or message.role in KEPT_ROLES]
    return body.model_copy(update={"messages": messages})


def fitted(body, ids_of: Callable, limit: int) -> tuple[int, ...]:
    """The prompt's ids (`ids_of` a body: its rendered, tokenized prompt) with the fewest
    of its oldest turns dropped that let it and its output's room fit the `limit`. Where
    no turns dropped leave that room, the fewest that let the prompt alone fit (none where
    it does): its max_tokens is then cut to the room left, as a disabled truncation's
    (PromptReader.within_context), never the conversation dropped for an output that cannot
    have its room anyway; the last turn alone where even it does not fit (which the caller
    refuses). Rendered at most 2 + log2(turns) times: whole, with all but the last turn
    dropped, then a binary search between (a prompt shrinks as turns go)."""
    ids = ids_of(body)
    room = max(1, body.max_tokens_or(1))
    starts = turn_starts(body.messages)
    if len(ids) + room <= limit or len(starts) < 2:
        return ids
    last = ids_of(without_turns(body, starts, len(starts) - 1))
    if len(last) + room > limit:  # the room asked is out of reach: the prompt alone fitted
        if len(ids) < limit or len(last) >= limit:
            return ids if len(ids) < limit else last
        room = 1
    return fewest_dropped(body, ids_of, limit - room, starts, last)


def fewest_dropped(body, ids_of: Callable, length: int, starts: list[int],
                   fits: tuple[int, ...]) -> tuple[int, ...]:
    """The prompt with the fewest oldest turns dropped that leave it at most `length` ids,
    by a binary search: the whole prompt is known not to, `fits` (all but the last turn
    dropped) to."""
    lowest, fewest = 0, len(starts) - 1  # the most dropped known not to fit; the fewest that do
    while fewest - lowest > 1:
        middle = (lowest + fewest) // 2
        tried = ids_of(without_turns(body, starts, middle))
        if len(tried) <= length:
            fits, fewest = tried, middle
        else:
            lowest = middle
    return fits

"""A Responses request's `conversation` (OpenAI's: "conv_..." or {"id": "conv_..."}; the
Conversations API: deployments.conversations): the conversation's items are given to the
chat before the request's input (after its instructions), as a previous_response_id's
conversation is, and once the Response ends (`completed` or `incomplete`: a failed or
cancelled one adds nothing) its input items, then its output items, are added to the
conversation, in one call to the store (deployments.conversation_store), before the
Response goes out (a background one's: when it ends). `store: false` keeps the Response
unstored but still adds its turn to the conversation (the conversation is the state asked
for). With previous_response_id it is OpenAI's 400; without a response store, a 400 naming
it, as previous_response_id is.
"""

import asyncio
import dataclasses
import logging
from dataclasses import dataclass

from deployments.conversation_store import appended, edited, read
from deployments.ingress import BadRequest, echoed_id
from deployments.messages_api import MessagesRequest
from deployments.messages_events import AsMessage, message_shape
from deployments.response_items import continued, encoded, request_items
from deployments.response_store import RUNNING, ResponseStore
from deployments.responses_api import ResponsesRequest, chat_messages
from deployments.responses_events import AsAsked, AsResponse, answer_shape
from deployments.stored_chats import stored_shape

ENDED = ("completed", "incomplete")  # the Responses whose turns a conversation keeps

logger = logging.getLogger(__name__)


@dataclass
class InConversation(AsResponse):
    """A Responses request in a conversation: its Response names it, and its end adds the
    `turn` (its input's items, encoded: response_items.encoded) and its output to it."""

    conversation: str = ""
    conversations: ResponseStore | None = None  # the store the conversation is in
    turn: tuple = ()

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 extra: dict | None = None) -> dict:
        return super().response(status, output, usage,
                                {"conversation": {"id": self.conversation}, **(extra or {})})

    async def ended(self, response: dict) -> None:
        """Its input and output items added to the conversation, if it ended so (logged
        where they cannot be: the conversation gone, outgrowing the store, unreachable)."""
        if response["status"] not in ENDED:
            return
        try:
            output = await asyncio.get_running_loop().run_in_executor(
                None, encoded, response["output"], "output")
            await edited(self.conversations, self.conversation, appended,
                         self.turn + output, "input")
        except BadRequest as error:
            logger.warning("response %s: its items not added to conversation %s: %s",
                           response["id"], self.conversation, error)


def in_conversation(error: BadRequest) -> BadRequest:
    """A refusal naming a message of the conversation: named `conversation`."""
    if error.param != "previous_response_id":
        return error
    return BadRequest(str(error).replace(error.param, "conversation", 1), error.status,
                      "conversation", error.headers)


def conversation_id(body: ResponsesRequest) -> str | None:
    given = body.conversation
    return given.get("id") if isinstance(given, dict) else given


def conversation_context(items: list[dict]) -> list[dict]:
    """The chat messages of a conversation's items (each checked as it was added)."""
    return chat_messages(None, items)[0]


async def continued_shape(body, model: str, store: ResponseStore | None
                          ) -> AsAsked | AsResponse:
    """answer_shape, the conversation of a Responses request's previous_response_id read
    from the store first (404 when it is not there, or no longer: vLLM's error; 400 while
    it runs in the background: it has no output yet to continue)."""
    asked = body.previous_response_id if isinstance(body, ResponsesRequest) else None
    if asked is None or store is None:
        return answer_shape(body, model, store)
    stored = await store.get(asked)
    if stored is None:
        raise BadRequest(f"Response with id '{echoed_id(asked)}' not found.", 404,  # vLLM's
                         param="previous_response_id",  # OpenAI's code (not model_not_found)
                         code="previous_response_not_found")
    if stored.status in RUNNING:
        raise BadRequest(f"Previous response with id '{asked}' is still {stored.status}: "
                         "continue it once it has ended", param="previous_response_id")
    previous, earlier = await asyncio.get_running_loop().run_in_executor(None, continued,
                                                                         stored)
    return answer_shape(body, model, store, previous, earlier)


async def shaped(body, model: str, store: ResponseStore | None,
                 merged: bool = False) -> AsAsked | AsResponse | AsMessage:
    """continued_shape (a chat asked to be stored: stored_chats.stored_shape; a Messages
    request: deployments.messages_events, its system messages merged into the system
    prompt where `merged`), a Responses request's conversation read from the store first:
    404 naming `conversation` when it is not there (or no longer)."""
    if isinstance(body, MessagesRequest):
        return message_shape(body, merged)
    conversation = conversation_id(body) if isinstance(body, ResponsesRequest) else None
    if conversation is None:
        return stored_shape(body, store) or await continued_shape(body, model, store)
    if body.previous_response_id is not None:
        raise BadRequest("Mutually exclusive parameters: Ensure you are only providing one "
                         "of: 'previous_response_id' or 'conversation'.",
                         param="conversation")
    if store is None:
        raise BadRequest("conversation: not served: this server stores no conversations "
                         "(the router's responses_store keeps them)", param="conversation")
    entry = await edited(store, conversation, read, param="conversation")
    loop = asyncio.get_running_loop()
    items = await loop.run_in_executor(None, entry.listed)
    previous = await loop.run_in_executor(None, conversation_context, items)
    try:
        shape = answer_shape(body, model, store, previous, items)
    except BadRequest as error:
        raise in_conversation(error) from None
    shape.places = ["conversation" if place == "previous_response_id" else place
                    for place in shape.places]  # a conversation's message, in a refusal
    # its input's items as its Response keeps them (their ids), or made here (store: false),
    # encoded now for its end (request_items refused those UTF-8 cannot encode)
    turn = shape.items[len(items):] if shape.store is not None else \
        request_items(body.input, items)[len(items):]
    turn = await loop.run_in_executor(None, encoded, turn, "input")
    fields = {name.name: getattr(shape, name.name) for name in dataclasses.fields(shape)}
    return InConversation(**fields, conversation=conversation, conversations=store,
                          turn=turn)

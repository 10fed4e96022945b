"""A conversation (OpenAI's Conversations API: deployments.conversations) as the router's
response store keeps it: one entry keyed by its conv_ id, beside the Responses and under the
same bounds (deployments.response_store), holding the conversation object and its items,
each as JSON text by its id, in their order.

Every change of one (items added, an item deleted, its metadata replaced, itself deleted)
is one call to the store, made inside it (ResponseStore.edit with a change below: in the
store's actor, whose methods run one at a time), so that two replicas adding to one
conversation at once both keep their items; the changes are module functions, which a call
to the actor carries by name.
"""

import json
from dataclasses import dataclass, replace

from deployments.ingress import BadRequest, echoed_id
from deployments.response_store import ResponseStore

MAX_ITEMS = 20  # the items a conversation is created with, or one call adds: OpenAI's bound


@dataclass(frozen=True)
class StoredConversation:
    """The conversation object ({id, object, created_at, metadata}) and its items: (id, the
    item's JSON text), oldest first."""

    conversation: bytes
    items: tuple[tuple[str, bytes], ...] = ()

    @property
    def nbytes(self) -> int:
        return len(self.conversation) + sum(len(i) + len(text) for i, text in self.items)

    def listed(self) -> list[dict]:
        return [json.loads(text) for _, text in self.items]

    def item(self, item_id: str) -> bytes | None:
        return next((text for i, text in self.items if i == item_id), None)


@dataclass(frozen=True)
class Refusal:
    """A change refused (its 400 or 404, built by the caller: an actor's answer is data)."""

    message: str
    param: str | None
    status: int = 400


def read(entry: StoredConversation):
    """The change that changes nothing: the entry, as it is."""
    return entry, entry


def appended(entry: StoredConversation, items: tuple, param: str):
    """`items` (encoded) after the entry's; refused when one's id is among them already
    (OpenAI's duplicate item, `param`[i].id: a cursor names one item)."""
    held = {item_id for item_id, _ in entry.items}
    for index, (item_id, _) in enumerate(items):
        if item_id in held:
            return entry, Refusal(f"Duplicate item found with id {item_id}. Remove duplicate "
                                  "items and try again.", f"{param}[{index}].id")
    return replace(entry, items=entry.items + tuple(items)), len(items)


def updated(entry: StoredConversation, metadata: dict):
    """Its metadata replaced: the conversation object."""
    conversation = {**json.loads(entry.conversation), "metadata": metadata}
    text = json.dumps(conversation, ensure_ascii=False).encode()
    return replace(entry, conversation=text), conversation


def item_deleted(entry: StoredConversation, item_id: str):
    """The item `item_id` gone: the conversation object (OpenAI's answer); 404 for none."""
    if entry.item(item_id) is None:
        return entry, item_not_found(item_id)
    items = tuple(pair for pair in entry.items if pair[0] != item_id)
    return replace(entry, items=items), json.loads(entry.conversation)


def deleted(entry: StoredConversation):
    conversation_id = json.loads(entry.conversation)["id"]
    return None, {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


def item_not_found(item_id: str) -> Refusal:
    return Refusal(f"Item with id '{echoed_id(item_id)}' not found.", "item_id", 404)


def not_found(conversation_id: str, param: str = "conversation_id") -> BadRequest:
    """OpenAI's 404 for a conversation not stored (no longer, or never), its code null."""
    return BadRequest(f"Conversation with id '{echoed_id(conversation_id)}' not found.", 404,
                      param=param, code=None)


def too_large(what: str, max_bytes: int, param: str | None) -> BadRequest:
    """The 400 of `what` a client asked to store, larger than the response store holds (its
    bound named), naming `param`: what the client gave that made it so."""
    named = "" if param is None else f"Invalid '{param}': "
    return BadRequest(f"{named}{what} would be larger than the response store holds "
                      f"({max_bytes} bytes: its max_bytes)", param=param)


async def entry_edited(store: ResponseStore, key: str, kind: type, missing: BadRequest,
                       noun: str, change, *args, field: str | None = None):
    """The answer of `change` made to the stored entry `key` of type `kind` (a conversation,
    a stored chat completion); BadRequest: `missing` where it is not stored, the change's
    refusal, or a 400 naming `field` (what the change brings) where the `noun`, so changed,
    would outgrow the store (nothing changed)."""
    done = await store.edit(key, kind, change, *args)
    if done is None:
        raise missing
    answer, kept = done
    if isinstance(answer, Refusal):
        raise BadRequest(answer.message, answer.status, answer.param,
                         code=None if answer.status == 404 else ...)
    if not kept:  # (nothing changed)
        raise too_large(f"the {noun}, so changed,", store.max_bytes, field)
    return answer


async def edited(store: ResponseStore, conversation_id: str, change, *args,
                 param: str = "conversation_id", field: str | None = None):
    """entry_edited of the stored conversation, a 404 naming `param` where it is not."""
    return await entry_edited(store, conversation_id, StoredConversation,
                              not_found(conversation_id, param), "conversation", change, *args,
                              field=field)

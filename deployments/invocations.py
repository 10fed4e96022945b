"""vLLM's SageMaker routes: `GET`/`POST /ping`, the health check a SageMaker endpoint polls
(the router's /health), and `POST /invocations`, a chat or a completion by its body (vLLM's
vllm/entrypoints/sagemaker: its dispatch tries the chat's schema, then the completion's, and
serves the body with that route's own handler: a chat as /v1/chat/completions serves it,
its `store` and `metadata` read: deployments.stored_chats)."""

from deployments.ingress import BadRequest
from deployments.openai_api import CompletionRequest
from deployments.stored_chats import StoredChatRequest

# vLLM's refusal of a body that is neither (the request types it tries, in its order)
NO_HANDLER = ("Cannot find suitable handler for request. Expected one of: "
              "['ChatCompletionRequest', 'CompletionRequest']")


class InvocationRequest:
    """A chat's body when it has messages, else a completion's when it has a prompt; told
    apart by those fields, not by which schema validates (vLLM's order), so that a chat with
    a bad field gets that field's 400, not the refusal of a body that is neither. A null
    field is one not given, as everywhere in a body."""

    @staticmethod
    def model_validate(data):
        if given(data, "messages"):
            return StoredChatRequest.model_validate(data)
        if given(data, "prompt"):
            return CompletionRequest.model_validate(data)
        raise BadRequest(NO_HANDLER)


def given(data, field: str) -> bool:
    """Whether a body (a dict, else none is) gives the field, a null read as its absence
    (as the request schemas read a null: their default)."""
    return isinstance(data, dict) and data.get(field) is not None

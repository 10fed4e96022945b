"""vLLM's X-Request-Id header, read as the request's `request_id` where its body gives none.

vLLM 0.32 names a chat's answer `chatcmpl-<X-Request-Id>` (a completion's `cmpl-<id>`), the
header first, the body's `request_id` else (OpenAIServing._base_request_id). Here the body's
comes first: Serve's proxy gives every request an x-request-id (its own uuid where the client
sent none) before the router sees it, so a header read first would override every body's
`request_id`. A client that sends the header alone gets vLLM's id; one that sends neither
gets Serve's, which names the answer (`chatcmpl-<uuid>`) and which the proxy echoes in the
response's X-Request-ID header (vLLM's --enable-request-id-headers, always on under Serve).
Like the body's, the header's id names the answer alone, never the pools' sessions."""

from deployments.ingress import BadRequest
from deployments.request_bounds import MAX_REQUEST_ID, VllmAnswerFields

REQUEST_ID_HEADER = "x-request-id"


def header_request_id(request, body):
    """The body, its `request_id` the X-Request-Id header's where it gives none and is a
    chat's or a completion's (vLLM's Responses ids are their own; a Message's is Anthropic's
    msg_ id here, where vLLM's repeats the chat's) not stored
    (a stored chat's id, which names its entry, is the router's own: deployments.stored_chats);
    a header past the body's bound is a 400. An empty header is none."""
    if not isinstance(body, VllmAnswerFields) or body.request_id is not None or \
            getattr(body, "store", None):
        return body
    sent = request.headers.get(REQUEST_ID_HEADER)
    if not sent:
        return body
    if len(sent) > MAX_REQUEST_ID:
        raise BadRequest(f"the X-Request-Id header has {len(sent)} characters; at most "
                         f"{MAX_REQUEST_ID} (the answer's id repeats it on every chunk)")
    return body.model_copy(update={"request_id": sent})

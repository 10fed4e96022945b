"""A chat's template: the model's, or the request's own (vLLM's `chat_template` field,
rendered only where the router's trust_request_chat_template is on, as vLLM's
--trust-request-chat-template), and what the router reads of it before rendering: the
variables it takes (the chat_template_kwargs it does not read are dropped), whether it names
the `developer` role, and the length of the tool call ids it takes."""

import functools
from dataclasses import dataclass

from deployments.chat_messages import call_id_length, template_variables
from deployments.ingress import BadRequest
from deployments.request_bounds import MAX_CHAT_TEMPLATE

# vLLM's refusal, a 400 (OpenAIServing._validate_chat_template)
UNTRUSTED = ("Chat template is passed with request, but --trust-request-chat-template is not "
             "set. Refused request with untrusted chat template.")
# the request templates read (compiled, parsed, probed) kept: clients send one template with
# every call. transformers keeps the 128 last compiled by their text (its lru_cache)
KEPT_TEMPLATES = 32
# what a request's template may render, per byte max_prompt_bytes allows (beyond its own
# 64 KiB): a prompt's texts written a few times over (tools' schemas indented), not a loop's
RENDERED_PER_PROMPT_BYTE = 4
# vLLM 0.32's probe of a template that wants the system prompt first (its
# _detect_merge_inline_system): a system message after the first
LATER_SYSTEM = ({"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                {"role": "system", "content": "t"}, {"role": "user", "content": "t"})


@dataclass(frozen=True)
class ChatTemplate:
    given: str | None  # apply_chat_template's chat_template (None: the model's own)
    variables: frozenset[str] | None  # the variables it reads (None: unparsed, all passed)
    names_developer: bool  # whether it names the developer role (else: a system message)
    call_id_length: int | None  # the length of tool call ids it takes, where it takes no other

    def rejected(self, error: Exception) -> BadRequest:
        """A 400 for the render's failure (a template raises on roles or order it refuses;
        a request's may fail in any way), naming the field at fault."""
        if self.given is None:
            return BadRequest(f"the model's chat template rejected the messages: "
                              f"{str(error)[:200]}", param="messages")
        return BadRequest(f"chat_template failed to render the messages: {str(error)[:200]}",
                          param="chat_template")

    def checked(self, text: str, max_prompt_bytes: int) -> str:
        """The prompt a request's template rendered, refused (a 400 naming it) where it wrote
        a lone surrogate (a Jinja escape such as '\\ud800', or '%c' % 55296: the tokenizer's
        TypeError was a 500) or more than a prompt of max_prompt_bytes could make of it
        (RENDERED_PER_PROMPT_BYTE: 200 MB of text took the tokenizer tens of gigabytes, and
        the replica was killed)."""
        most = RENDERED_PER_PROMPT_BYTE * max_prompt_bytes + MAX_CHAT_TEMPLATE
        if len(text) > most:
            raise BadRequest(f"chat_template rendered {len(text)} characters; the limit is "
                             f"{most}", param="chat_template")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest("chat_template rendered text that is not valid Unicode (a lone "
                             "surrogate)", param="chat_template") from None
        return text


def model_template(tokenizer, variables: frozenset[str] | None,
                   call_ids: int | None) -> ChatTemplate:
    """The model's template, as PromptReader read it once."""
    return ChatTemplate(None, variables, "developer" in str(tokenizer.chat_template), call_ids)


@functools.lru_cache(maxsize=KEPT_TEMPLATES)
def read_template(tokenizer, given: str) -> ChatTemplate:
    """`given` compiled in transformers' sandboxed environment (BadRequest naming the field
    where it cannot), its variables found and its tool call ids probed (two renders), once
    per text. A name among the model's named templates is that template."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    named = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else {}
    text = named.get(given, given)
    try:
        _compile_jinja_template(text)
    except Exception as error:  # jinja2's TemplateSyntaxError; a RecursionError when deep
        raise BadRequest(f"chat_template cannot compile: {str(error)[:200]}",
                         param="chat_template") from None
    return ChatTemplate(given, template_variables(text), "developer" in text,
                        call_id_length(tokenizer, given))


def wants_system_first(tokenizer) -> bool:
    """Whether the model's chat template refuses a system message after the first (Qwen3.5's
    raises on one), rendered as a chat is, with no tools and with tools (a model's named
    templates differ), as vLLM 0.32 probes it to merge the Messages API's system messages
    into the system prompt."""
    for tools in (None, []):
        try:
            tokenizer.apply_chat_template(list(LATER_SYSTEM), tools=tools, tokenize=False,
                                          add_generation_prompt=False)
        except Exception:  # a template raises on roles or order it refuses (or has none)
            return True
    return False

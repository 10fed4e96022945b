"""A chat request's own template (vLLM's chat_template, behind the router's
trust_request_chat_template: deployments.chat_templates) through the prompt reader, as
test_chat_prompts reads the model's."""

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from deployments.ingress import BadRequest
from deployments.openai_api import ChatCompletionRequest
from tests.unit.test_chat_prompts import prompt_ids, qwen_like_reader, reader_of

# a request's own template (vLLM's chat_template): another way with roles, and the developer
# role named; it reads a variable the model's does not
OWN = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + ':' + "
       "message.content + '<|im_end|>' }}{%- endfor %}{%- if shout is defined and shout %}"
       "{{- 'LOUD' }}{%- endif %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant:'"
       " }}{%- endif %}{# developer #}")


@pytest.fixture(scope="module")
def reader():
    return qwen_like_reader()


def trusting(reader):
    trusted = copy.copy(reader)
    trusted.trusts_request_templates = True
    trusted.max_prompt_bytes, trusted.tokenizing = 1 << 16, ThreadPoolExecutor(1)
    return trusted


def test_a_requests_chat_template_is_refused_as_vllm_refuses_it_unless_trusted(reader):
    """vLLM's --trust-request-chat-template, off by default: a chat (or /tokenize's chat)
    bringing its own template gets vLLM's 400; before, it was always refused."""
    from deployments.chat_templates import UNTRUSTED

    hello = [{"role": "user", "content": "hello"}]
    with pytest.raises(BadRequest) as refused:
        prompt_ids(reader, hello, chat_template=OWN)
    assert (str(refused.value), refused.value.param) == (UNTRUSTED, "chat_template")
    decode = reader.tokenizer.decode
    assert decode(prompt_ids(trusting(reader), hello, chat_template=OWN)) == \
        "<|im_start|>user:hello<|im_end|><|im_start|>assistant:"
    assert decode(prompt_ids(trusting(reader), hello)).startswith("<|im_start|>system\ndefault")


def test_what_the_router_reads_of_a_template_it_reads_of_the_requests_own(reader):
    """The chat_template_kwargs passed (those its template reads), the developer role kept
    where it names it, the tool call ids it takes (Router.tool_use's): the request's
    template's, not the model's (the model's would drop `shout`, map developer to system and
    write OpenAI's ids)."""
    from tests.unit.test_chat_families import NINE_CHAR_IDS

    trusted = trusting(reader)
    decode = reader.tokenizer.decode
    messages = [{"role": "developer", "content": "terse"}, {"role": "user", "content": "hi"}]
    text = decode(prompt_ids(trusted, messages, chat_template=OWN,
                             chat_template_kwargs={"shout": True}))
    assert text.startswith("<|im_start|>developer:terse") and "LOUD" in text
    assert "LOUD" not in decode(prompt_ids(trusted, messages,
                                           chat_template_kwargs={"shout": True}))
    call = {"id": "call_" + "x" * 15 + "abcdefghi", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "1"}],
        chat_template=NINE_CHAR_IDS)
    assert "[TOOL_CALLS]abcdefghi" in trusted.chat_text(body, [m.for_template()
                                                               for m in body.messages])
    from types import SimpleNamespace

    from deployments.router import Router
    from deployments.router_args import RouterArgs

    router = SimpleNamespace(args=RouterArgs(), prompts=trusted)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    asked = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools,
                                  chat_template=NINE_CHAR_IDS)
    assert asyncio.run(Router.tool_use(router, asked)).call_id_length == 9  # its calls' ids
    model_s = asked.model_copy(update={"chat_template": None})
    assert asyncio.run(Router.tool_use(router, model_s)).call_id_length is None


@pytest.mark.parametrize("template, says", [
    ("{% for m in messages %}{{ m.content }", "cannot compile"),
    ("{{ raise_exception('no tools here') }}", "no tools here"),
    ("{{ messages.__class__.__mro__ }}", "failed to render"),  # the sandbox's refusal
    ("{{ messages[0].content.nope.deeper }}", "failed to render"),
])
def test_a_requests_template_that_cannot_compile_or_render_is_a_400_naming_it(reader, template,
                                                                             says):
    """Never a 500, nor the model's template's message naming `messages`."""
    with pytest.raises(BadRequest, match=says) as refused:
        prompt_ids(trusting(reader), [{"role": "user", "content": "hi"}],
                   chat_template=template)
    assert refused.value.param == "chat_template" and refused.value.status == 400


def test_a_model_without_a_template_renders_a_requests_own(reader):
    tokenizer = copy.deepcopy(reader.tokenizer)
    tokenizer.chat_template = None
    bare = trusting(reader_of(tokenizer))
    hello = [{"role": "user", "content": "hello"}]
    with pytest.raises(BadRequest, match="no chat template"):
        prompt_ids(bare, hello)
    assert tokenizer.decode(prompt_ids(bare, hello, chat_template=OWN)).startswith(
        "<|im_start|>user:hello")


@pytest.mark.parametrize("template, says", [
    ("{{ '\\ud800' }}{{ messages[0].content }}", "not valid Unicode"),  # a Jinja escape
    ("{{ '%c' % 55296 }}{{ messages[0].content }}", "not valid Unicode"),
    ("{{ messages[0].content * 100000 }}", "rendered 200000 characters"),
])
def test_a_requests_template_that_renders_no_unicode_or_past_any_prompt_is_a_400(reader,
                                                                                template, says):
    """What a request's template writes is not the request's checked texts: a lone surrogate
    was the tokenizer's TypeError (a 500, on /tokenize too), and a text far past what
    max_prompt_bytes allows went to the tokenizer (200 MB of it killed the replica)."""
    trusted = trusting(reader)
    trusted.max_prompt_bytes = 1 << 10
    with pytest.raises(BadRequest, match=says) as refused:
        prompt_ids(trusted, [{"role": "user", "content": "hi"}], chat_template=template)
    assert refused.value.param == "chat_template" and refused.value.status == 400


def test_a_requests_template_is_read_for_its_tools_on_the_tokenizing_thread(reader,
                                                                           monkeypatch):
    """Router.tool_use reads the template again: kept from the prompt's reading only until 32
    other templates push it out, it was compiled and rendered on the event loop (a 64 KiB
    one: seconds during which no stream moved)."""
    from types import SimpleNamespace

    from deployments.chat_templates import KEPT_TEMPLATES, read_template
    from deployments.router import Router
    from deployments.router_args import RouterArgs

    trusted = trusting(reader)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    hi = [{"role": "user", "content": "hi"}]
    asked = ChatCompletionRequest(messages=hi, tools=tools, chat_template=OWN)
    prompt_ids(trusted, hi, tools=tools, chat_template=OWN)
    for other in range(KEPT_TEMPLATES):  # other requests' templates, read meanwhile
        read_template(trusted.tokenizer, f"{{# {other} #}}{{{{ 'x' }}}}")
    threads, render = [], trusted.tokenizer.apply_chat_template

    def rendered(*args, **kwargs):
        threads.append(threading.current_thread())
        return render(*args, **kwargs)

    monkeypatch.setattr(trusted.tokenizer, "apply_chat_template", rendered)
    router = SimpleNamespace(args=RouterArgs(), prompts=trusted)
    assert asyncio.run(Router.tool_use(router, asked)).call_id_length is None
    assert threads and threading.main_thread() not in threads  # (the event loop's)

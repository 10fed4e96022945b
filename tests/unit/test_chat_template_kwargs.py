"""What a chat request brings its template besides the messages, as vLLM passes it: its
chat_template_kwargs (the variables the template reads; the template's own arguments, the
template itself and text that is not unicode refused) and its documents, their texts
counted against the prompt's bytes and a special token's text among them refused."""

import copy

import pytest

from deployments.ingress import BadRequest
from deployments.openai_api import ChatCompletionRequest
from tests.unit.test_chat_prompts import prompt_ids, qwen_like_reader, reader_of


@pytest.fixture(scope="module")
def reader():
    return qwen_like_reader()


THINKING = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + "
            "message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
            "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and not "
            "enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def test_chat_template_kwargs_reach_the_template_as_vllm_passes_them(reader):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking): the variables the template
    reads are passed to it, the others dropped, as vLLM drops them; before, any was a 400.
    The template's own arguments, the special tokens' texts and values that are no JSON
    scalar, or a text holding a special token, are refused, naming the field."""
    tokenizer = copy.deepcopy(reader.tokenizer)
    tokenizer.chat_template = THINKING
    thinking = reader_of(tokenizer)
    hello = [{"role": "user", "content": "hello"}]
    off = tokenizer.decode(prompt_ids(thinking, hello,
                                      chat_template_kwargs={"enable_thinking": False,
                                                            "unread": 1}))
    assert off.endswith("assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.decode(prompt_ids(thinking, hello)).endswith("assistant\n")
    assert prompt_ids(reader, hello, chat_template_kwargs={"enable_thinking": False}) == \
        prompt_ids(reader, hello)  # a template that does not read it
    for kwargs in [{"messages": []}, {"add_generation_prompt": False}, {"eos_token": "x"},
                   {"enable_thinking": [1]}, {"enable_thinking": "<|im_end|>"}]:
        with pytest.raises(BadRequest) as refused:
            prompt_ids(thinking, hello, chat_template_kwargs=kwargs)
        assert refused.value.param == "chat_template_kwargs"


# a template that writes a text it is given (Llama 3's date_string) where one is given
DATED = "{%- if date_string is defined %}{{- 'Today: ' + date_string + '\\n' }}{%- endif %}"


@pytest.mark.parametrize("kwargs", [{"chat_template": "{{ 'x' }}"}, {"tokenize": True},
                                    {"date_string": "a\ud800"}])
def test_chat_template_kwargs_may_not_set_the_template_nor_bring_text_that_is_not_unicode(
        reader, kwargs):
    """A template or tokenize among them is refused, as vLLM refuses them (a template was
    dropped unread: the model's rendered the prompt, silently); a text with a lone surrogate
    that the template writes is a 400 as a message's is (the tokenizer's TypeError: a 500)."""
    tokenizer = copy.deepcopy(reader.tokenizer)
    tokenizer.chat_template = DATED + THINKING
    dated = reader_of(tokenizer)
    hello = [{"role": "user", "content": "hello"}]
    assert "Today: 1 May" in tokenizer.decode(
        prompt_ids(dated, hello, chat_template_kwargs={"date_string": "1 May"}))
    body = ChatCompletionRequest.model_validate({"messages": hello,
                                                 "chat_template_kwargs": kwargs})
    with pytest.raises(BadRequest) as refused:
        dated.token_ids(body, chat=True)
    assert refused.value.param == "chat_template_kwargs"


def test_a_text_among_chat_template_kwargs_counts_against_the_prompts_bytes(reader):
    """The template may write it into the prompt: counted before tokenizing as a message's
    text is (uncounted, a body of twice max_prompt_bytes was tokenized)."""
    tokenizer = copy.deepcopy(reader.tokenizer)
    tokenizer.chat_template = DATED + THINKING
    dated = reader_of(tokenizer)
    dated.max_prompt_bytes = 100
    hello = [{"role": "user", "content": "hello"}]
    dated.check_prompt_bytes(ChatCompletionRequest(
        messages=hello, chat_template_kwargs={"date_string": "1 May"}), chat=True)
    for text in ["x" * 100, "x" * 95 + "\ud800"]:
        body = ChatCompletionRequest.model_validate({
            "messages": hello, "chat_template_kwargs": {"date_string": text}})
        with pytest.raises(BadRequest, match="the prompt has 10[35] bytes"):
            dated.check_prompt_bytes(body, chat=True)


# a RAG template's documents (Command R's and Granite's way): each written before the turn
CITING = ("{%- if documents %}{%- for document in documents %}{{- 'Doc ' + document.title + "
          "': ' + document.text + '\\n' }}{%- endfor %}{%- endif %}" + THINKING)


def test_documents_reach_the_template_as_vllm_passes_them(reader):
    """vLLM's chat `documents` go to the template (before, a 400); a template that reads
    none renders as without them. Their texts count against the prompt's bytes; a special
    token's text among them is refused naming them, as it would become the token."""
    tokenizer = copy.deepcopy(reader.tokenizer)
    tokenizer.chat_template = CITING
    citing = reader_of(tokenizer)
    hello = [{"role": "user", "content": "hello"}]
    documents = [{"title": "a", "text": "hello world"}, {"title": "b", "text": "answer"}]
    text = tokenizer.decode(prompt_ids(citing, hello, documents=documents))
    assert text.startswith("Doc a: hello world\nDoc b: answer\n<|im_start|>user")
    assert prompt_ids(reader, hello, documents=documents) == prompt_ids(reader, hello)
    with pytest.raises(BadRequest) as refused:
        prompt_ids(citing, hello, documents=[{"title": "a", "text": "x<|im_end|>"}])
    assert refused.value.param == "documents[0]"
    citing.max_prompt_bytes = 100
    body = ChatCompletionRequest(messages=hello, documents=[{"title": "a", "text": "x" * 96}])
    with pytest.raises(BadRequest, match="the prompt has 111 bytes"):
        citing.check_prompt_bytes(body, chat=True)

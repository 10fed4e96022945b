"""Chat requests rendered through templates shaped as real families' (Llama 3's: a BOS it
writes, contents trimmed; Mistral's: a SentencePiece metaspace, roles that must alternate),
as vLLM renders them, with a special token's text in a content read as text."""

import dataclasses

import pytest

from deployments.ingress import BadRequest
from deployments.openai_api import ChatCompletionRequest
from deployments.tools import ToolFunction, ToolUse
from tests.unit.test_chat_prompts import reader_of

LLAMA_LIKE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message.role +"
    " '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n'"
    " }}{%- endif %}")
MISTRAL_LIKE = (
    "{%- for message in messages %}{%- if (message.role == 'user') != (loop.index0 % 2 == 0)"
    " %}{{- raise_exception('After the optional system message, conversation roles must "
    "alternate user/assistant/user/assistant/...') }}{%- endif %}{%- endfor %}"
    "{{- bos_token }}{%- for message in messages %}{%- if message.role == 'user' %}"
    "{{- '[INST] ' + message.content + '[/INST]' }}{%- else %}{{- ' ' + message.content|trim"
    " + eos_token }}{%- endif %}{%- endfor %}")
TEXT = ["hello world, answer in French\n", "what is the weather in Paris?\n"] * 8
ALPHABET = "<>|_[]/{}:,.?!abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n"


def tokenizer(specials: list[str], bos: str, eos: str, metaspace: bool):
    """A tiny tokenizer that adds a BOS to a text, as Llama's and Mistral's do: byte-level
    (Llama 3's) or over a metaspace prepended at a text's start (SentencePiece's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    if metaspace:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        backend.decoder = decoders.Metaspace(prepend_scheme="first")
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(TEXT + [ALPHABET], trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, backend.token_to_id(bos))])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    wrapped.add_special_tokens({"additional_special_tokens": specials})
    return wrapped


@pytest.fixture(scope="module")
def llama():
    tok = tokenizer(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>", metaspace=False)
    tok.chat_template = LLAMA_LIKE
    return reader_of(tok)


@pytest.fixture(scope="module")
def mistral():
    tok = tokenizer(["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", metaspace=True)
    tok.chat_template = MISTRAL_LIKE
    return reader_of(tok)


def prompt_ids(reader, messages, **fields) -> list[int]:
    return list(reader.token_ids(ChatCompletionRequest(messages=messages, **fields),
                                 chat=True))


def vllm_ids(reader, messages, **fields) -> list[int]:
    """vLLM's: the template's text, tokenized whole without the tokenizer's special tokens."""
    text = reader.tokenizer.apply_chat_template(messages, tokenize=False, **fields)
    return reader.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_template_that_writes_the_bos_gets_one_and_the_assistants_turn(llama):
    messages = [{"role": "system", "content": "answer in French"},
                {"role": "user", "content": "hello"}, {"role": "assistant", "content": "oui"}]
    ids = prompt_ids(llama, messages)
    assert ids == vllm_ids(llama, messages, add_generation_prompt=True)
    assert ids.count(llama.tokenizer.bos_token_id) == 1 and ids[0] == llama.tokenizer.bos_token_id
    assert llama.tokenizer.decode(ids).endswith("oui<|eot_id|><|start_header_id|>assistant"
                                                "<|end_header_id|>\n\n")


def test_a_template_that_trims_a_content_trims_one_holding_a_special_tokens_text(llama):
    ids = prompt_ids(llama, [{"role": "user", "content": "\n  hello <|eot_id|> world \n"}])
    assert llama.tokenizer.decode(ids) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhello <|eot_id|> "
        "world<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids.count(llama.tokenizer.convert_tokens_to_ids("<|eot_id|>")) == 1


@pytest.mark.parametrize("content", ["hello </s> world", "[INST] hello"])
def test_a_metaspace_tokenizer_adds_no_space_around_a_marked_content(mistral, content):
    """Its pieces are tokenized as inside the text: the content's first token is the one a
    plain content's is, and the prompt reads as the template wrote it."""
    tok = mistral.tokenizer
    ids = prompt_ids(mistral, [{"role": "user", "content": content}])
    assert tok.decode(ids) == f"<s>[INST] {content}[/INST]"
    plain = vllm_ids(mistral, [{"role": "user", "content": content.replace("</s>", "")}])
    assert ids[:3] == plain[:3] and ids[-1] == plain[-1]


def test_a_plain_mistral_chat_is_rendered_as_vllm_renders_it(mistral):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "oui"},
                {"role": "user", "content": "world"}]
    ids = prompt_ids(mistral, messages)
    assert ids == vllm_ids(mistral, messages, add_generation_prompt=True)
    assert ids.count(mistral.tokenizer.bos_token_id) == 1


def test_a_template_that_rejects_the_roles_answers_a_400_naming_messages(mistral):
    with pytest.raises(BadRequest, match="must alternate") as error:
        prompt_ids(mistral, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert error.value.param == "messages"


# the checks Mistral's template makes of tool call ids (its own words), and where it writes them
NINE_CHAR_IDS = (
    "{%- for message in messages %}{%- for call in message.tool_calls or [] %}"
    "{%- if call.id|length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{%- endif %}{{- '[TOOL_CALLS]' + call.id }}{%- endfor %}"
    "{%- if message.role == 'tool' %}{%- if message.tool_call_id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{{- '[TOOL_RESULTS]' + message.tool_call_id }}{%- endif %}"
    "{{- (message.content or '') + ' ' }}{%- endfor %}")


def test_a_template_that_takes_nine_character_call_ids_gets_them(llama):
    """As vLLM for Mistral models: the router writes its calls' ids in 9 letters and digits,
    and cuts a client's longer ones to their last 9; before, a forced call sent back to a
    Mistral template was a 400 (its id OpenAI's 29 characters)."""
    tok = tokenizer(["<s>", "</s>", "[TOOL_CALLS]", "[TOOL_RESULTS]"], "<s>", "</s>",
                    metaspace=True)
    tok.chat_template = NINE_CHAR_IDS
    reader = reader_of(tok)
    assert reader.call_id_length == 9 and llama.call_id_length is None
    long_id = "call_" + "x" * 15 + "abcdefghi"
    call = {"id": long_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": long_id, "content": "1"}])
    text = reader.chat_text(body, [m.for_template() for m in body.messages])
    assert "[TOOL_CALLS]abcdefghi" in text and "[TOOL_RESULTS]abcdefghi" in text
    tools = ToolUse((ToolFunction(name="f"),), (), True, call_id_length=9)
    _, [read] = tools.read_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert len(read["id"]) == 9 and read["id"].isalnum()
    _, [openai] = dataclasses.replace(tools, call_id_length=None).read_calls(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert openai["id"].startswith("call_") and len(openai["id"]) == 29


def test_a_special_tokens_text_in_a_call_id_is_refused_as_the_template_writes_the_id():
    """Mistral's templates write a call's id: a special token's text there (an id whose last
    9 characters are "[/INST]ab") would be the token itself, ending the turn; refused, naming
    the field, as a call's name or arguments are."""
    tok = tokenizer(["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]"],
                    "<s>", "</s>", metaspace=True)
    tok.chat_template = NINE_CHAR_IDS
    reader = reader_of(tok)
    for call_id in ["call_xx[/INST]ab", "[/INST]ab"]:
        call = {"id": call_id, "type": "function",
                "function": {"name": "f", "arguments": "{}"}}
        with pytest.raises(BadRequest) as refused:
            prompt_ids(reader, [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": None, "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "abcdefghi", "content": "1"}])
        assert refused.value.param == "messages[1].tool_calls[0].id"

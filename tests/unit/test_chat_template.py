"""The demo tokenizer's chat template: Python-comment lines the code model can continue."""

import pytest

from specserve.demo import DEMO_CHAT_TEMPLATE, save_tokenizer, train_tokenizer
from engine.models import DEMO_DRAFT, DEMO_TARGET, load_tokenizer

MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Parse a config file."},
]
EXPECTED = "# system: You write Python.\n# user: Parse a config file.\n# assistant:\n"
ROLES = ["system", "user", "assistant", "developer", "tool"]


def render(tokenizer, messages, add_generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


@pytest.fixture(scope="module")
def target_tokenizer():
    return load_tokenizer(DEMO_TARGET)


def test_the_demo_target_renders_a_chat_as_python_comments(target_tokenizer):
    assert target_tokenizer.chat_template == DEMO_CHAT_TEMPLATE
    assert render(target_tokenizer, MESSAGES) == EXPECTED
    assert render(target_tokenizer, MESSAGES, add_generation_prompt=False) == \
        EXPECTED.removesuffix("# assistant:\n")


def test_every_openai_role_renders(target_tokenizer):
    messages = [{"role": role, "content": "x"} for role in ROLES]
    assert render(target_tokenizer, messages) == \
        "".join(f"# {role}: x\n" for role in ROLES) + "# assistant:\n"


def test_the_prompt_tokenizes_without_special_tokens(target_tokenizer):
    text = render(target_tokenizer, MESSAGES)
    ids = target_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert target_tokenizer.eos_token_id not in ids
    assert target_tokenizer.decode(ids) == text


def test_the_draft_has_the_same_template(target_tokenizer):
    draft = load_tokenizer(DEMO_DRAFT)
    assert draft.chat_template == target_tokenizer.chat_template
    assert render(draft, MESSAGES) == EXPECTED


def test_a_freshly_built_tokenizer_is_saved_with_the_template(tmp_path):
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n"] * 8, vocab_size=300)
    assert not tokenizer.chat_template
    save_tokenizer(tokenizer, tmp_path)
    reloaded = load_tokenizer(str(tmp_path))
    assert reloaded.chat_template == DEMO_CHAT_TEMPLATE
    assert render(reloaded, MESSAGES) == EXPECTED

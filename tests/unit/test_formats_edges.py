"""deployments.formats at its edges: a structural tag's structures each opened by a trigger
(a prefix of its begin), one constraint per request, and OpenAI's json_object as any JSON
object."""

import pytest
from pydantic import ValidationError

from deployments.formats import ResponseFormat, StructuralTag, StructuredOutputs, constraint_of


def structure(begin: str) -> dict:
    return {"begin": begin, "schema": {"type": "object"}, "end": "</f>"}


def test_a_structures_begin_starts_with_a_trigger_not_ends_with_one():
    tag = StructuralTag(structures=[structure("<f=get>"), structure("<f=put>")], triggers=["<f="])
    assert [s.begin for s in tag.structures] == ["<f=get>", "<f=put>"]
    with pytest.raises(ValidationError, match="starts with none of the triggers"):
        StructuralTag(structures=[structure("call <f=")], triggers=["<f="])


@pytest.mark.parametrize("form, given, fields", [
    ({"type": "json_object"}, {"regex": "a+"},
     ["response_format", "structured_outputs.regex"]),
    (None, {"choice": ["a"], "grammar": "root ::= \"a\""},
     ["structured_outputs.choice", "structured_outputs.grammar"]),
    (None, {"json_object": True, "json": {"type": "string"}},
     ["structured_outputs.json_object", "structured_outputs.json"])])
def test_two_constraints_are_refused_naming_both(form, given, fields):
    with pytest.raises(ValueError, match="give one constraint") as refused:
        constraint_of(form and ResponseFormat(**form), StructuredOutputs(**given))
    assert str(fields) in str(refused.value)


def test_response_formats_json_object_is_any_json_object_and_text_is_none():
    assert constraint_of(ResponseFormat(type="json_object"), None) == \
        ("response_format", "json", {"type": "object"})
    assert constraint_of(ResponseFormat(type="text"), None) is None
    assert constraint_of(None, StructuredOutputs(json_object=False)) is None

"""The output constraint a request body asks for: OpenAI's response_format and vLLM's
structured_outputs (deployments.openai_api's bodies carry them; speculative.grammar compiles
what they ask)."""

import json
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from deployments.tools import FieldError


# vLLM's options of structured_outputs at the values that ask for nothing (its defaults, as
# a client serialising vLLM's StructuredOutputsParams whole sends them): any other is refused
STRUCTURED_DEFAULTS = {"disable_fallback": False, "disable_any_whitespace": False,
                       "disable_additional_properties": False, "whitespace_pattern": None}
MAX_STRUCTURES = 128  # a structural tag's structures (one a tool, as MAX_TOOLS)


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class Structure(BaseModel):
    """One of a structural tag's structures (vLLM's StructuralTag): where the output writes
    `begin`, a JSON value of `schema` follows, then `end`."""

    begin: str = Field(min_length=1)
    schema_: dict = Field(alias="schema")
    end: str


class StructuralTag(BaseModel):
    """vLLM's structural tag (its guidance backend's form): free text, in which each of the
    `triggers` starts a structure whose `begin` it opens (a tool call in the midst of text)."""

    structures: list[Structure] = Field(min_length=1, max_length=MAX_STRUCTURES)
    triggers: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1,
                                                                 max_length=MAX_STRUCTURES)

    @model_validator(mode="after")
    def triggered(self):
        for at, structure in enumerate(self.structures):
            if not any(structure.begin.startswith(t) for t in self.triggers):
                raise ValueError(f"structures[{at}].begin {structure.begin!r} starts with "
                                 "none of the triggers")
        return self


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), any JSON object, or a JSON schema;
    vLLM's structural tag (its structures and triggers beside the type)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict] | None = None
    triggers: list | None = None
    format: object = None  # vLLM's newer structural tag (xgrammar's): not served

    def structural_tag(self) -> "StructuralTag":
        """The structural tag this format gives; FieldError naming what is wrong."""
        if self.format is not None:
            raise FieldError("response_format.format", "this server takes a structural tag "
                             "as its structures and triggers (vLLM's guidance backend's form)")
        try:
            return StructuralTag(structures=self.structures or [], triggers=self.triggers or [])
        except ValidationError as error:
            raise FieldError("response_format", tag_error(error)) from None


def tag_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"structural tag: {where + ': ' if where else ''}{first['msg']}"


class StructuredOutputs(BaseModel):
    """vLLM's extension: exactly one of a JSON schema, any JSON object, a regex, a list of
    choices or a grammar (Lark in llguidance's dialect, or GBNF). A field it does not know
    is refused: ignored, it would leave the output unconstrained."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # vLLM's: a structural tag as JSON text ({"structures": [...], "triggers": [...]})
    structural_tag: str | None = None

    @model_validator(mode="before")
    @classmethod
    def defaults_ask_nothing(cls, data):
        """null for a field, or one of vLLM's options at its default, is left out (as the
        body's own fields: null means the default)."""
        if isinstance(data, dict):
            data = {key: value for key, value in data.items()
                    if not (key in STRUCTURED_DEFAULTS and value is STRUCTURED_DEFAULTS[key])}
        return without_nulls(data)

    @field_validator("structural_tag")
    @classmethod
    def tag_read(cls, value):
        if value is None:
            return None
        try:
            return StructuralTag.model_validate_json(value).model_dump(by_alias=True)
        except ValidationError as error:
            raise ValueError(tag_error(error)) from None

    @field_validator("json_")
    @classmethod
    def schema_read(cls, value):
        """A schema given as text, read with the body (with the cycle collector held off:
        deployments.ingress.parse), not where it is compiled."""
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except RecursionError:
            raise ValueError("the schema is nested too deeply") from None


def without_nulls(data):
    """A body's (or a nested object's) fields sent as null left out: OpenAI's fields are
    nullable, and null means the default, as in vLLM."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def constraint_of(form: ResponseFormat | None, given: StructuredOutputs | None
                  ) -> tuple[str, str, object] | None:
    """(the field, the kind, the spec) of the output's constraint, if any: one of
    response_format and structured_outputs' fields; ValueError for more than one."""
    found = []
    if form is not None and form.type == "json_object":
        found.append(("response_format", "json", {"type": "object"}))
    elif form is not None and form.type == "json_schema":
        if form.json_schema is None:
            raise FieldError("response_format.json_schema",
                             "a response_format of type json_schema needs it")
        found.append(("response_format.json_schema", "json", form.json_schema.schema_))
    elif form is not None and form.type == "structural_tag":
        found.append(("response_format", "structural_tag",
                      form.structural_tag().model_dump(by_alias=True)))
    if given is not None and given.json_object:
        found.append(("structured_outputs.json_object", "json", {"type": "object"}))
    for kind in ("json", "regex", "choice", "grammar", "structural_tag"):
        spec = None if given is None else getattr(given, "json_" if kind == "json" else kind)
        if spec is not None:
            found.append((f"structured_outputs.{kind}", kind, spec))
    if len(found) > 1:
        raise ValueError("give one constraint: response_format or one field of "
                         f"structured_outputs, not {[field for field, _, _ in found]}")
    return found[0] if found else None

"""The structured-output requests the grammar benchmarks measure, one definition for both: the
CPU grammar-stage benchmark (benchmarks/grammar_stage.py) compiles them with xgrammar, the
serving benchmark (benchmarks/grammar_serve.py) sends them as SGLang sampling parameters.

Each kind is what a user asks for: a small JSON object (enums, a boolean), a JSON object with
length-bounded strings (the bounded repetitions whose mask fills cost the most), a regex, an
EBNF grammar, and an OpenAI tool call (the schema SGLang builds for tool_choice "required":
a JSON array of {name, parameters}).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["ada", "bob", "cy"]}, "ok": {"type": "boolean"},
    "tag": {"enum": ["x", "y", "z", "w"]}},
    "required": ["name", "ok", "tag"], "additionalProperties": False}
BOUNDED_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "minLength": 2, "maxLength": 40},
    "summary": {"type": "string", "maxLength": 300},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
    "score": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["title", "summary", "tags", "score"], "additionalProperties": False}
REGEX = r"(cat|dog|bird)-[0-9]{2,3}-(red|blue)"
LONG_REGEX = r"[a-z ]{120,160}"
EBNF = 'root ::= answer " " num\nanswer ::= "yes" | "no" | "maybe"\nnum ::= [0-9] [0-9]?'
TOOL_PARAMETERS = {"type": "object", "properties": {
    "city": {"enum": ["paris", "rome", "oslo"]}, "unit": {"enum": ["c", "f"]},
    "note": {"type": "string", "maxLength": 80}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOL_CALL_SCHEMA = {"type": "array", "minItems": 1, "items": {
    "type": "object", "properties": {"name": {"const": "get_weather"},
                                     "parameters": TOOL_PARAMETERS},
    "required": ["name", "parameters"], "additionalProperties": False}}


@dataclass(frozen=True)
class GrammarKind:
    """One kind of constrained request.

    param: SGLang's sampling parameter (json_schema, regex or ebnf); value: its string;
    sample: an output the grammar accepts (the CPU benchmark's target text; JSON in the
        separators xgrammar's schemas without free whitespace require, ", " and ": ")."""

    name: str
    param: str
    value: str
    sample: str


KINDS: dict[str, GrammarKind] = {k.name: k for k in (
    GrammarKind("json", "json_schema", json.dumps(SCHEMA),
                json.dumps({"name": "bob", "ok": True, "tag": "z"})),
    GrammarKind("json_bounded", "json_schema", json.dumps(BOUNDED_SCHEMA),
                json.dumps({"title": "A parser for config files", "summary":
                            "Reads the file line by line, splits each line at the first equals "
                            "sign and keeps the last value seen for every key; comments start "
                            "with a hash.", "tags": ["parsing", "config", "io"], "score": 87})),
    GrammarKind("regex", "regex", REGEX, "bird-417-blue"),
    GrammarKind("long_regex", "regex", LONG_REGEX,
                "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm "
                "mat and the bird sings a song about the long summer days"),
    GrammarKind("ebnf", "ebnf", EBNF, "maybe 42"),
    GrammarKind("tool_call", "json_schema", json.dumps(TOOL_CALL_SCHEMA),
                json.dumps([{"name": "get_weather", "parameters": {
                    "city": "oslo", "unit": "c",
                    "note": "bring a coat, it will rain in the evening"}}])),
)}


def kind_names(text: str) -> list[str]:
    """A comma list of kinds ('none' = unconstrained), each checked against KINDS."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x != "none" and x not in KINDS]
    if bad or not names:
        raise ValueError(f"unknown grammar kind(s) {', '.join(bad) or '(none given)'}; "
                         f"accepted: none, {', '.join(KINDS)}")
    return names


def sampling_constraint(name: str) -> dict[str, str]:
    """The sampling parameters that constrain a request of this kind ({} for 'none')."""
    if name == "none":
        return {}
    kind = KINDS[name]
    return {kind.param: kind.value}


def compile_kind(compiler, name: str):
    """The kind's grammar compiled by an xgrammar GrammarCompiler (JSON without free whitespace,
    as the servers run it: --constrained-json-disable-any-whitespace)."""
    kind = KINDS[name]
    if kind.param == "json_schema":
        return compiler.compile_json_schema(kind.value, any_whitespace=False)
    if kind.param == "regex":
        return compiler.compile_regex(kind.value)
    return compiler.compile_grammar(kind.value)


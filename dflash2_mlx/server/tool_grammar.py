"""Grammars that force a tool call, in the call format of the model's chat template.

`tool_choice: "required"` or a named function must produce a call that the model's own mlx-lm
parser reads back. Each format the server can force has a builder that writes the Lark text
(llguidance) of one call per allowed tool; arguments follow the tool's JSON schema:

- `json_tools` (Qwen2.5, Hermes): `{"name": ..., "arguments": {...}}` between the markers;
- `qwen3_coder` (Qwen3-Coder, Qwen3.5+): `<function=NAME>` with one `<parameter=KEY>` block per
  argument; strings are raw text up to `\\n</parameter>`, other values JSON;
- `pythonic` (LFM2, Llama-style): `[name(key=value, ...)]`, values as JSON literals (mlx-lm's
  parser maps true/false/null).

The XML and pythonic builders emit declared parameters in schema order, required ones always
and optional ones optionally: a stricter language than the parser reads, and every string in
it parses to arguments that satisfy the schema's required keys and value types.
"""

from __future__ import annotations

import json

from ..errors import ConfigError
from .errors import APIError

FORMATS = ("json_tools", "qwen3_coder", "pythonic")


def call_format(tokenizer) -> str:
    """The short name of the model's tool parser module ("json_tools", ...), "" when none."""
    return getattr(getattr(tokenizer, "tool_parser", None), "__module__", "").rsplit(".", 1)[-1]


def check_forced_format(tokenizer, choice: str, model_name: str, param: str = "tool_choice") -> None:
    """400 unless the model's tool-call format is one this server can force."""
    fmt = call_format(tokenizer)
    if fmt not in FORMATS:
        raise APIError(400, f"{param} {choice!r} forces a call, which this server can constrain only for the "
                            f"{', '.join(FORMATS)} tool-call formats; {model_name!r} uses {fmt!r} (use 'auto')",
                       "unsupported_parameter", param)


def forced_call_grammar(tokenizer, tools: list[dict], choice: str, parallel: bool, model_name: str,
                        param: str = "tool_choice") -> str:
    """An llguidance grammar that makes the model call a tool: `choice` "required" (any of
    `tools`, one or more calls when `parallel`) or one function's name."""
    from ..core.constraint import lark_grammar

    check_forced_format(tokenizer, choice, model_name, param)
    chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
    functions = [t["function"] for t in chosen]
    builder = {"json_tools": _json_calls, "qwen3_coder": _xml_calls, "pythonic": _pythonic_calls}
    rules = builder[call_format(tokenizer)](functions)
    open_, close = marker(tokenizer, tokenizer.tool_call_start), marker(tokenizer, tokenizer.tool_call_end)
    many = parallel and choice == "required"
    if call_format(tokenizer) == "pythonic":  # one marker pair holds a list of calls
        calls = 'call ("," " "? call)*' if many else "call"
        head = f'start: {open_} "[" {calls} "]" {close}'
    else:
        # A newline may end the reply too: models write one after each call (Qwen2.5 then ends), and a
        # grammar that takes it only before another call forces call after call until max_tokens.
        calls = "tc (/\\n?/ tc)*" if many else "tc"
        head = f"start: {calls} /\\n?/\ntc: {open_} /\\n?/ call /\\n?/ {close}"
    return lark_grammar(f"{head}\n{rules}", f"{param} schema")


def marker(tokenizer, text: str) -> str:
    """A call marker in Lark: its token id when it is one (added) token, which llguidance
    matches as a special token (`<[id]>`), else the quoted string."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


def _json(schema: dict) -> str:
    from ..core.constraint import BOUNDED_WHITESPACE

    return "%json " + json.dumps({"x-guidance": {"whitespace_pattern": BOUNDED_WHITESPACE}, **schema})


def _closed(params: dict) -> dict:
    """The arguments' schema with only the declared keys, as the other formats write them; a
    schema without `properties` (or one that allows extra keys explicitly) stays open."""
    if "properties" in params and "additionalProperties" not in params:
        return {**params, "additionalProperties": False}
    return params or {"type": "object"}


def _json_calls(functions: list[dict]) -> str:
    schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": f["name"]}, "arguments": _closed(f.get("parameters") or {})}}
                        for f in functions]}
    return f"call: {_json(schema)}\n"


def _literal(text: str) -> str:
    """`text` as a Lark string literal (quotes, backslashes and newlines escaped)."""
    return json.dumps(text, ensure_ascii=False)


def _parameters(function: dict) -> tuple[list[tuple[str, dict, bool]], bool]:
    """([(key, schema, required)] in schema order, whether undeclared keys are free)."""
    params = function.get("parameters") or {}
    props = params.get("properties", {})
    required = params.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list):
        raise ConfigError(f"tool {function['name']!r}: parameters.properties must be an object and "
                          f"parameters.required a list, got {type(props).__name__} and {type(required).__name__}")
    required = set(required)
    listed = [(key, schema if isinstance(schema, dict) else {}, key in required) for key, schema in props.items()]
    return listed, "properties" not in params


def _sequence(items: list[tuple[str, bool]], sep: str) -> str:
    """Lark for the items in order, optional ones optional, `sep` between those present: one
    alternative per possible first item (any optional one up to the first required)."""
    alts = []
    for j, (rule, required) in enumerate(items):
        tail = [f"{sep} {r}" if req else f"({sep} {r})?" for r, req in items[j + 1:]]
        alts.append(" ".join([rule, *tail]))
        if required:
            break
    else:
        alts.append('""')  # every item optional: none at all
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


def _xml_value(schema: dict, rule: str) -> str:
    """The rules for one parameter's value, up to and including `\\n</parameter>\\n`."""
    end = '"\\n</parameter>\\n"'
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return f"{rule}: ({' | '.join(_literal(v) for v in schema['enum'])}) {end}\n"
    types = schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]
    if "string" in types or "type" not in schema and "enum" not in schema:
        # raw text that stops at the first `\n</parameter>\n`, as the parser reads it
        return f"{rule}[lazy]: /(.|\\n)*\\n<\\/parameter>\\n/\n"
    return f"{rule}: {_json(schema)} {end}\n"


def _xml_calls(functions: list[dict]) -> str:
    alts, rules = [], []
    for i, function in enumerate(functions):
        params, free = _parameters(function)
        items = []
        for k, (key, schema, required) in enumerate(params):
            opener = _literal(f"<parameter={key}>\n")
            rules.append(f"p{i}_{k}: {opener} v{i}_{k}\n" + _xml_value(schema, f"v{i}_{k}"))
            items.append((f"p{i}_{k}", required))
        if free:  # no declared properties: any keys, raw text values
            rules.append(f'p{i}_any: "<parameter=" /[^\\s<>]+/ ">\\n" v{i}_any\n' + _xml_value({}, f"v{i}_any"))
            body = f"p{i}_any*"
        else:
            body = " ".join(rule if required else f"{rule}?" for rule, required in items) or '""'
        alts.append(f"c{i}")
        rules.append(f'c{i}: {_literal("<function=" + function["name"] + ">")} "\\n" {body} "</function>"\n')
    return f"call: {' | '.join(alts)}\n" + "".join(rules)


def _pythonic_calls(functions: list[dict]) -> str:
    alts, rules = [], []
    for i, function in enumerate(functions):
        params, free = _parameters(function)
        if free:
            rules.append(f'k{i}: /[A-Za-z_][A-Za-z0-9_]*/ "=" {_json({})}\n')
            body = f'(k{i} (", " k{i})*)?'
        else:
            items = []
            for k, (key, schema, required) in enumerate(params):
                rules.append(f"k{i}_{k}: {_literal(key + '=')} {_json(schema)}\n")
                items.append((f"k{i}_{k}", required))
            body = _sequence(items, '", "')
        alts.append(f"c{i}")
        rules.append(f'c{i}: {_literal(function["name"] + "(")} {body} ")"\n')
    return f"call: {' | '.join(alts)}\n" + "".join(rules)

"""Tool calling: tools rendered by the model's chat template, calls parsed by mlx-lm's parser.

The model's tokenizer (mlx-lm's `TokenizerWrapper`) knows its tool-call markers and parser
(`has_tool_calling`, `tool_call_start` / `tool_call_end`, `tool_parser`), inferred from the chat
template. `ToolCallStream` splits the generated text into plain content and tool-call events
as it streams: text between the markers is parsed when the end marker arrives (or when
generation stops inside a call). In the JSON call format (`{"name": ..., "arguments": ...}`,
Qwen2.5 / Hermes) a call is announced as soon as its name is written and its arguments stream
as the model writes them (`CallEvent` start / args / end), so a long `write_file` call shows
progress; other formats deliver a call whole when it closes. The API modules shape the events
into their own formats.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import APIError
from .reasoning import partial_marker

MAX_TOOLS = 128


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int) -> dict:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class CallEvent:
    """A step of a tool call as it streams: `start` (name known), `args` (`delta`: more of the
    arguments' JSON text; all deltas of a call join into its arguments), `end` (arguments set),
    or `cut` (the token limit ended the reply inside it: not a call)."""

    kind: str
    call: ToolCall
    index: int  # the call's number in the reply
    delta: str = ""


_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*')
_JSON_TAIL = re.compile(r'\s*(\}\s*)?$')  # the call object's own closing brace, held back


def check_tools(tools: list[dict], param: str = "tools") -> list[dict]:
    """OpenAI-style `[{"type": "function", "function": {"name", "description", "parameters"}}]`,
    validated; 400 naming the first bad entry."""
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"{param} has {len(tools)} entries; at most {MAX_TOOLS}", "invalid_value", param)
    names = set()
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"{where} must be {{'type': 'function', 'function': {{...}}}}", "invalid_value", where)
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise APIError(400, f"{where}.function.name must be a string of 1..64 characters, got {name!r}",
                           "invalid_value", f"{where}.function.name")
        if name in names:
            raise APIError(400, f"{where}: tool {name!r} is defined twice", "invalid_value", where)
        names.add(name)
        params = fn.get("parameters", {})
        if not isinstance(params, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON schema object, got "
                                f"{type(params).__name__}", "invalid_value", f"{where}.function.parameters")
    return tools


def tool_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def resolve_tool_choice(choice: Any, tools: list[dict] | None, param: str = "tool_choice") -> str:
    """"none", "auto", "required", or the name of the function to force; 400 for an unknown
    name or a malformed choice."""
    if choice is None:
        return "auto" if tools else "none"
    if not tools:
        raise APIError(400, f"{param} was given without tools", "invalid_value", param)
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise APIError(400, f"{param} must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                                "{'name': ...}}", "invalid_value", param)
        if name not in tool_names(tools):
            raise APIError(400, f"{param} names {name!r}, which is not among the tools "
                                f"({', '.join(tool_names(tools))})", "invalid_value", param)
        return name
    raise APIError(400, f"{param} must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                   "invalid_value", param)


async def forced_call_constraint(state, tool_list: list[dict] | None, choice: str, parallel: bool):
    """The grammar constraint that forces a call (`required` / a named function), else None."""
    if tool_list is None or choice == "auto":
        return None
    from . import dispatch
    from .tool_grammar import check_forced_format, forced_call_grammar

    tok = state.session.target.tokenizer
    check_forced_format(tok, choice, state.model_name)
    return await dispatch.grammar_constraint(
        state, lambda: forced_call_grammar(tok, tool_list, choice, parallel, state.model_name), "tool_choice")


def check_model_tools(tokenizer, model_name: str, param: str = "tools") -> None:
    """400 naming the model when its chat template has no tool-call format mlx-lm can parse."""
    if not getattr(tokenizer, "has_tool_calling", False):
        raise APIError(400, f"{model_name!r} does not support tool calling (its chat template has no tool-call "
                            "format this server can parse)", "unsupported_parameter", param)


def template_messages(messages: list[dict], param: str = "messages") -> list[dict]:
    """Assistant `tool_calls` with JSON-string arguments → dicts (what chat templates iterate)."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise APIError(400, f"{param}[{i}].tool_calls[{j}] needs a function with a name", "invalid_value",
                                   f"{param}[{i}].tool_calls[{j}]")
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError as e:
                        raise APIError(400, f"{param}[{i}].tool_calls[{j}].function.arguments is not valid JSON: "
                                            f"{e.msg}", "invalid_value",
                                       f"{param}[{i}].tool_calls[{j}].function.arguments") from None
                fixed.append({**call, "type": "function", "function": {"name": fn["name"], "arguments": args}})
            m["tool_calls"] = fixed
        out.append(m)
    return out


class ToolCallStream:
    """Feed generated text; get back, in order, content to show now and `CallEvent`s."""

    def __init__(self, tokenizer, tools: list[dict]):
        self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end
        self.parser, self.tools = tokenizer.tool_parser, tools
        self.pending = ""  # text that may be the start of a marker
        self.inside = False  # between a call's markers
        self.live: ToolCall | None = None  # the call whose arguments are streaming
        self.args_at, self.sent = 0, 0  # where its arguments start in the body; characters sent
        self.count = 0  # calls announced

    def feed(self, text: str) -> list:
        self.pending += text
        out: list = []
        while True:
            if not self.inside:
                at = self.pending.find(self.start)
                if at < 0:
                    keep = partial_marker(self.pending, self.start)
                    _text(out, self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                _text(out, self.pending[:at])
                self.pending, self.inside = self.pending[at + len(self.start) :], True
            else:
                at = self.pending.find(self.end) if self.end else -1
                if at < 0:
                    out += self._progress(self.pending[: len(self.pending) - partial_marker(self.pending, self.end)])
                    break
                out += self._close(self.pending[:at], self.start + self.pending[:at] + self.end)
                self.pending, self.inside = self.pending[at + len(self.end) :], False
        return out

    def finish(self) -> list:
        """At the end of generation: a call without its end marker is parsed as it stands; one
        already announced that does not parse was cut by the token limit (a `cut` event)."""
        if self.inside:
            body, self.pending, self.inside = self.pending, "", False
            if self.live is not None and self._parse(body) is None:
                live, self.live = self.live, None
                return [CallEvent("cut", live, self.count - 1)]
            return self._close(body, self.start + body)
        rest, self.pending = self.pending, ""
        return [rest] if rest else []

    def _progress(self, body: str) -> list:
        """Events for a call still being written: its start once the name is known, then arguments."""
        out: list = []
        if self.live is None:
            head = _JSON_HEAD.match(body)
            if head is None:
                return out
            self.live, self.args_at, self.sent = ToolCall(head.group(1), {}), head.end(), 0
            out.append(CallEvent("start", self.live, self._announce()))
        args = body[self.args_at :]
        safe = _JSON_TAIL.search(args).start()
        if safe > self.sent:
            out.append(CallEvent("args", self.live, self.count - 1, args[self.sent : safe]))
            self.sent = safe
        return out

    def _close(self, body: str, raw: str) -> list:
        """Events for a finished call body: the live call's rest and end, then any further calls."""
        calls = self._parse(body)
        out: list = []
        live, self.live = self.live, None
        if calls is None:
            if live is None:  # unparseable: shown as the text it is, not dropped
                return [raw]
            calls = [ToolCall(live.name, {"_raw": body[self.args_at :]})]
        for i, call in enumerate(calls):
            if i == 0 and live is not None and call.name == live.name:
                live.arguments = call.arguments
                tail = body[self.args_at :]
                tail = tail[: _JSON_TAIL.search(tail).start()]
                if "_raw" in call.arguments or _loads(tail) != call.arguments:
                    tail = json.dumps(call.arguments, ensure_ascii=False)[self.sent :] if self.sent == 0 else ""
                else:
                    tail = tail[self.sent :]
                if tail:
                    out.append(CallEvent("args", live, self.count - 1, tail))
                out.append(CallEvent("end", live, self.count - 1))
                continue
            index = self._announce()
            out += [CallEvent("start", call, index),
                    CallEvent("args", call, index, json.dumps(call.arguments, ensure_ascii=False)),
                    CallEvent("end", call, index)]
        return out

    def _announce(self) -> int:
        self.count += 1
        return self.count - 1

    def _parse(self, text: str) -> list[ToolCall] | None:
        """The calls in `text`, or None when the parser cannot read what the model wrote."""
        try:
            parsed = self.parser(text, self.tools)
        except Exception:  # parsers raise anything from JSONDecodeError to IndexError
            return None
        if not isinstance(parsed, (dict, list)):
            return None
        calls = []
        for item in parsed if isinstance(parsed, list) else [parsed]:
            args = item.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    args = {"_raw": args}
            calls.append(ToolCall(str(item.get("name")), args if isinstance(args, dict) else {"value": args}))
        return calls


def _text(out: list, text: str) -> None:
    if text:
        out.append(text)


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


_BARE_START = re.compile(r'\s*(```json\s*)?(\[\s*)?\{\s*"name"\s*:')
_BARE_PREFIX = re.compile(r'\s*(`{1,3}(j(s(o(n)?)?)?)?\s*)?(\[\s*)?(\{\s*("(n(a(m(e("\s*)?)?)?)?)?)?)?')
_FENCE = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


class BareCalls:
    """Small models of the JSON call format (Qwen2.5-Coder-0.5B among them) often answer a tool
    request with the call's JSON alone, without the `<tool_call>` markers. A reply that is
    exactly such a call, or a list of them (optionally in a ```json fence), naming only given
    tools with object arguments, is read as calls; any other reply passes through as content.
    Text that may still become one is held back, so a streamed call never leaks as content."""

    def __init__(self, names: list[str]):
        self.names, self.held, self.state = set(names), "", "undecided"  # -> "holding" | "off"

    def feed(self, text: str) -> str:
        """The text to pass on now."""
        if self.state == "off":
            return text
        self.held += text
        if self.state == "holding" or _BARE_START.match(self.held):
            self.state = "holding"
            return ""
        if _BARE_PREFIX.fullmatch(self.held):
            return ""
        self.state, out, self.held = "off", self.held, ""
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self.held = self.held, ""
        calls = self._calls(text) if self.state == "holding" else None
        return ("", calls) if calls else (text, [])

    def _calls(self, text: str) -> list[ToolCall] | None:
        fenced = _FENCE.fullmatch(text)
        try:
            parsed = json.loads(fenced.group(1) if fenced else text)
        except json.JSONDecodeError:
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        if not items or not all(isinstance(i, dict) and set(i) == {"name", "arguments"} and i["name"] in self.names
                                and isinstance(i["arguments"], dict) for i in items):
            return None
        return [ToolCall(i["name"], i["arguments"]) for i in items]


class CallCollector:
    """Splits a reply into content and tool calls (a pass-through when the request has no tools);
    with parallel_tool_calls false only the first call is kept.

    `events` / `finish_events` give the reply in order, as text and `CallEvent`s (for streams);
    `feed` / `finish` give (content, finished calls) (for whole replies). `calls` collects the
    finished calls either way. `forced` (tool_choice required / a named tool): the grammar lets
    the model write only calls and the whitespace around them, so no text is content, and a
    call cut short by max_tokens is dropped rather than shown as its markup."""

    def __init__(self, tokenizer, tool_list: list[dict] | None, parallel: bool = True, forced: bool = False):
        from .tool_grammar import call_format

        self.stream = ToolCallStream(tokenizer, tool_list) if tool_list else None
        json_calls = tool_list and call_format(tokenizer) == "json_tools"
        self.bare = BareCalls(tool_names(tool_list)) if json_calls else None
        self.parallel, self.forced, self.calls = parallel, forced and bool(tool_list), []

    def _keep(self, items: list) -> list:
        out = []
        for item in items:
            if isinstance(item, str) and self.forced:
                continue
            if isinstance(item, CallEvent):
                if not self.parallel and item.index > 0:
                    continue
                if item.kind == "end":
                    self.calls.append(item.call)
            out.append(item)
        return out

    def events(self, text: str) -> list:
        if self.stream is None:
            return [text] if text else []
        return self._keep(self.stream.feed(self.bare.feed(text) if self.bare else text))

    def finish_events(self) -> list:
        if self.stream is None:
            return []
        items = []
        if self.bare is not None:
            held, bare_calls = self.bare.finish()
            for call in bare_calls:
                index = self.stream._announce()
                items += [CallEvent("start", call, index),
                          CallEvent("args", call, index, json.dumps(call.arguments, ensure_ascii=False)),
                          CallEvent("end", call, index)]
            items += self.stream.feed(held)
        return self._keep(items + self.stream.finish())

    def feed(self, text: str) -> tuple[str, list]:
        return _split(self.events(text))

    def finish(self) -> tuple[str, list]:
        return _split(self.finish_events())

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def deltas(self, items: list) -> list[dict]:
        """OpenAI stream choices for call events: the call's id and name first, then argument pieces."""
        out = []
        for e in items:
            if not isinstance(e, CallEvent) or e.kind == "end":
                continue
            call = ({"index": e.index, "id": e.call.id, "type": "function",
                     "function": {"name": e.call.name, "arguments": ""}} if e.kind == "start"
                    else {"index": e.index, "function": {"arguments": e.delta}})
            out.append({"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None})
        return out


def _split(items: list) -> tuple[str, list]:
    """(the text of `items`, the calls they finish)."""
    return ("".join(i for i in items if isinstance(i, str)),
            [i.call for i in items if isinstance(i, CallEvent) and i.kind == "end"])

"""OpenAI Responses API: POST /v1/responses (streamed or not) and GET /v1/responses/{id}.

Codex (which speaks only this API) and SDK agents (`client.responses.create`) use it. A request
is turned into the chat path's pieces and runs through the same worker, tool grammar, prefix
cache and constraints as /v1/chat/completions:

* `input`: a string, or items: messages (`input_text` / `output_text` parts, any role),
  `function_call`, `function_call_output` and `reasoning` (skipped: nothing to re-feed).
  `instructions` and every `system` / `developer` message are merged, in order, into one leading
  system message (Qwen templates refuse a system message after the first turn).
* `tools`: flat functions; Codex's `namespace` groups are flattened as `namespace__name` (the
  namespace's trailing underscores dropped, as Codex joins them) and calls are answered with the
  leaf `name` and its `namespace`. Hosted built-ins (`web_search`, `file_search`, ...) cannot run
  here and are refused by name.
* `text.format` (`json_object`, `json_schema`) constrains the output inside speculation.
* State: responses with `store` (default true) are kept in a bounded in-memory store, so
  `previous_response_id` continues a stored conversation and GET /v1/responses/{id} returns one;
  an id the store lacks (evicted, `store: false`, a restart) is a 400 naming it.
* Ignored on purpose (no meaning on a local server): `include` (no encrypted reasoning exists
  here), `prompt_cache_key` (the prefix cache needs no key), `metadata`, `client_metadata`,
  `user`, `service_tier`, `safety_identifier`, `truncation` (an over-long prompt is refused).

Streams are the documented event sequence (`response.created`, `.in_progress`,
`.output_item.added`, `.content_part.added`, `.output_text.delta` / `.done`,
`.function_call_arguments.delta` / `.done`, `.output_item.done`, `.completed` or `.incomplete`),
each with a `sequence_number`; any error after `response.created` is a `response.failed` event.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from . import dispatch, reasoning, tools
from .dispatch import ServerState, StateDep
from .errors import APIError
from .schema import ResponsesRequest
from .worker import IDLE, Job, JobFailed

router = APIRouter(prefix="/v1", tags=["openai"])

TEXT_PARTS = ("input_text", "output_text", "text")


# -- request -> chat pieces ------------------------------------------------------------------------


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts", "invalid_value", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content[{j}] is a {kind!r} part; only input_text / output_text parts "
                                "are supported", "unsupported_parameter", f"{where}.content[{j}]")
        out.append(part["text"])
    return "".join(out)


def _join(namespace: str, name: str) -> str:
    return f"{namespace.rstrip('_')}__{name}"


def input_messages(body: ResponsesRequest) -> tuple[list[str], list[dict]]:
    """(system texts in order, the other messages as chat-template dicts) of `instructions` + `input`."""
    systems = [body.instructions] if body.instructions else []
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", "invalid_value", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            text = _text(item.get("content", ""), where)
            if role in ("system", "developer"):
                systems.append(text)
            elif role in ("user", "assistant"):
                messages.append({"role": role, "content": text})
            else:
                raise APIError(400, f"{where}.role must be user, assistant, system or developer, got {role!r}",
                               "invalid_value", f"{where}.role")
        elif kind == "function_call":
            name = item.get("name")
            if not isinstance(name, str) or not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call needs a name and a call_id", "invalid_value", where)
            if item.get("namespace"):
                name = _join(item["namespace"], name)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": name, "arguments": item.get("arguments") or "{}"}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else _text(output, where)
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text})
        elif kind == "reasoning":
            continue  # a reasoning summary is the model's own aside; templates do not re-feed it
        else:
            raise APIError(400, f"{where} is a {kind!r} item; supported: message, function_call, "
                                "function_call_output, reasoning", "unsupported_parameter", where)
    return systems, tools.template_messages(messages, param="input")


def flat_tools(body: ResponsesRequest) -> tuple[list[dict] | None, dict[str, tuple[str, str]]]:
    """(tools in the chat form, or None; {flat name: (namespace, leaf name)} for namespaced ones)."""
    if not body.tools:
        return None, {}
    out, spaces = [], {}

    def function(tool: dict, where: str, namespace: str | None = None) -> None:
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where}.name must be a non-empty string", "invalid_value", f"{where}.name")
        flat = _join(namespace, name) if namespace else name
        if namespace:
            spaces[flat] = (namespace, name)
        out.append({"type": "function", "function": {"name": flat, "description": tool.get("description") or "",
                                                     "parameters": tool.get("parameters") or {}}})

    for i, tool in enumerate(body.tools):
        kind = tool.get("type")
        if kind == "function":
            function(tool, f"tools[{i}]")
        elif kind == "namespace":
            for j, sub in enumerate(tool.get("tools") or []):
                if sub.get("type", "function") != "function":
                    raise APIError(400, f"tools[{i}].tools[{j}] is a {sub.get('type')!r} tool; a namespace holds "
                                        "functions", "unsupported_parameter", f"tools[{i}].tools[{j}]")
                function(sub, f"tools[{i}].tools[{j}]", tool.get("name") or "")
        else:
            hint = ' (Codex: set web_search = "disabled" in its config.toml)' if kind == "web_search" else ""
            raise APIError(400, f"tools[{i}] is the hosted tool {kind!r}, which runs on OpenAI's servers, not on "
                                f"this one; send function tools only{hint}", "unsupported_parameter", f"tools[{i}]")
    tools.check_tools(out)
    return out, spaces


def _tool_choice(body: ResponsesRequest, spaces: dict) -> str | dict | None:
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                           "invalid_value", "tool_choice")
        name = choice["name"]
        name = _join(choice["namespace"], name) if choice.get("namespace") else name
        return {"type": "function", "function": {"name": name}}
    return choice


async def _text_format(state: ServerState, body: ResponsesRequest):
    fmt = (body.text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return await dispatch.json_constraint(state, None, "text.format")
    if kind == "json_schema":
        return await dispatch.json_constraint(state, fmt.get("schema") or {}, "text.format.schema")
    raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}", "invalid_value",
                   "text.format.type")


# -- output items --------------------------------------------------------------------------------


def _call_item(call, spaces: dict, status: str = "completed", arguments: str | None = None) -> dict:
    item = {"type": "function_call", "id": f"fc_{call.id[5:]}", "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments, ensure_ascii=False) if arguments is None else arguments,
            "status": status}
    if call.name in spaces:
        item["namespace"], item["name"] = spaces[call.name]
    return item


def _message_item(item_id: str, text: str | None, status: str = "completed", logprobs=None) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": logprobs or []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def _usage(job: Job) -> dict:
    s = job.stats
    return {"input_tokens": s.prompt_n, "input_tokens_details": {"cached_tokens": s.cached_tokens},
            "output_tokens": s.predicted_n, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": s.prompt_n + s.predicted_n}


def _response(state: ServerState, body: ResponsesRequest, job: Job, created: int, status: str, output: list,
              error: dict | None = None) -> dict:
    done = status in ("completed", "incomplete")
    return {"id": f"resp_{job.id}", "object": "response", "created_at": created, "status": status,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": state.model_name, "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": body.reasoning or {},
            "store": body.store is not False, "temperature": body.temperature, "top_p": body.top_p,
            "text": body.text or {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "usage": _usage(job) if done else None, "metadata": body.metadata or {}}


def _status(job: Job) -> str:
    return "incomplete" if job.stats.finish_reason == "length" else "completed"


def _logprob_entries(state: ServerState, lps) -> list[dict]:
    from .openai_api import _chat_logprobs

    return (_chat_logprobs(state, lps) or {}).get("content", [])


# -- the route ------------------------------------------------------------------------------------


@router.post("/responses", summary="Create a response (OpenAI Responses API)")
async def create_response(body: ResponsesRequest, request: Request, state: StateDep):
    dispatch.check_model(state, body.model)
    dispatch.check_unsupported(body)
    systems, messages = input_messages(body)
    if body.previous_response_id:
        earlier, _ = state.responses.get(body.previous_response_id)
        messages = earlier + messages
    tool_list, spaces = flat_tools(body)
    choice = tools.resolve_tool_choice(_tool_choice(body, spaces), tool_list)
    if tool_list and choice != "none":
        tools.check_model_tools(state.session.target.tokenizer, state.model_name)
    else:
        tool_list = None
    effort = (body.reasoning or {}).get("effort")
    template = dispatch.template_kwargs(state, reasoning_effort=effort)
    if tool_list:
        template["tools"] = tool_list
    chat = ([{"role": "system", "content": "\n\n".join(systems)}] if systems else []) + messages
    ids = await dispatch.encode(state, chat, raw=False, template=template)
    constraint = await _text_format(state, body)
    if constraint is not None and tool_list:
        raise APIError(400, "text.format json with tools is not supported (the call format has its own grammar)",
                       "unsupported_parameter", "text.format")
    parallel = body.parallel_tool_calls is not False
    if constraint is None:
        constraint = await tools.forced_call_constraint(state, tool_list, choice, parallel)
    dispatch.check_prompt(state, ids)
    n_max = dispatch.max_tokens(state, body.max_output_tokens, name="max_output_tokens")
    n_max = dispatch.fit_context(state, len(ids), n_max, explicit=body.max_output_tokens is not None,
                                 name="max_output_tokens")
    params = dispatch.sampling(state, temperature=body.temperature, top_p=body.top_p)
    logprobs = body.top_logprobs if body.top_logprobs is not None else (
        0 if "message.output_text.logprobs" in (body.include or []) else None)
    job = dispatch.submit(state, ids, params, n_max, [], "responses", logprobs, constraint)
    calls = tools.CallCollector(state.session.target.tokenizer, tool_list, parallel,
                                forced=choice not in ("auto", "none"))
    split = reasoning.ReasoningSplit.for_prompt(state.session.target.tokenizer, ids)
    run = _Run(state, body, job, calls, spaces, messages, split)
    if body.stream:
        return EventSourceResponse(dispatch.guarded(state, job, run.events()), sep="\n", ping=state.config.heartbeat,
                                   shutdown_grace_period=state.config.shutdown_timeout)
    text, _ = await dispatch.collect(request, state, job)
    thought, text = reasoning.split_all(split, text)
    content, _ = calls.feed(text)
    rest, _ = calls.finish()
    content += rest
    output = [_reasoning_item(f"rs_{job.id}", thought)] if thought else []
    output += [] if not content and calls.calls else [
        _message_item(f"msg_{job.id}", content, logprobs=_logprob_entries(state, job.logprobs)
                      if job.top_logprobs is not None else None)]
    output += [_call_item(c, spaces) for c in calls.calls]
    return run.finish(output)


@router.get("/responses/{response_id}", summary="A stored response (OpenAI Responses API)")
async def get_response(response_id: str, state: StateDep):
    return state.responses.get(response_id, param="response_id")[1]


class _Run:
    """One response being made: its stream of events and the stored conversation at the end."""

    def __init__(self, state, body, job, calls, spaces, messages, split=None):
        self.state, self.body, self.job, self.calls, self.spaces = state, body, job, calls, spaces
        self.split, self.thought = split, None  # the open reasoning item: (index, id, pieces)
        self.messages, self.created, self.seq = messages, int(time.time()), 0
        self.open_calls: dict[str, tuple[int, list[str]]] = {}  # call id -> (output index, argument pieces)

    def finish(self, output: list) -> dict:
        response = _response(self.state, self.body, self.job, self.created, _status(self.job), output)
        if self.body.store is not False:
            reply = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
            turn = {"role": "assistant", "content": reply}
            calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                     for c in self.calls.calls]
            if calls:
                turn["tool_calls"] = calls
            self.state.responses.put(response["id"], self.messages + [turn], response)
        return response

    def _event(self, kind: str, **data) -> dict:
        self.seq += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.seq - 1, **data},
                                                  ensure_ascii=False)}

    async def events(self):
        state, job = self.state, self.job
        head = _response(state, self.body, job, self.created, "in_progress", [])
        yield self._event("response.created", response=head)
        yield self._event("response.in_progress", response=head)
        output: list[dict] = []
        text = _OpenText()
        try:
            async for event in job.events(idle=state.config.heartbeat):
                if event is IDLE:  # Codex counts events, not SSE comments, against its idle timeout
                    yield self._event("response.in_progress", response=_response(
                        state, self.body, job, self.created, "in_progress", output))
                    continue
                content = ""
                for kind, piece in reasoning.pieces(self.split, event.text):
                    if kind == reasoning.REASONING:
                        for e in self._reasoning(output, piece):
                            yield e
                    else:
                        content += piece
                if content:
                    for e in self._close_reasoning(output):
                        yield e
                items = self.calls.events(content)
                shown = "".join(i for i in items if isinstance(i, str))
                if shown or event.logprobs:  # text precedes a call opened by the same event
                    for e in self._text(output, text, shown, event.logprobs):
                        yield e
                for e in self._calls(output, text, items):
                    yield e
            held = reasoning.pieces(self.split, "", final=True)
            for e in self._reasoning(output, "".join(t for k, t in held if k == reasoning.REASONING)):
                yield e
            for e in self._close_reasoning(output):
                yield e
            items = self.calls.events("".join(t for k, t in held if k == reasoning.CONTENT))
            items += self.calls.finish_events()
            for e in self._text(output, text, "".join(i for i in items if isinstance(i, str)), None):
                yield e
            for e in self._calls(output, text, items):
                yield e
        except JobFailed as e:
            error = dispatch.failure_error(e)
            failed = _response(state, self.body, job, self.created, "failed", output,
                               {"code": error.code or error.kind, "message": error.message})
            yield self._event("response.failed", response=failed)
            return
        if not output and text.id is None:  # an empty reply is an empty message, not no output
            for e in self._text(output, text, "", None, force=True):
                yield e
        for e in self._close_text(output, text):
            yield e
        final = self.finish(output)
        yield self._event(f"response.{final['status']}", response=final)

    def _text(self, output, text, shown: str, lps, force: bool = False):
        if not shown and not lps and not force:
            return
        if text.id is None:
            text.id, text.index, text.parts, text.lps = f"msg_{uuid.uuid4().hex[:24]}", len(output), [], []
            output.append(_message_item(text.id, None, "in_progress"))
            yield self._event("response.output_item.added", output_index=text.index, item=output[-1])
            yield self._event("response.content_part.added", item_id=text.id, output_index=text.index,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        entries = _logprob_entries(self.state, lps) if lps else []
        text.parts.append(shown)
        text.lps.extend(entries)
        if shown or entries:
            yield self._event("response.output_text.delta", item_id=text.id, output_index=text.index,
                              content_index=0, delta=shown, logprobs=entries)

    def _reasoning(self, output, piece: str):
        if not piece:
            return
        if self.thought is None:
            self.thought = (len(output), f"rs_{uuid.uuid4().hex[:24]}", [])
            output.append(_reasoning_item(self.thought[1], None, "in_progress"))
            yield self._event("response.output_item.added", output_index=self.thought[0], item=output[-1])
        index, item_id, parts = self.thought
        parts.append(piece)
        yield self._event("response.reasoning_text.delta", item_id=item_id, output_index=index, content_index=0,
                          delta=piece)

    def _close_reasoning(self, output):
        if self.thought is None:
            return
        index, item_id, parts = self.thought
        yield self._event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                          text="".join(parts))
        output[index] = _reasoning_item(item_id, "".join(parts))
        yield self._event("response.output_item.done", output_index=index, item=output[index])
        self.thought = None

    def _close_text(self, output, text):
        if text.id is None:
            return
        full = "".join(text.parts)
        part = {"type": "output_text", "text": full, "annotations": [], "logprobs": text.lps}
        yield self._event("response.output_text.done", item_id=text.id, output_index=text.index, content_index=0,
                          text=full, logprobs=text.lps)
        yield self._event("response.content_part.done", item_id=text.id, output_index=text.index, content_index=0,
                          part=part)
        output[text.index] = _message_item(text.id, full, logprobs=text.lps)
        yield self._event("response.output_item.done", output_index=text.index, item=output[text.index])
        text.id = None

    def _calls(self, output, text, items: list):
        """Function-call items from `CallEvent`s: added at the start, arguments as they stream, done."""
        for e in items:
            if isinstance(e, str):
                continue
            if e.kind == "start":
                for ev in self._close_text(output, text):
                    yield ev
                self.open_calls[e.call.id] = (len(output), [])
                output.append(_call_item(e.call, self.spaces, "in_progress", ""))
                yield self._event("response.output_item.added", output_index=len(output) - 1, item=output[-1])
                continue
            index, parts = self.open_calls[e.call.id]
            item_id = output[index]["id"]
            if e.kind == "args" and e.delta:
                parts.append(e.delta)
                yield self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                  delta=e.delta)
            elif e.kind in ("end", "cut"):
                arguments = "".join(parts)
                yield self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                  arguments=arguments)
                status = "completed" if e.kind == "end" else "incomplete"
                output[index] = _call_item(e.call, self.spaces, status, arguments=arguments)
                yield self._event("response.output_item.done", output_index=index, item=output[index])


class _OpenText:
    """The message item being streamed (id None when no text item is open)."""

    id: str | None = None
    index: int = 0
    parts: list[str]
    lps: list[dict]

"""Tool calling on /v1/chat/completions: OpenAI's ``tools`` and ``tool_choice``, by grammar.

The tools go to the chat template (``tools``), so a template that supports them shows them to
the model in its own format. What the model may answer is then fixed by a grammar
(``pd_fsm/jax_engine/sampling/grammar.py``), whatever the model, so a call always parses and names a
tool with arguments that match its ``parameters`` schema:

* ``tool_choice: "required"`` or a named function: the answer is one JSON call object,
  ``{"name": ..., "arguments": {...}}`` (any of the tools, or the named one);
* ``"auto"`` (OpenAI's default when tools are given): plain text that does not start with
  ``<``, or one call in Hermes' form, ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` (the form of Qwen2.5's and Hermes' templates);
* ``"none"``: no grammar; plain text.

A call comes back as ``message.tool_calls`` (arguments as JSON text) with ``finish_reason:
"tool_calls"``. One call per answer (``parallel_tool_calls`` allows, and does not require, more).
Under PD, P and D read the same body, so P's first token obeys the same grammar.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal

import attrs

from pd_fsm.jax_engine.sampling.grammar import Constraint

MAX_TOOLS = 64
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

ToolMode = Literal["auto", "required", "named"]


class ToolError(ValueError):
    """A ``tools`` / ``tool_choice`` the worker refuses (the message names the field)."""


@attrs.frozen
class Tools:
    """A request's tools, how it may call them, and what the template is given."""

    mode: ToolMode
    names: tuple[str, ...]  # the tools the answer may call
    definitions: tuple[dict[str, Any], ...]  # every tool, as the client gave it

    def constraint(self) -> Constraint:
        calls = [_call_schema(d["function"]) for d in self.definitions
                 if d["function"]["name"] in self.names]
        schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {**schema, "x-guidance": _COMPACT}
        if self.mode != "auto":
            return Constraint("json_schema", json.dumps(schema))
        lark = (f"start: call | text\ncall: {json.dumps(_OPEN)} %json {json.dumps(schema)} "
                f"{json.dumps(_CLOSE)}\ntext: /[^<][\\s\\S]*/\n")
        return Constraint("lark", lark)

    def calls_in(self, text: str, call_id: str) -> list[dict[str, Any]] | None:
        """The answer's tool calls, or None when it is plain text (or a call cut short)."""
        body = text
        if self.mode == "auto":
            if not (text.startswith(_OPEN) and text.endswith(_CLOSE)):
                return None
            body = text[len(_OPEN) : -len(_CLOSE)]
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.names:
            return None
        return [{"id": call_id, "type": "function",
                 "function": {"name": call["name"],
                              "arguments": json.dumps(call.get("arguments", {}))}}]


def call_id(rid: str, index: int) -> str:
    return "call_" + hashlib.sha256(f"{rid}/{index}".encode()).hexdigest()[:24]


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": function["name"]},
                           "arguments": function.get("parameters") or {"type": "object"}}}


def parse_tools(tools: Any, choice: Any) -> Tools | None:
    """``tools`` and ``tool_choice`` of a chat body; None when no tool may be called."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice must come with tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"tools must be a list of at most {MAX_TOOLS} functions")
    names: list[str] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                function, dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name) or name in names:
            raise ToolError(f"tools[{i}].function.name must be a distinct name of 1-64 letters, "
                            "digits, '_' or '-'")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(name)
    if choice in (None, "auto"):
        return Tools("auto", tuple(names), tuple(tools))
    if choice == "none":
        return None
    if choice == "required":
        return Tools("required", tuple(names), tuple(tools))
    function = choice.get("function") if isinstance(choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or named not in names:
        raise ToolError("tool_choice must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": <one of tools>}}")
    return Tools("named", (named,), tuple(tools))

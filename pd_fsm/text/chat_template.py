"""A checkpoint's own Jinja chat template, compiled and rendered the way transformers does it.

Checkpoints ship their prompt format as a Jinja template (GGUF ``tokenizer.chat_template``, HF
``tokenizer_config.json``); rendering that template, rather than re-implementing each format by
hand, is what keeps our prompts byte-identical to transformers / vLLM / sglang. The environment
copies transformers' ``_compile_jinja_template``: ``trim_blocks`` / ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` that does not HTML-escape, and the ``raise_exception`` /
``strftime_now`` globals templates call. It is an ``ImmutableSandboxedEnvironment`` because a
template is code from a model download or a ``--chat-template`` file: the sandbox refuses access
to Python internals (``__class__``, ``__globals__``, ...) and in-place mutation of the messages.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any, NoReturn

import attrs
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The format the tiny model has always used (it has no checkpoint): SmolLM2's template without
# its default system message.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

NO_TEMPLATE_MESSAGE = "this model has no chat template; pass --chat-template FILE"


@attrs.frozen
class ChatMessage:
    """One turn of a conversation, as a template renders it (here, not in ``tokenizer``, which
    renders through this module and re-exports it)."""

    role: str
    content: str | None
    # An assistant turn's tool calls (OpenAI's objects), and a tool turn's answer's call id:
    # what chat templates that support tools render.
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None


class ChatTemplateError(ValueError):
    """A template that does not compile, refuses to render (``raise_exception``, the sandbox), or
    is missing. A ValueError so that callers which report bad input (the HTTP 400 path) need no
    Jinja-specific handling."""


def _raise_exception(message: str) -> NoReturn:
    """Templates call this to reject a conversation (e.g. roles that do not alternate)."""
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Jinja's own ``tojson`` HTML-escapes ``<>&'``: that would corrupt tool schemas in a prompt."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    """Templates such as Llama 3.1's put today's date in the system prompt."""
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()

# What a template's expressions may raise on client-supplied messages (besides Jinja's own
# TemplateError, SecurityError included): reported as the request's error, not a server fault.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError)


class ChatTemplate:
    """One compiled template: compiled once (at model load or flag parsing, so a syntax error
    stops the server at start), rendered per request."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"the chat template does not compile (line {exc.lineno}): {exc.message}"
            ) from None

    def render(
        self,
        messages: Iterable[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        bos_token: str | None = None,
        eos_token: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text. An unknown bos/eos token is left undefined (renders as ``""``, and
        ``is defined`` tests see it), as transformers does for a tokenizer without one."""
        variables: dict[str, Any] = {
            "messages": [_message(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            **kwargs,
        }
        if bos_token is not None:
            variables["bos_token"] = bos_token
        if eos_token is not None:
            variables["eos_token"] = eos_token
        try:
            return self._template.render(**variables)
        except _RENDER_ERRORS as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from None


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message as templates read it (transformers' shape: tool fields only when present).
    An assistant turn with only tool calls has content "" (OpenAI's null): templates that know
    no tools concatenate it."""
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        out["tool_calls"] = list(m.tool_calls)
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def read_chat_template(path: str) -> str:
    """The text of a ``--chat-template`` file, checked to compile; ChatTemplateError (a
    ValueError, like every bad flag) names the file when it is unreadable or does not compile."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"--chat-template {path}: {exc}") from None
    try:
        ChatTemplate(source)
    except ChatTemplateError as exc:
        raise ChatTemplateError(f"--chat-template {path}: {exc}") from None
    return source

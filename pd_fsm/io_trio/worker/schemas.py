"""Request bodies of /generate (sglang), /v1/completions and /v1/chat/completions (OpenAI).

Parsing is strict where a mistake would change the output silently and lenient where routers
add fields of their own:

* every field has a row in a table per endpoint (``_TOP_LEVEL``, ``_SAMPLING_PARAMS``): one the
  parser implements; one it does not implement, accepted only at the value that asks for nothing
  (null, or a default such as ``"tools": []`` or ``"return_hidden_states": false``: sglang-router
  re-serialises bodies and fills those in); one that cannot change the tokens (``user``,
  ``log_metrics``). Anything else is a 400 that names the field (``response_format``, ``tools``,
  a typo such as ``max_new_token``): never an answer that silently ignored what the client asked
  for;
* types are exact: no int from a string or a bool, no float from a string.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import attrs

from pd_fsm.core.messages import KV_CHECKSUM_LIMIT, MAX_KV_CHECKSUMS, MAX_ROOM
from pd_fsm.io_trio import strict_json
from pd_fsm.io_trio.worker.backend import BootstrapInfo
from pd_fsm.io_trio.worker.tools import ToolError, Tools, parse_tools
from pd_fsm.jax_engine.sampling.grammar import Constraint
from pd_fsm.jax_engine.sampling.params import MAX_N, TOP_LOGPROBS_COMPUTED, SamplingParams
from pd_fsm.schedulers.disaggregation.handoff import HandoffTicket
from pd_fsm.schedulers.request import NO_LOGPROBS, SEED_LIMIT, LogprobSpec, Resume
from pd_fsm.text.tokenizer import ChatMessage

# A request body, or a part of one, as strict_json parsed it and before this module checked it.
# Any rather than strict_json.JsonValue: checking it key by key (isinstance, with a 400 naming
# the field) is this module's whole job, and a union would only add casts after each check.
JsonBody = Any
JsonObject = dict[str, Any]  # a JSON object (a request body, or an answer being built)


Kind = Literal["generate", "completion", "chat"]

# Defaults for the number of new tokens when the client names none.
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # sglang's SamplingParams default
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# OpenAI's chat default is "the rest of the context"; pages are reserved up front for
# prompt + max tokens, so a bounded default keeps one chat request from holding the whole pool.
CHAT_DEFAULT_MAX_TOKENS = 512
MAX_STOP_STRINGS = 16
MAX_BATCH = 64  # prompts in one batched request

# Top-level fields of each endpoint besides the sampling ones, as sglang-router 0.3.2 sends them
# (its re-serialised bodies, recorded in COMPAT.md) and as the OpenAI API defines them:
# - read: the parser implements them;
# - neutral: not implemented; accepted only at one of these values (or null), which ask for
#   nothing;
# - no effect: cannot change the tokens or the response's shape.
_COMMON_READ = frozenset({"stream", "rid", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                          "resume", "return_token_ids", "handoff", "accept_handoff",
                          "accept_move"})
_OPENAI_SAMPLING = frozenset({"temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                              "ignore_eos", "skip_special_tokens", "frequency_penalty",
                              "presence_penalty", "repetition_penalty", "min_tokens", "n",
                              "regex", "json_schema", "ebnf", "response_format"})


@attrs.frozen
class _Fields:
    read: frozenset[str]
    neutral: dict[str, tuple[JsonBody, ...]]
    no_effect: frozenset[str]


_OPENAI_NEUTRAL: dict[str, tuple[JsonBody, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "logit_bias": ({},),
    "min_p": (0, 0.0),
    "no_stop_trim": (False,),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "return_hidden_states": (False,),
    "continue_final_message": (False,),
    "lora_path": (),
    "chat_template_kwargs": ({},),
}
_OPENAI_NO_EFFECT = frozenset({
    "user", "metadata", "store", "service_tier",
    # sglang: how a reasoning parser would split the text; this worker runs none.
    "separate_reasoning", "stream_reasoning",
})
_TOP_LEVEL: dict[str, _Fields] = {
    "generate": _Fields(
        read=_COMMON_READ | {"text", "input_ids", "sampling_params", "return_logprob",
                             "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"},
        neutral={
            "token_ids_logprob": (),
            "return_hidden_states": (False,),
            "return_entropy": (False,),
            "return_bytes": (False,),
            "background": (False,),
            "lora_path": (),
            "image_data": (),
            "input_embeds": (),
            "session_params": (),
            "custom_logit_processor": (),
            "data_parallel_rank": (),
            "modalities": ([],),
        },
        no_effect=frozenset({"model", "log_metrics", "no_logs"}),
    ),
    "completion": _Fields(
        read=_COMMON_READ | _OPENAI_SAMPLING
        | {"model", "prompt", "max_tokens", "stream_options", "logprobs", "echo", "best_of"},
        neutral=_OPENAI_NEUTRAL,
        no_effect=_OPENAI_NO_EFFECT,
    ),
    "chat": _Fields(
        read=_COMMON_READ | _OPENAI_SAMPLING
        | {"model", "messages", "max_tokens", "max_completion_tokens", "stream_options",
           "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"},
        neutral=_OPENAI_NEUTRAL,
        no_effect=_OPENAI_NO_EFFECT,
    ),
}

# sglang's sampling_params, in the same three kinds.
_SAMPLING_PARAMS = _Fields(
    read=frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "seed", "sampling_seed",
                    "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                    "frequency_penalty", "presence_penalty", "repetition_penalty",
                    "min_new_tokens", "n", "regex", "json_schema", "ebnf"}),
    neutral={
        "min_p": (0, 0.0),
        "no_stop_trim": (False,),
        "structural_tag": (),
        "logit_bias": ({},),
        "custom_params": ({},),
    },
    no_effect=frozenset({"spaces_between_special_tokens", "stream_interval"}),
)


class ApiError(Exception):
    """A request the worker refuses: HTTP ``status`` and an OpenAI-style error body."""

    TYPES = {
        400: "invalid_request_error",
        403: "permission_error",
        404: "not_found_error",
        409: "conflict",
        413: "request_too_large",
        499: "client_closed_request",
        500: "internal_server_error",
        502: "bad_gateway",
        503: "service_unavailable",
        504: "gateway_timeout",
    }

    def __init__(self, status: int, message: str, type_: str | None = None, *,
                 retry_after: int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or self.TYPES.get(status, "error")
        self.retry_after = retry_after  # seconds, sent as Retry-After (a 503 while draining)
        self.headers = headers or {}  # more response headers (a stale role's 409: the current)

    def body(self) -> JsonObject:
        return {"error": {"message": self.message, "type": self.type, "code": self.status}}


@attrs.frozen
class Limits:
    context_length: int
    vocab_size: int


@attrs.frozen
class ParsedRequest:
    kind: Kind
    sampling: SamplingParams
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    logprobs: LogprobSpec = NO_LOGPROBS  # top alternatives, prompt log-probs
    echo: bool = False  # completions: the prompt's text (and log-probs) before the output
    return_text_in_logprobs: bool = False  # /generate: each logprob entry carries its text
    bootstrap: BootstrapInfo | None = None
    model: str | None = None
    include_usage: bool = False  # OpenAI stream_options.include_usage
    # Sequences answered when fewer than sampled (completions' best_of); 0: all of them.
    best_n: int = 0
    text: str | None = None  # exactly one of text, input_ids, messages
    input_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    tools: Tools | None = None  # chat: tools the answer may call (tools.py)
    # Request migration: the tokens it generated on a worker that failed, and how
    # much of their text the client has; the answer goes on from there.
    resume: Resume | None = None
    resume_text: str = ""
    # vLLM's return_token_ids: each OpenAI choice (each stream chunk's) carries its token ids,
    # which is what lets a proxy resume a stream elsewhere.
    return_token_ids: bool = False
    # Live hand-off: the KV a draining decode worker registered for this stream
    # (the proxy posts it with ``resume``), and the proxy's leave to end a stream with a ticket.
    handoff: HandoffTicket | None = None
    accept_handoff: bool = False
    # The proxy's leave to end a stream with a move event (``POST /move_streams``).
    accept_move: bool = False

    def __attrs_post_init__(self) -> None:
        if self.handoff is not None and self.resume is None:
            raise ApiError(400, "handoff needs resume (the tokens the ticket's KV covers)")
        if self.resume is None:
            return
        # What a resumed answer could not continue exactly is refused by name. Its output
        # tokens' log-probs it reports from its first generated token on (the client has the
        # earlier ones); the prompt's would need the prefill that a failed worker ran.
        for name, used in (("n > 1", self.n > 1), ("prompt log-probs", self.logprobs.prompt),
                           ("echo", self.echo)):
            if used:
                raise ApiError(400, f"resume cannot be combined with {name}")
        if len(self.resume.output_ids) >= self.sampling.max_new_tokens:
            raise ApiError(400, f"resume.output_ids has {len(self.resume.output_ids)} tokens: "
                                f"it must be fewer than the request's maximum "
                                f"({self.sampling.max_new_tokens})")

    @property
    def n(self) -> int:
        """Sequences in the answer."""
        return self.best_n or self.sampling.n


# ----------------------------------------------------------------------------- field readers


def _where(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _int(d: JsonObject, key: str, path: str = "") -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{_where(path, key)} must be an integer, got {v!r}")
    return v


def _float(d: JsonObject, key: str, path: str = "") -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ApiError(400, f"{_where(path, key)} must be a finite number, got {v!r}")
    return float(v)


def _bool(d: JsonObject, key: str, path: str = "") -> bool | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise ApiError(400, f"{_where(path, key)} must be true or false, got {v!r}")
    return v


def _str(d: JsonObject, key: str, path: str = "") -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ApiError(400, f"{_where(path, key)} must be a string, got {v!r}")
    return v


def _stop(d: JsonObject, key: str, path: str = "") -> tuple[str, ...]:
    v = d.get(key)
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise ApiError(400, f"{_where(path, key)} must be a non-empty string or a list of them")
    if len(items) > MAX_STOP_STRINGS:
        raise ApiError(400, f"{_where(path, key)}: at most {MAX_STOP_STRINGS} stop strings")
    return tuple(items)


def _token_ids(v: JsonBody, what: str, limits: Limits) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in v
    ):
        raise ApiError(400, f"{what} must be a list of integer token ids")
    bad = [t for t in v if not 0 <= t < limits.vocab_size]
    if bad:
        raise ApiError(400, f"{what}: token id {bad[0]} outside the vocabulary "
                            f"[0, {limits.vocab_size})")
    return tuple(v)


def _max_tokens(value: int | None, default: int, what: str, limits: Limits) -> int:
    if value is None:
        return min(default, limits.context_length)
    if value < 0:
        raise ApiError(400, f"{what} must be >= 0, got {value}")
    if value > limits.context_length:
        raise ApiError(
            400, f"{what}={value} is more than the context length {limits.context_length}"
        )
    return value


def _penalties(d: JsonObject, path: str) -> dict[str, float]:
    """The three penalties, checked (in this order) and defaulted: none applies."""
    penalties = {}
    for key, low, high in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0)):
        value = _float(d, key, path)
        if value is not None and not low <= value <= high:
            raise ApiError(400, f"{_where(path, key)} must be in [{low}, {high}], got {value}")
        penalties[key] = value or 0.0
    repetition = _float(d, "repetition_penalty", path)
    if repetition is not None and not 0.0 < repetition <= 2.0:
        raise ApiError(400, f"{_where(path, 'repetition_penalty')} must be in (0, 2], "
                            f"got {repetition}")
    penalties["repetition_penalty"] = 1.0 if repetition is None else repetition
    return penalties


def _sampling(
    d: JsonObject,
    path: str,
    limits: Limits,
    *,
    max_tokens_key: str,
    default_max: int,
    default_temperature: float,
    max_tokens: int | None = None,
) -> SamplingParams:
    if max_tokens is None:
        max_tokens = _int(d, max_tokens_key, path)
    temperature = _float(d, "temperature", path)
    top_p = _float(d, "top_p", path)
    if temperature is not None and temperature < 0:
        raise ApiError(400, f"{_where(path, 'temperature')} must be >= 0, got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"{_where(path, 'top_p')} must be in (0, 1], got {top_p}")
    seed = _int(d, "seed", path)
    if seed is None:
        seed = _int(d, "sampling_seed", path)
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise ApiError(400, f"{_where(path, 'seed')} must be in [0, 2^63), got {seed}")
    stop_ids = d.get("stop_token_ids")
    penalties = _penalties(d, path)
    n = _int(d, "n", path)
    if n is not None and not 1 <= n <= MAX_N:
        raise ApiError(400, f"{_where(path, 'n')} must be in [1, {MAX_N}], got {n}")
    min_key = "min_new_tokens" if max_tokens_key == "max_new_tokens" else "min_tokens"
    max_new = _max_tokens(max_tokens, default_max, _where(path, max_tokens_key), limits)
    min_new = _int(d, min_key, path) or 0
    if not 0 <= min_new <= max_new:
        raise ApiError(400, f"{_where(path, min_key)} must be in [0, {max_tokens_key}={max_new}], "
                            f"got {min_new}")
    return SamplingParams(
        max_new_tokens=max_new,
        frequency_penalty=penalties["frequency_penalty"],
        presence_penalty=penalties["presence_penalty"],
        repetition_penalty=penalties["repetition_penalty"],
        min_new_tokens=min_new,
        temperature=default_temperature if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=_int(d, "top_k", path) or -1,
        seed=seed,
        stop=_stop(d, "stop", path),
        stop_token_ids=()
        if stop_ids is None
        else _token_ids(stop_ids, _where(path, "stop_token_ids"), limits),
        ignore_eos=bool(_bool(d, "ignore_eos", path)),
        skip_special_tokens=_bool(d, "skip_special_tokens", path) is not False,
        n=n or 1,
        constraint=_constraint(d, path),
    )


def _constraint(d: JsonObject, path: str) -> Constraint | None:
    """Structured output: sglang's ``regex`` / ``json_schema`` (JSON text) / ``ebnf``, or
    OpenAI's ``response_format`` (``json_object``, ``json_schema``); at most one."""
    found: list[Constraint] = []
    for key in ("regex", "json_schema", "ebnf"):
        source = _str(d, key, path)
        if source is not None:
            if key == "json_schema":
                _json_text(source, _where(path, key))
            found.append(Constraint(key, source))
    fmt = d.get("response_format")
    if fmt is not None:
        found += _response_format(fmt)
    if len(found) > 1:
        raise ApiError(400, f"give at most one of {_where(path, 'regex')}, json_schema, ebnf "
                            "and response_format")
    return found[0] if found else None


def _json_text(source: str, what: str) -> JsonBody:
    try:
        return strict_json.loads(source, what=what)
    except ValueError as exc:
        raise ApiError(400, f"{what} must be a JSON schema as JSON text: {exc}") from None


def _response_format(fmt: JsonBody) -> list[Constraint]:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ApiError(400, "response_format must be an object with a type")
    kind = fmt["type"]
    if kind == "text":
        return []
    if kind == "json_object":
        return [Constraint("json_schema", '{"type": "object"}')]
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError(400, "response_format.json_schema must be an object with a schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict | bool):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema")
        return [Constraint("json_schema", json.dumps(schema))]
    raise ApiError(400, f"response_format.type={kind!r} is not supported (only 'text', "
                        "'json_object' or 'json_schema')")


def _top_count(d: JsonObject, key: str) -> int:
    n = _int(d, key) or 0
    if not 0 <= n <= TOP_LOGPROBS_COMPUTED:
        raise ApiError(400, f"{key} must be in [0, {TOP_LOGPROBS_COMPUTED}], got {n}")
    return n


def _check_fields(d: JsonObject, fields: _Fields, path: str = "") -> None:
    """Every field of ``d`` is one the endpoint reads, one it does not implement at a value that
    asks for nothing, or one without effect; otherwise a 400 naming it."""
    for key, value in d.items():
        if key in fields.read or key in fields.no_effect or value is None:
            continue
        allowed = fields.neutral.get(key)
        if allowed is None:
            raise ApiError(400, f"unknown field {_where(path, key)} "
                                "(this worker does not implement it)")
        if not any(value == a and isinstance(value, bool) == isinstance(a, bool)
                   for a in allowed):
            neutral = " or ".join(repr(a) for a in (*allowed, None))
            raise ApiError(400, f"{_where(path, key)}={value!r} is not supported (only {neutral})")


def _object(body: JsonBody) -> JsonObject:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _rid(body: JsonObject) -> str | None:
    rid = body.get("rid")
    if rid is None:
        return None
    if not isinstance(rid, str) or not rid or len(rid) > 256:
        raise ApiError(400, "rid must be a non-empty string of at most 256 characters (a list "
                            "of them only for a batch of prompts)")
    return rid


def parse_bootstrap(body: JsonObject) -> BootstrapInfo | None:
    """The three top-level fields a PD router injects; None when none is present."""
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port",
                                              "bootstrap_room"))
    if host is None and port is None and room is None:
        return None
    if not isinstance(host, str) or not host:
        raise ApiError(400, f"bootstrap_host must be a non-empty string, got {host!r}")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
    ):
        raise ApiError(400, f"bootstrap_port must be an integer in 1..65535 or null, got {port!r}")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < MAX_ROOM:
        raise ApiError(400, f"bootstrap_room must be an integer in [0, 2^63), got {room!r}")
    return BootstrapInfo(host=host, port=port, room=room)


def _resume(body: JsonObject, limits: Limits) -> tuple[Resume | None, str]:
    """``resume``: the tokens a failed worker generated and the text of them the client has."""
    v = body.get("resume")
    if v is None:
        return None, ""
    if not isinstance(v, dict):
        raise ApiError(400, "resume must be an object {output_ids, text}")
    unknown = sorted(set(v) - {"output_ids", "text"})
    if unknown:
        raise ApiError(400, f"resume.{unknown[0]} is not a field of resume (output_ids, text)")
    ids = _token_ids(v.get("output_ids"), "resume.output_ids", limits)
    if not ids:
        raise ApiError(400, "resume.output_ids must not be empty")
    text = _str(v, "text", "resume") or ""
    return Resume(ids, len(text)), text


MAX_TICKET_LEASE_S = 86400.0  # an offer's lease is a drain's: hours at the very most
_TICKET = {"transfer_addr": str, "uuid": int, "kv_tokens": int, "next_token": int,
           "layout_hash": str, "kv_shards": int, "kv_checksums": list}


def _handoff(body: JsonObject) -> HandoffTicket | None:
    """``handoff``: where a draining decode worker offers this stream's KV (its ticket)."""
    v = body.get("handoff")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ApiError(400, "handoff must be an object (a hand-off ticket)")
    for key, kind in _TICKET.items():
        got = v.get(key)
        if not isinstance(got, kind) or isinstance(got, bool):
            raise ApiError(400, f"handoff.{key} must be a {kind.__name__}, got {got!r}")
    unknown = sorted(set(v) - set(_TICKET) - {"lease_s"})
    if unknown:
        raise ApiError(400, f"handoff.{unknown[0]} is not a field of a hand-off ticket")
    lease = v.get("lease_s", 0.0)  # optional: a ticket of an older worker has none
    if (not isinstance(lease, int | float) or isinstance(lease, bool)
            or not 0 <= lease <= MAX_TICKET_LEASE_S):
        raise ApiError(400, f"handoff.lease_s must be seconds in [0, {MAX_TICKET_LEASE_S:g}], "
                            f"got {lease!r}")
    sums = v["kv_checksums"]
    if len(sums) > MAX_KV_CHECKSUMS or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < KV_CHECKSUM_LIMIT
            for x in sums):
        raise ApiError(400, "handoff.kv_checksums must be 32-bit words, one per array")
    if not 0 <= v["uuid"] < 2**63 or v["kv_tokens"] < 1 or v["kv_shards"] < 1:
        raise ApiError(400, "handoff: uuid, kv_tokens or kv_shards out of range")
    return HandoffTicket(v["transfer_addr"], v["uuid"], v["kv_tokens"], v["next_token"],
                         v["layout_hash"], v["kv_shards"], tuple(sums), float(lease))


def _common(body: JsonObject, limits: Limits) -> JsonObject:
    return {
        "stream": bool(_bool(body, "stream")),
        "rid": _rid(body),
        "bootstrap": parse_bootstrap(body),
        **dict(zip(("resume", "resume_text"), _resume(body, limits), strict=True)),
        "return_token_ids": bool(_bool(body, "return_token_ids")),
        "handoff": _handoff(body),
        "accept_handoff": bool(_bool(body, "accept_handoff")),
        "accept_move": bool(_bool(body, "accept_move")),
    }


# ----------------------------------------------------------------------------- batches


def _is_ids(v: JsonBody) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


_BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def _bootstrap_lists(body: JsonObject) -> int | None:
    """sglang-router's PD form of a batch or of n > 1: the three bootstrap fields as lists of
    one value per sequence (prompt-major); their length, or None when they are not lists."""
    values = [body.get(k) for k in _BOOTSTRAP]
    if not any(isinstance(v, list) for v in values):
        return None
    lengths = {len(v) for v in values if isinstance(v, list)}
    if len(lengths) != 1 or not all(isinstance(v, list) for v in values):
        raise ApiError(400, "bootstrap_host, bootstrap_port and bootstrap_room must be lists of "
                            "one length, or none of them lists")
    return lengths.pop()


def _sequences(kind: Kind, body: JsonObject) -> int:
    """The n of a body, before it is parsed (1 when absent or not a number)."""
    where = body.get("sampling_params") if kind == "generate" else body
    n = where.get("n") if isinstance(where, dict) else None
    return n if type(n) is int and n > 0 else 1


def _bootstrap_at(body: JsonObject, index: int) -> JsonObject:
    return {k: body[k][index] for k in _BOOTSTRAP}


def single_bootstrap(kind: Kind, body: JsonBody) -> JsonBody:
    """A single prompt's body with sglang-router's bootstrap lists (n > 1: one room per
    sequence) reduced to the first sequence's: the request is one room here (D forks the
    sequences), and P and D both take the first."""
    if not isinstance(body, dict):
        return body
    count = _bootstrap_lists(body)
    if count is None:
        return body
    n = _sequences(kind, body)
    if count != n:
        raise ApiError(400, f"bootstrap lists of {count} values for n={n}")
    return {**body, **_bootstrap_at(body, 0)}


def split_batch(kind: Kind, body: JsonBody) -> list[JsonObject] | None:
    """A batched request as one body per prompt, or None for a single one: completions'
    ``prompt`` as a list of strings or of token-id lists (two or more), ``/generate``'s ``text``
    as a list of strings or ``input_ids`` as a list of lists. ``rid`` is then a list with one
    distinct id per prompt (or absent). Each body is parsed as a request of its own; under PD
    (sglang-router's bootstrap lists, a value per sequence) each is a room of its own."""
    if kind == "chat" or not isinstance(body, dict):
        return None
    if kind == "completion":
        key, prompts = "prompt", body.get("prompt")
        if not isinstance(prompts, list) or len(prompts) < 2 or _is_ids(prompts):
            return None
        if not (all(isinstance(p, str) for p in prompts) or all(_is_ids(p) for p in prompts)):
            raise ApiError(400, "prompt must be a string, a list of token ids, or a list of "
                                "either (a batch)")
    else:
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            key, prompts = "text", text
            if not all(isinstance(p, str) for p in prompts):
                raise ApiError(400, "text must be a string or a list of strings (a batch)")
        elif isinstance(ids, list) and ids and isinstance(ids[0], list):
            key, prompts = "input_ids", ids
        else:
            return None
    if not prompts:
        raise ApiError(400, f"{key} is an empty batch")
    if len(prompts) > MAX_BATCH:
        raise ApiError(400, f"{key}: at most {MAX_BATCH} prompts in a batch, got {len(prompts)}")
    count, n = _bootstrap_lists(body), _sequences(kind, body)
    if count is None and parse_bootstrap(body) is not None:
        raise ApiError(400, "a batch of prompts as a PD leg needs bootstrap lists, a value per "
                            "sequence")
    if count is not None and count != len(prompts) * n:
        raise ApiError(400, f"bootstrap lists of {count} values for {len(prompts)} prompts "
                            f"and n={n}")
    rids = body.get("rid")
    if rids is not None and (not isinstance(rids, list) or len(rids) != len(prompts)
                             or len(set(map(str, rids))) != len(rids)):
        raise ApiError(400, f"rid of a batch must be a list of {len(prompts)} distinct ids, "
                            "one per prompt")
    return [{**body, key: p, "rid": None if rids is None else rids[i],
             **(_bootstrap_at(body, i * n) if count is not None else {})}
            for i, p in enumerate(prompts)]


# ----------------------------------------------------------------------------- endpoints


def parse_generate(body: JsonBody, limits: Limits) -> ParsedRequest:
    body = _object(body)
    _check_fields(body, _TOP_LEVEL["generate"])
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError(400, "give exactly one of text and input_ids")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise ApiError(400, "batched requests (a list of prompts) are not supported")
    if text is not None and not isinstance(text, str):
        raise ApiError(400, f"text must be a string, got {text!r}")
    sp = body.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise ApiError(400, "sampling_params must be a JSON object")
    _check_fields(sp, _SAMPLING_PARAMS, "sampling_params")
    return ParsedRequest(
        kind="generate",
        sampling=_sampling(
            sp,
            "sampling_params",
            limits,
            max_tokens_key="max_new_tokens",
            default_max=GENERATE_DEFAULT_MAX_NEW_TOKENS,
            default_temperature=1.0,
        ),
        text=text,
        input_ids=None if ids is None else _token_ids(ids, "input_ids", limits),
        return_text_in_logprobs=bool(_bool(body, "return_text_in_logprobs")),
        **_generate_logprobs(body),
        **_common(body, limits),
    )


def _generate_logprobs(body: JsonObject) -> JsonObject:
    """sglang's fields: ``return_logprob`` turns log-probs on; then ``top_logprobs_num``
    alternatives per position and, from prompt position ``logprob_start_len`` on (-1: none),
    the prompt tokens' too. Without ``return_logprob`` the other two ask for nothing."""
    start = _int(body, "logprob_start_len")
    if start is not None and start < -1:
        raise ApiError(400, f"logprob_start_len must be >= -1, got {start}")
    top = _top_count(body, "top_logprobs_num")
    if not _bool(body, "return_logprob"):
        return {}
    spec = LogprobSpec(top=top, prompt_from=-1 if start is None else start)
    return {"return_logprob": True, "logprobs": spec}


def _completion_logprobs(body: JsonObject) -> JsonObject:
    """``logprobs: N`` on /v1/completions: the sampled tokens' own log-probs and the N most likely
    alternatives at each position; with ``echo``, the prompt's tokens' too (from position 0)."""
    echo = bool(_bool(body, "echo"))
    if body.get("logprobs") is None:
        return {"echo": echo}
    top = _top_count(body, "logprobs")
    spec = LogprobSpec(top=top, prompt_from=0 if echo else -1)
    return {"echo": echo, "return_logprob": True, "logprobs": spec}


def _chat_logprobs(body: JsonObject) -> JsonObject:
    """``logprobs: true`` and ``top_logprobs: N`` (which OpenAI allows only with logprobs)."""
    top = _top_count(body, "top_logprobs")
    if not _bool(body, "logprobs"):
        if top:
            raise ApiError(400, "top_logprobs must come with logprobs: true")
        return {}
    return {"return_logprob": True, "logprobs": LogprobSpec(top=top)}


def _openai_common(body: JsonObject, limits: Limits) -> JsonObject:
    model = _str(body, "model")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object")
    include_usage = bool(_bool(opts, "include_usage", "stream_options")) if opts else False
    return {"model": model, "include_usage": include_usage, **_common(body, limits)}


def _best_of(body: JsonObject, sampling: SamplingParams) -> JsonObject:
    """Completions' ``best_of``: sample that many sequences, answer the ``n`` most likely
    (not streamable, as OpenAI's)."""
    best_of = _int(body, "best_of")
    if best_of is None or best_of == sampling.n:
        return {"sampling": sampling}
    if not sampling.n <= best_of <= MAX_N:
        raise ApiError(400, f"best_of must be in [n={sampling.n}, {MAX_N}], got {best_of}")
    if _bool(body, "stream"):
        raise ApiError(400, "best_of must be n (or absent) when stream is true")
    return {"sampling": attrs.evolve(sampling, n=best_of), "best_n": sampling.n}


def parse_completion(body: JsonBody, limits: Limits) -> ParsedRequest:
    body = _object(body)
    _check_fields(body, _TOP_LEVEL["completion"])
    prompt = body.get("prompt")
    text: str | None = None
    ids: tuple[int, ...] | None = None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = _token_ids(prompt, "prompt", limits)
    elif isinstance(prompt, list):
        raise ApiError(400, "batched prompts (a list of prompts) are not supported")
    else:
        raise ApiError(400, "prompt must be a string or a list of token ids")
    sampling = _sampling(
        body,
        "",
        limits,
        max_tokens_key="max_tokens",
        default_max=COMPLETION_DEFAULT_MAX_TOKENS,
        default_temperature=1.0,
    )
    return ParsedRequest(
        kind="completion",
        **_best_of(body, sampling),
        text=text,
        input_ids=ids,
        **_completion_logprobs(body),
        **_openai_common(body, limits),
    )


_ROLES = ("system", "user", "assistant", "tool")


def _content(v: JsonBody, where: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(400, f"{where}[{i}]: only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ApiError(400, f"{where}[{i}].text must be a string")
            parts.append(text)
        return "".join(parts)
    raise ApiError(400, f"{where} must be a string or a list of text parts")


def _message(m: JsonBody, i: int) -> ChatMessage:
    """One chat message: text content; an assistant's earlier tool calls; a tool's answer."""
    if not isinstance(m, dict):
        raise ApiError(400, f"messages[{i}] must be an object")
    role = m.get("role")
    if role not in _ROLES:
        raise ApiError(400, f"messages[{i}].role must be one of {', '.join(_ROLES)}")
    calls = m.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)):
        raise ApiError(400, f"messages[{i}].tool_calls must be an assistant's list of calls")
    content = m.get("content")
    text = None if content is None and calls else _content(content, f"messages[{i}].content")
    call_id = m.get("tool_call_id")
    if role == "tool" and not isinstance(call_id, str):
        raise ApiError(400, f"messages[{i}].tool_call_id must be a string (a tool's answer)")
    return ChatMessage(role, text, tuple(calls or ()), call_id if role == "tool" else None)


def parse_chat(body: JsonBody, limits: Limits) -> ParsedRequest:
    body = _object(body)
    _check_fields(body, _TOP_LEVEL["chat"])
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    parsed = [_message(m, i) for i, m in enumerate(messages)]
    _bool(body, "parallel_tool_calls")  # one call per answer either way (tools.py)
    try:
        tools = parse_tools(body.get("tools"), body.get("tool_choice"))
    except ToolError as exc:
        raise ApiError(400, str(exc)) from None
    # sglang-router renames max_tokens to max_completion_tokens for chat; accept either.
    mct = _int(body, "max_completion_tokens")
    mt = _int(body, "max_tokens")
    if mct is not None and mt is not None and mct != mt:
        raise ApiError(400, "max_tokens and max_completion_tokens disagree")
    key = "max_completion_tokens" if mct is not None else "max_tokens"
    sampling = _sampling(
        body,
        "",
        limits,
        max_tokens_key=key,
        default_max=CHAT_DEFAULT_MAX_TOKENS,
        default_temperature=1.0,
        max_tokens=mct if mct is not None else mt,
    )
    if tools is not None:  # the tools' grammar is the request's constraint
        if sampling.constraint is not None:
            raise ApiError(400, "tools must not come with response_format, regex, "
                                "json_schema or ebnf (unless tool_choice is \"none\")")
        sampling = attrs.evolve(sampling, constraint=tools.constraint())
    return ParsedRequest(
        kind="chat",
        sampling=sampling,
        messages=tuple(parsed),
        tools=tools,
        **_chat_logprobs(body),
        **_openai_common(body, limits),
    )

"""Hostile input against every pd_fsm server as real processes (issue 34).

`pd-fsm cluster --prefill 1 --decode 1 --colocated --model tiny` (bootstrap, P, D, a colocated
worker and the proxy in front of P and D) and a standalone `pd-fsm bootstrap`, attacked by
hypothesis: hostile JSON (NaN/±Infinity, 1e400, lone and paired surrogates, deep nesting, huge
arrays and integers, duplicate keys) and a wrong type at every field each endpoint knows
(``schemas._TOP_LEVEL`` / ``_SAMPLING_PARAMS``, every record field), raw bytes and truncated
bodies, hostile query strings, at every route. After each example: the answer is a 4xx with a
JSON error naming the problem (or a 200 where the input was valid, whose stream holds no server
error), every process is alive and answers ``/health``, and a normal greedy request still gets
the colocated worker's answer. At the end every worker is idle with all its pages free.

Examples are derandomized (the same ones each run, so CI cannot go red by luck); set
``PD_FSM_FUZZ_EXAMPLES`` and ``PD_FSM_FUZZ_RANDOM=1`` to search further by hand.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pd_fsm.io_trio.bootstrap.records import InstanceRecord, to_json
from pd_fsm.io_trio.ports import free_ports
from pd_fsm.io_trio.strict_json import loads as strict_loads
from pd_fsm.io_trio.worker import schemas
from tests.integration.serve_support import (
    PATHS,
    PDCluster,
    Proc,
    cli,
    fetch_answer,
    idle_pages,
    request_body,
    sse_events,
    wait_http_ok,
)
from tests.support.io_doubles import sample_record

pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
# The shapes test_serve_pd.py compiles: a warm compilation cache serves both.
CLUSTER_ARGS = ["--prefill", "1", "--decode", "1", "--colocated", "--model", "tiny",
                "--page-size", "4", "--num-pages", "512", "--max-running", "16",
                "--context-length", "256", "--startup-timeout", "240",
                # The launcher serves too; at its bound (two of two) it starts nothing.
                "--max-workers", "2"]
EXAMPLES = int(os.environ.get("PD_FSM_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get(
    "PD_FSM_FUZZ_RANDOM"), suppress_health_check=list(HealthCheck), database=None)
NORMAL = ("generate", "The capital of France is", 4)
TIMEOUT = httpx.Timeout(60.0)


@attrs.frozen
class Env:
    cluster: PDCluster
    bootstrap: str  # a standalone registry: what the fuzz registers routes no traffic
    reference: Any  # the colocated worker's answer to NORMAL

    def url(self, name: str) -> str:
        return self.cluster.urls[name]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    cluster = PDCluster.start(CLUSTER_ARGS)
    registry: Proc | None = None
    try:
        (port,) = free_ports(1)
        registry = Proc.start("bootstrap", cli("bootstrap", "--host", HOST, "--port", str(port)))
        bootstrap = f"http://{HOST}:{port}"
        wait_http_ok(f"{bootstrap}/health", registry)
        reference = _normal_answer(cluster.urls["colocated"])
        yield Env(cluster, bootstrap, reference)
        with httpx.Client(timeout=TIMEOUT) as http:
            for name in ("prefill-0", "decode-0", "colocated"):
                _wait_idle(http, cluster.urls[name])
    finally:
        if registry is not None:
            registry.stop()
        cluster.stop()


def _normal_answer(base: str) -> Any:
    import trio

    endpoint, prompt, n = NORMAL

    async def ask() -> Any:
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            return await fetch_answer(http, base, endpoint,
                                      request_body(endpoint, prompt, n, stream=False))

    return trio.run(ask)


def _wait_idle(http: httpx.Client, base: str) -> None:
    import time

    deadline = time.monotonic() + 30
    while True:
        load = http.get(f"{base}/get_load").json()[0]
        if load["num_reqs"] == 0 and idle_pages(load):
            return
        assert time.monotonic() < deadline, f"{base} not idle: {load}"
        time.sleep(0.1)


# ----------------------------------------------------------------------------- strategies

_DEEP = [n * "[" + n * "]" for n in (65, 300, 100_000)] + ['{"a":' * 200 + "1" + "}" * 200]
HOSTILE_LITERALS = [
    "NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e309",
    '"\\ud800"', '"a\\udfff"', '"\\ud800\\udfff\\ud800"', '"\\udbff\\udfff"', '"\\ud83d\\ude00"',
    "9" * 25, "1" * 5000, str(2**63), str(-(2**63) - 1), str(2**64 - 1),
    '{"a":1,"a":2}', "[" + "0," * 200_000 + "0]", *_DEEP,
]
WRONG_TYPES = ["0", "-1", "1.5", "-0.0", "1e300", "true", "false", "null", '""', '"x"', "[]", "{}",
               '[1,"a"]', '{"a":1}', '"' + "x" * 10_000 + '"', "[[1,2],[3]]", '"\\u0000"']
fragments = st.sampled_from(HOSTILE_LITERALS + WRONG_TYPES)


def _fields(kind: schemas.Kind) -> list[str]:
    """Every top-level field the endpoint has a row for (schemas' table is the spec)."""
    f = schemas._TOP_LEVEL[kind]
    return sorted(f.read | f.no_effect | set(f.neutral))


SAMPLING_FIELDS = sorted(schemas._SAMPLING_PARAMS.read | schemas._SAMPLING_PARAMS.no_effect
                         | set(schemas._SAMPLING_PARAMS.neutral))
KINDS: dict[str, schemas.Kind] = {"generate": "generate", "completions": "completion",
                                  "chat": "chat"}


def _base(endpoint: str) -> dict[str, Any]:
    return request_body(endpoint, "hello there", 2, stream=False)


def _with_raw(body: dict[str, Any], path: list[str], fragment: str) -> bytes:
    """``body`` as JSON text with the field at ``path`` replaced by raw JSON ``fragment``."""
    marker = "\x00FRAGMENT\x00"
    target = body
    for key in path[:-1]:
        target = target.setdefault(key, {})
        assert isinstance(target, dict)
    target[path[-1]] = marker
    return json.dumps(body).replace(json.dumps(marker), fragment).encode()


@st.composite
def field_attacks(draw: st.DrawFn) -> tuple[str, bytes]:
    """(endpoint, body): a valid request with one field, or one sampling field, made hostile."""
    endpoint = draw(st.sampled_from(sorted(KINDS)))
    body = _base(endpoint)
    if endpoint == "generate" and draw(st.booleans()):
        path = ["sampling_params", draw(st.sampled_from(SAMPLING_FIELDS))]
    else:
        path = [draw(st.sampled_from(_fields(KINDS[endpoint])))]
    if path[0] in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        path = ["rid"]  # the PD fields pair P and D: the pairing tests cover them
    if draw(st.booleans()):
        body["stream"] = True
    return endpoint, _with_raw(body, path, draw(fragments))


@st.composite
def raw_attacks(draw: st.DrawFn) -> tuple[str, bytes]:
    """(endpoint, body): random bytes, or a valid body cut short, or a duplicate key."""
    endpoint = draw(st.sampled_from(sorted(KINDS)))
    valid = json.dumps(_base(endpoint)).encode()
    kind = draw(st.sampled_from(["bytes", "truncated", "duplicate", "wrapped"]))
    if kind == "bytes":
        return endpoint, draw(st.binary(max_size=300))
    if kind == "truncated":
        return endpoint, valid[: draw(st.integers(0, len(valid) - 1))]
    if kind == "duplicate":
        return endpoint, valid[:-1] + b', "stream": false}'
    return endpoint, draw(fragments).encode()  # a whole body that is no object


generation_attacks = st.one_of(field_attacks(), raw_attacks())


# ----------------------------------------------------------------------------- checks


def _check_answer(r: httpx.Response, what: str) -> None:
    """A 4xx with a JSON error message, or a 200 whose stream carries no server error."""
    assert r.status_code == 200 or 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
    if r.status_code != 200:
        body = strict_loads(r.content)  # the error itself is strict JSON
        assert isinstance(body, dict) and body.get("error"), (what, r.text[:300])
        message = body["error"]["message"] if isinstance(body["error"], dict) else body["error"]
        assert isinstance(message, str) and message, (what, r.text[:300])
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        for event in sse_events(r.text):
            if isinstance(event, dict) and "error" in event:
                code = event["error"].get("code", 500)
                assert 400 <= int(code) < 500, (what, event)


def _check_alive(env: Env, http: httpx.Client) -> None:
    assert env.cluster.proc.alive(), env.cluster.proc.tail()
    for name in ("prefill-0", "decode-0", "colocated", "proxy", "bootstrap", "launcher"):
        r = http.get(f"{env.url(name)}/health")
        assert r.status_code == 200, (name, r.text[:300], env.cluster.proc.tail())


def _check_normal(env: Env, name: str) -> None:
    assert _normal_answer(env.url(name)) == env.reference


def _attack(env: Env, target: str, endpoint: str, raw: bytes) -> None:
    with httpx.Client(timeout=TIMEOUT) as http:
        r = http.post(env.url(target) + PATHS[endpoint], content=raw,
                      headers={"content-type": "application/json"})
        _check_answer(r, f"{target} {endpoint} {raw[:120]!r}")
        _check_alive(env, http)
    _check_normal(env, target)


# Issue 34's table, first: each ended the proxy process or answered 500.
ISSUE_ROWS = [
    b'{"text":"hi","sampling_params":{"max_new_tokens":2,"temperature":NaN}}',
    b'{"text":"hi","rid":NaN,"sampling_params":{"max_new_tokens":2}}',
    b'{"text":"hi","sampling_params":{"max_new_tokens":1e400}}',
    b'{"text":"\\ud800\\udfff\\ud800","sampling_params":{"max_new_tokens":2}}',
    b'{"text":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
]


@pytest.mark.parametrize("target", ["colocated", "proxy"])
@pytest.mark.parametrize("raw", ISSUE_ROWS, ids=["nan", "nan-rid", "1e400", "surrogate", "deep"])
def test_the_issue_rows_are_refused_by_name(env: Env, target: str, raw: bytes) -> None:
    with httpx.Client(timeout=TIMEOUT) as http:
        r = http.post(env.url(target) + "/generate", content=raw)
        assert r.status_code == 400, r.text[:300]
        message = r.json()["error"]["message"]
        assert any(words in message for words in (
            "is NaN", "is 1e400", "lone surrogate", "deeper than 64")), message
        _check_alive(env, http)


@given(attack=generation_attacks)
@FUZZ
def test_fuzz_the_colocated_worker(env: Env, attack: tuple[str, bytes]) -> None:
    _attack(env, "colocated", *attack)


@given(attack=generation_attacks)
@FUZZ
def test_fuzz_the_proxy_in_front_of_real_p_and_d(env: Env, attack: tuple[str, bytes]) -> None:
    _attack(env, "proxy", *attack)


@given(endpoint=st.sampled_from(sorted(KINDS)), raw=st.one_of(
    st.binary(max_size=200), fragments.map(str.encode)))
@settings(parent=FUZZ, max_examples=max(EXAMPLES // 4, 5))
def test_fuzz_prefill_and_decode_directly(env: Env, endpoint: str, raw: bytes) -> None:
    for target in ("prefill-0", "decode-0"):
        with httpx.Client(timeout=TIMEOUT) as http:
            r = http.post(env.url(target) + PATHS[endpoint], content=raw)
            _check_answer(r, f"{target} {endpoint} {raw[:120]!r}")
            _check_alive(env, http)


OTHER_ROUTES = {
    "colocated": [("POST", "/abort_request"), ("POST", "/switch_role"), ("GET", "/health"),
                  ("GET", "/health_generate"), ("GET", "/server_info"),
                  ("GET", "/get_server_info"), ("GET", "/model_info"),
                  ("GET", "/get_model_info"), ("GET", "/v1/models"), ("GET", "/get_load"),
                  ("GET", "/metrics"), ("POST", "/health"), ("GET", "/generate"),
                  ("PUT", "/v1/completions"), ("POST", "/no/such/route")],
    "proxy": [("GET", "/health"), ("GET", "/metrics"), ("GET", "/workers"),
              ("GET", "/v1/models"), ("GET", "/model_info"), ("GET", "/server_info"),
              ("GET", "/get_model_info"), ("GET", "/get_server_info"), ("DELETE", "/generate"),
              ("POST", "/abort_request"), ("POST", "/workers/add"), ("POST", "/workers/remove")],
    "launcher": [("POST", "/scale_up"), ("POST", "/scale_down"), ("GET", "/workers"),
                 ("GET", "/health"), ("DELETE", "/scale_up")],
}
_queries = st.lists(st.tuples(st.sampled_from(["rid", "role", "x", "", "host", "port"]),
                              st.binary(max_size=20)), max_size=3).map(
    lambda kv: "&".join(f"{k}={''.join(f'%{b:02X}' for b in v)}" for k, v in kv))


@given(target=st.sampled_from(sorted(OTHER_ROUTES)), data=st.data())
@settings(parent=FUZZ)
def test_fuzz_every_other_route(env: Env, target: str, data: st.DataObject) -> None:
    method, path = data.draw(st.sampled_from(OTHER_ROUTES[target]))
    query = data.draw(_queries)
    raw = data.draw(st.one_of(st.just(b""), st.binary(max_size=100), fragments.map(str.encode),
                              st.just(b'{"rid": "nobody"}')))
    with httpx.Client(timeout=TIMEOUT) as http:
        r = http.request(method, f"{env.url(target)}{path}?{query}", content=raw)
        assert r.status_code < 500, (method, path, query, r.status_code, r.text[:300])
        _check_alive(env, http)


# ----------------------------------------------------------------------------- the registry

RECORD = to_json(sample_record(instance_id="fuzz"))
RECORD_FIELDS = sorted(attrs.fields_dict(InstanceRecord))
KEY_FIELDS = ["role", "instance_id", "tp_rank", "cp_rank", "dp_rank", "pp_rank"]


@st.composite
def registry_attacks(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """(method, path, body) for the registry's writes: a record or key with one hostile field,
    raw bytes, or a cut body."""
    method, path, fields = draw(st.sampled_from([
        ("PUT", "/route", RECORD_FIELDS), ("POST", "/heartbeat", KEY_FIELDS),
        ("DELETE", "/route", KEY_FIELDS)]))
    body = {k: v for k, v in RECORD.items() if k in fields}
    kind = draw(st.sampled_from(["field", "field", "bytes", "truncated"]))
    if kind == "bytes":
        return method, path, draw(st.binary(max_size=200))
    valid = json.dumps(body).encode()
    if kind == "truncated":
        return method, path, valid[: draw(st.integers(0, len(valid) - 1))]
    field = draw(st.sampled_from(fields))
    return method, path, _with_raw(body, [field], draw(fragments))


@given(attack=registry_attacks())
@example(attack=("PUT", "/route", _with_raw(dict(RECORD), ["instance_id"], '"p\\ud800"')))
@FUZZ
def test_fuzz_the_registry(env: Env, attack: tuple[str, str, bytes]) -> None:
    method, path, raw = attack
    with httpx.Client(timeout=TIMEOUT) as http:
        r = http.request(method, env.bootstrap + path, content=raw)
        assert r.status_code in (200, 404) or 400 <= r.status_code < 500, (r.status_code, r.text)
        if r.status_code != 200:
            error = strict_loads(r.content)
            assert isinstance(error, dict) and error.get("error"), r.text[:300]
        # Whatever was stored can be served back, to everyone.
        for role in ("prefill", "decode"):
            listed = http.get(f"{env.bootstrap}/list", params={"role": role})
            assert listed.status_code == 200, listed.text[:300]
            strict_loads(listed.content)
        assert http.get(f"{env.bootstrap}/health").status_code == 200


@given(query=_queries, path=st.sampled_from(["/route", "/list", "/health"]))
@settings(parent=FUZZ, max_examples=max(EXAMPLES // 2, 5))
def test_fuzz_the_registry_reads(env: Env, query: str, path: str) -> None:
    with httpx.Client(timeout=TIMEOUT) as http:
        r = http.get(f"{env.bootstrap}{path}?{query}")
        assert r.status_code in (200, 404) or 400 <= r.status_code < 500, (r.status_code, r.text)
        assert http.get(f"{env.bootstrap}/health").status_code == 200

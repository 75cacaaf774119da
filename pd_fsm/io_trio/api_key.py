"""API keys for the public endpoints (``--api-key`` / ``--api-key-file``), as sglang and vLLM
take them: a client sends ``Authorization: Bearer <key>``.

``ApiKeyGate`` is plain ASGI middleware in front of a worker's or the proxy's app. It refuses a
request without the right key with 401 JSON (OpenAI's error shape, ``WWW-Authenticate: Bearer``)
before the app reads a byte of the body, and compares in constant time. Open without a key, as in
sglang: ``/health`` and ``/health_generate`` (routers and load balancers poll them) and
``/metrics`` (Prometheus scrapers). Everything else — the OpenAI and sglang endpoints,
``/abort_request``, the info and load endpoints — needs the key.

The key is a bearer secret: it travels in clear text on plain HTTP, which is why this is for
callers on a network you trust or behind TLS. It is unrelated to the cluster secret (the side
channel's and the registry's keys never leave a process).
"""

from __future__ import annotations

import argparse
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from pd_fsm.io_trio.flag_spec import Flag, add_flags

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


def api_key_flags(prefix: str = "", who: str = "clients") -> tuple[Flag, Flag]:
    """``--{prefix}api-key KEY`` and ``--{prefix}api-key-file F`` (a file keeps the key out of
    ``ps``); one or the other."""
    group = f"{prefix}api-key"
    return (
        Flag(f"--{prefix}api-key", f"{who} must send 'Authorization: Bearer KEY'",
             metavar="KEY", exclusive=group, sglang="--api-key" if not prefix else None),
        Flag(f"--{prefix}api-key-file",
             "the same, read from FILE (keeps the key out of the process list)",
             type=Path, metavar="FILE", exclusive=group),
    )


def add_api_key_arguments(p: argparse.ArgumentParser, prefix: str = "", who: str = "clients"
                          ) -> None:
    add_flags(p, api_key_flags(prefix, who))


def api_key_from_args(args: argparse.Namespace, prefix: str = "") -> str | None:
    """The key given by ``--{prefix}api-key[-file]``, or None; ValueError for an empty or
    unreadable key (refusing to start beats serving unprotected)."""
    attr = prefix.replace("-", "_")
    key: str | None = getattr(args, f"{attr}api_key")
    path: Path | None = getattr(args, f"{attr}api_key_file")
    if path is not None:
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"--{prefix}api-key-file {path}: {exc.strerror}") from None
    if key is not None and (not key or any(c.isspace() for c in key)):
        raise ValueError(f"--{prefix}api-key: the key must be non-empty, without whitespace")
    return key


def bearer(key: str) -> dict[str, str]:
    """The header a client of a keyed service sends."""
    return {"authorization": f"Bearer {key}"}


class ApiKeyGate:
    """Pass a request on only if it carries the key (or its path is open)."""

    def __init__(self, app: ASGIApp, key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self._key = key.encode()
        self.open_paths = open_paths
        self.refused = 0

    def _authorised(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # compare_digest: no early exit that leaks how much of the key was right.
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("path") in self.open_paths
            or scope.get("method") == "OPTIONS"
            or self._authorised(scope)
        ):
            await self.app(scope, receive, send)
            return
        self.refused += 1
        body = json.dumps({"error": {
            "message": "missing or wrong API key (send 'Authorization: Bearer <key>')",
            "type": "authentication_error",
            "code": 401,
        }}).encode()
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        })
        await send({"type": "http.response.body", "body": body})

"""`pd-fsm switch-role URL ROLE`: switch a running worker's role.

Posts ``/switch_role`` and, with ``--wait`` (the default), polls ``/server_info`` until the
worker serves in the new role under the epoch the switch announced: exit 0. A refusal (400,
409, 503), a switch that ended with the old role restored, a worker that stopped answering or a
wait that ran out: a message naming it on stderr and exit 1. Light on purpose (no JAX): an
operator's tool.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import httpx
import trio

from pd_fsm.core.tables import ROLE_SWITCH
from pd_fsm.io_trio.api_key import bearer
from pd_fsm.io_trio.unix_sockets import display, service_url, unix_mounts
from pd_fsm.io_trio.worker.flags import DISAGGREGATION_MODES

POLL_S = 0.2
REQUEST_TIMEOUT_S = 10.0


def _url(value: str) -> str:
    try:
        return service_url(value, "URL")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _wait(value: str) -> float:
    seconds = float(value)
    if not seconds >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"--wait must be >= 0 seconds, got {value!r}")
    return seconds


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("switch-role", help="switch a running worker's role without restarting "
                                           "it (POST /switch_role), and wait until it serves")
    p.add_argument("url", type=_url, metavar="URL",
                   help="the worker, e.g. http://HOST:30000 or unix:PATH")
    p.add_argument("role", choices=DISAGGREGATION_MODES, metavar="ROLE",
                   help=f"the new role: {', '.join(DISAGGREGATION_MODES)}")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--wait", type=_wait, default=120.0, metavar="SECONDS",
                   help="wait this long for the worker to serve in the new role (0: do not "
                        "wait; default %(default)g)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    code, message = trio.run(switch_role, args.url, args.role, args.api_key, args.wait)
    print(message, file=sys.stdout if code == 0 else sys.stderr)
    return code


def _error(r: httpx.Response) -> str:
    try:
        body = r.json()
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


async def switch_role(url: str, role: str, api_key: str | None, wait: float
                      ) -> tuple[int, str]:
    """(exit status, what to print) of switching the worker at ``url`` to ``role``."""
    headers = bearer(api_key) if api_key else {}
    shown = display(url)  # unix:PATH as it was typed
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, headers=headers,
                                 mounts=unix_mounts()) as http:
        try:
            r = await http.post(f"{url}/switch_role", json={"role": role})
        except httpx.HTTPError as exc:
            return 1, f"switch-role: cannot reach {shown}: {exc!r}"
        if r.status_code == 200:
            body = r.json()
            return 0, f"{shown} already serves as {role} (role epoch {body['role_epoch']})"
        if r.status_code != 202:
            return 1, f"switch-role: {shown} refused ({r.status_code}): {_error(r)}"
        epoch = int(r.json()["role_epoch"])
        if wait == 0:
            return 0, f"{shown}: switch to {role} accepted (role epoch {epoch} once it serves)"
        return await _until_serving(http, url, role, epoch, wait)


async def _until_serving(http: httpx.AsyncClient, url: str, role: str, epoch: int, wait: float
                         ) -> tuple[int, str]:
    start = trio.current_time()
    last = "no answer yet"
    shown = display(url)
    with trio.move_on_after(wait):
        while True:
            try:
                r = await http.get(f"{url}/server_info")
                info: dict[str, Any] = r.json() if r.status_code == 200 else {}
            except (httpx.HTTPError, ValueError) as exc:
                info, last = {}, f"{type(exc).__name__}: {exc}"
            if info.get("role_state") == ROLE_SWITCH.S.SERVING:
                took = trio.current_time() - start
                if info.get("disaggregation_mode") == role and info.get("role_epoch") == epoch:
                    return 0, f"{shown} serves as {role} (role epoch {epoch}) after {took:.1f} s"
                return 1, (f"switch-role: the switch to {role} failed: {shown} serves as "
                           f"{info.get('disaggregation_mode')} again (role epoch "
                           f"{info.get('role_epoch')}); its log says why")
            if info:
                last = f"role_state {info.get('role_state')}"
            await trio.sleep(POLL_S)
    return 1, f"switch-role: {shown} did not serve as {role} within {wait:g} s (last: {last})"

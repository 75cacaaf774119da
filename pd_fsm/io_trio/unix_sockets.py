"""Unix domain sockets: where a pd_fsm server listens besides TCP (or instead of it), and how
every client of ours reaches one (docs/unix_sockets.md).

Why: the TPU machine this project measures on lets no program open a TCP or UDP socket, not even
on loopback, while unix sockets work; and an inference server in a pod or behind a local reverse
proxy is commonly asked to serve on one (``vllm serve --uds``).

**Addresses.** On a command line a unix socket is ``unix:PATH``. Inside pd_fsm a server's base URL
is nginx's spelling of the same, ``http://unix:PATH:``: an ``http://`` URL that paths append to
as to any other (``http://unix:/run/p0.sock:/health``), so it stays one string through every
worker list, registry record, breaker and log line that holds URLs. :func:`unix_mounts` gives an
httpx client a transport for the host ``unix``: a request there goes over the socket its path
names; every other URL goes over TCP. A socket path must be absolute once resolved, may
not contain ``:`` (it ends the path in the URL) and must fit ``sockaddr_un`` (107 bytes).

**Listening** (:func:`bind_unix`). The socket file is bound, given its mode (``--uds-mode``,
0600 by default: its owner only) and only then listens, so nothing connects before the mode is
set. A socket file left at the path by a process that died (nothing accepts on it: connection
refused) is replaced; one on which a process accepts is refused with an error naming the path;
anything that is not a socket is never removed. The server removes the file when it stops, if it
is still the one it bound (same inode): a successor's socket is left alone.

**The side channel** of a worker that serves on a unix socket only binds ``ipc://PATH.zmq``
(:func:`side_channel_endpoint`), checked and moded the same way (:func:`prepare_ipc`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import socket
import stat
from pathlib import Path
from urllib.parse import unquote_to_bytes

import attrs
import httpx

from pd_fsm.io_trio.flag_spec import Flag

log = logging.getLogger("pd_fsm.io_trio.unix_sockets")

UNIX_PREFIX = "unix:"
URL_PREFIX = "http://unix:"
IPC_PREFIX = "ipc://"
SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes on Linux, the NUL included
DEFAULT_MODE = 0o600
SIDE_CHANNEL_SUFFIX = ".zmq"
PROBE_S = 1.0  # a connect to a socket file whose listener's backlog is full waits this long


class UnixSocketError(OSError):
    """A unix socket that cannot be served on (its message names the path and why)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


@attrs.frozen
class UnixSocket:
    """Where a server listens on the filesystem, and the mode its socket file gets."""

    path: Path
    mode: int = DEFAULT_MODE

    @property
    def url(self) -> str:
        """The base URL clients of ours reach it at (``http://unix:PATH:``)."""
        return unix_url(str(self.path))

    def __str__(self) -> str:
        return f"{UNIX_PREFIX}{self.path}"


def check_path(path: str | os.PathLike[str], what: str = "--uds") -> Path:
    """``path`` made absolute, or ValueError naming ``what`` when no unix socket of ours can be
    there."""
    resolved = os.path.abspath(os.fspath(path))
    if ":" in resolved:
        raise ValueError(f"{what} {resolved}: a unix socket path of ours may not contain ':' "
                         "(it ends the path in http://unix:PATH: URLs)")
    if len(os.fsencode(resolved)) > SUN_PATH_MAX:
        raise ValueError(f"{what} {resolved}: longer than a unix socket path may be "
                         f"({SUN_PATH_MAX} bytes): choose a shorter one")
    return Path(resolved)


def parse_mode(text: str) -> int:
    """``--uds-mode``: octal permission bits (``600``, ``0660``, ``0o660``)."""
    try:
        mode = int(text.lower().removeprefix("0o"), 8)
    except ValueError:
        raise ValueError(f"--uds-mode must be octal permission bits such as 0600, got {text!r}"
                         ) from None
    if not 0 <= mode <= 0o777:
        raise ValueError(f"--uds-mode must be within 0..0777, got {text!r}")
    return mode


def mode_arg(text: str) -> int:
    """:func:`parse_mode` for argparse (its message, not "invalid value")."""
    try:
        return parse_mode(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def uds_flags(what: str = "the server") -> tuple[Flag, Flag]:
    """``--uds PATH`` and ``--uds-mode MODE``, for every command that serves HTTP."""
    return (
        Flag("--uds", type=Path, metavar="PATH", help=(
            f"also serve {what} on this unix socket; without --port, on it alone (no TCP "
            "listener); clients reach it as unix:PATH"), doc=(
            "serve HTTP on this unix socket (docs/unix_sockets.md); with `--port` too, on both; "
            "without, on the socket alone: no TCP listener, and a P's side channel binds "
            "`ipc://PATH.zmq`. Clients of ours reach it as `unix:PATH`. A stale socket file "
            "(its server gone) is replaced, a live one refused; the file is removed on exit")),
        Flag("--uds-mode", type=mode_arg, metavar="MODE", shown_default="0600",
             help="permissions of the --uds socket file, octal (default 0600: its owner only)",
             doc="permissions of the `--uds` socket file (and a P's `ipc://` side channel), "
                 "octal; the default admits only the user it runs as"),
    )


def uds_from_args(args: argparse.Namespace) -> UnixSocket | None:
    """The ``--uds`` socket of parsed arguments (checked), or None."""
    if args.uds is None:
        return None
    mode = DEFAULT_MODE if args.uds_mode is None else args.uds_mode
    return UnixSocket(check_path(args.uds), mode)


def port_from_args(port: int | None, uds: object, default: int) -> int | None:
    """``--port``: as given; not given, ``default``, or None (no TCP) beside ``--uds``."""
    if port is not None:
        return port
    return None if uds is not None else default


def unix_url(path: str) -> str:
    return f"{URL_PREFIX}{path}:"


def is_unix_url(url: str) -> bool:
    return url.startswith(URL_PREFIX)


def socket_path_of(url: str) -> str | None:
    """The socket path of a ``http://unix:PATH:`` URL (anything may follow), else None."""
    if not is_unix_url(url):
        return None
    path, sep, _ = url[len(URL_PREFIX):].partition(":")
    return path if sep else None


def display(url: str) -> str:
    """``unix:PATH`` for a unix socket's URL (what a person typed), other URLs as they are."""
    path = socket_path_of(url)
    return url if path is None else f"{UNIX_PREFIX}{path}"


def service_url(value: str, what: str) -> str:
    """A server's base URL from a command line: ``http(s)://...`` as given, ``unix:PATH`` (or
    ``http://unix:PATH:``) as the unix socket's URL; ValueError naming ``what`` otherwise."""
    value = value.rstrip("/")
    if value.startswith(UNIX_PREFIX):
        return unix_url(str(check_path(value[len(UNIX_PREFIX):], what)))
    if is_unix_url(value):
        path = socket_path_of(value)
        if path:
            return unix_url(str(check_path(path, what)))
        raise ValueError(f"{what} {value!r}: a unix socket URL is http://unix:PATH: (or give "
                         "unix:PATH)")
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"{what} must be http://HOST:PORT, https://... or unix:PATH, got "
                         f"{value!r}")
    return value


def side_channel_endpoint(uds: Path) -> str:
    """The ZMQ endpoint of the side channel of a worker that serves on ``uds`` only."""
    return f"{IPC_PREFIX}{uds}{SIDE_CHANNEL_SUFFIX}"


def ipc_path(endpoint: str) -> str | None:
    """The socket path of an ``ipc://`` endpoint, else None."""
    return endpoint[len(IPC_PREFIX):] if endpoint.startswith(IPC_PREFIX) else None


# --------------------------------------------------------------------------- listening


def _clear_stale(path: str, what: str) -> None:
    """Remove a socket file that nothing accepts on; refuse a live one, or anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise UnixSocketError(f"{what} {path}: the path exists and is not a socket "
                              "(not removed): choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_S)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # its server is gone: nothing accepts on it
        log.warning("%s %s: replaced a stale socket file (its server is gone)", what, path)
        return
    except PermissionError:
        raise UnixSocketError(f"{what} {path}: a socket this process may not connect to (another "
                              "user's?) is there: not replaced") from None
    except OSError as exc:  # a full backlog (timeout) and the like: someone listens
        raise UnixSocketError(f"{what} {path}: a process listens on this socket ({exc}): stop it "
                              "or choose another path") from None
    finally:
        probe.close()
    raise UnixSocketError(f"{what} {path}: another process serves on this unix socket (it "
                          "accepted a connection): stop it or choose another path")


def file_id(path: str) -> tuple[int, int] | None:
    """What identifies the file at ``path`` (device, inode), or None if there is none."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def remove_if(path: str, bound: tuple[int, int] | None) -> None:
    """Unlink the socket file at ``path`` if it is still the one bound (``bound``, its
    :func:`file_id` then): a successor's socket at the same path is left alone."""
    if bound is not None and file_id(path) == bound:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@attrs.frozen
class Bound:
    """A listening unix socket and what identifies its file (to remove that file, and only it)."""

    sock: socket.socket
    path: str
    inode: tuple[int, int] | None

    def remove(self) -> None:
        """Unlink the socket file if it is still the one bound here."""
        remove_if(self.path, self.inode)


def bind_unix(uds: UnixSocket, backlog: int, what: str = "--uds") -> Bound:
    """A socket listening at ``uds.path`` with ``uds.mode`` (see the module docstring); raises
    :class:`UnixSocketError` (or OSError) naming the path. Blocking: run it in a thread."""
    path = str(check_path(uds.path, what))
    _clear_stale(path, what)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.bind(path)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:  # bound by another process since our check
                raise UnixSocketError(f"{what} {path}: another process bound it just now") from None
            raise UnixSocketError(f"{what} {path}: cannot bind: {exc.strerror}") from None
        os.chmod(path, uds.mode)  # before listen(): no connection is accepted before this
        bound = file_id(path)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return Bound(sock, path, bound)


def prepare_ipc(endpoint: str, what: str = "side channel") -> None:
    """Before a ZMQ bind to ``ipc://PATH``: libzmq removes whatever socket file is there, a live
    one too; a live one is refused here instead, a stale one removed."""
    path = ipc_path(endpoint)
    if path is not None:
        _clear_stale(str(check_path(path, what)), what)


# --------------------------------------------------------------------------- clients

_WHY = {
    errno.ENOENT: "no such socket (is its server running?)",
    errno.ECONNREFUSED: "connection refused: nothing accepts on it (its server is gone)",
    errno.EACCES: "permission denied (its mode admits its owner only by default: --uds-mode)",
    errno.EPERM: "permission denied (its mode admits its owner only by default: --uds-mode)",
}


def _cause(exc: BaseException) -> OSError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class UnixTransport(httpx.AsyncBaseTransport):
    """Requests to ``http://unix:PATH:/...`` over the socket at PATH: one connection pool per
    socket, with the limits of the client it is mounted in."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self._pools: dict[str, httpx.AsyncHTTPTransport] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raw = request.url.raw_path  # b"/run/p0.sock:/health?x=1"
        head, sep, rest = raw.partition(b":")
        if not sep or not head.startswith(b"/"):
            raise httpx.UnsupportedProtocol(
                f"{request.url} is no unix socket URL (http://unix:PATH:/...)", request=request)
        path = os.fsdecode(unquote_to_bytes(head))
        pool = self._pools.get(path)
        if pool is None:
            pool = self._pools[path] = httpx.AsyncHTTPTransport(uds=path, limits=self._limits)
        request.url = request.url.copy_with(raw_path=rest or b"/")
        try:
            return await pool.handle_async_request(request)
        except httpx.ConnectError as exc:
            cause = _cause(exc)
            why = _WHY.get(cause.errno or 0) if cause is not None else None
            raise httpx.ConnectError(f"unix socket {path}: {why or exc}", request=request
                                     ) from exc

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()


def unix_mounts(limits: httpx.Limits | None = None) -> dict[str, httpx.AsyncBaseTransport]:
    """``mounts=`` for an ``httpx.AsyncClient``: unix socket URLs go over their sockets."""
    return {"http://unix": UnixTransport(limits or httpx.Limits())}

"""TLS for every HTTP server and client of a cluster (DESIGN "Keys": across hosts, TLS for HTTP).

One rule keeps it simple: TLS is on for a whole cluster or for none of it. A process started with
``--ssl-certfile``/``--ssl-keyfile`` serves HTTPS (hypercorn), advertises ``https://`` URLs, and
calls the bootstrap server over HTTPS too; every process verifies the servers it calls against
``--ssl-ca-certs`` (default: the system's CAs). The flag names are uvicorn's and sglang's.

``throwaway_ca`` makes a CA and one server certificate with the ``openssl`` command-line tool for a
local run (`pd-fsm cluster --tls`); the CA key is deleted once the certificate is signed.
"""

from __future__ import annotations

import argparse
import ssl
import subprocess
from pathlib import Path

import attrs

from pd_fsm.io_trio.flag_spec import Flag, add_flags


class TLSError(ValueError):
    """A TLS setting that cannot work (names the flag)."""


@attrs.frozen
class TLS:
    certfile: Path | None = None  # this process serves HTTPS with this chain ...
    keyfile: Path | None = None  # ... and this key
    ca_file: Path | None = None  # the CAs the servers we call must chain to (None: system's)

    @property
    def serving(self) -> bool:
        return self.certfile is not None

    @property
    def scheme(self) -> str:
        """The scheme of this process's URLs, and of the bootstrap server it calls."""
        return "https" if self.serving else "http"

    def client_context(self) -> ssl.SSLContext:
        """What httpx verifies servers with (hostname and chain, against ``ca_file``)."""
        return ssl.create_default_context(
            cafile=str(self.ca_file) if self.ca_file is not None else None
        )

    def argv(self) -> list[str]:
        """These settings as flags, for a child process."""
        out: list[str] = []
        for flag, value in (("--ssl-certfile", self.certfile), ("--ssl-keyfile", self.keyfile),
                            ("--ssl-ca-certs", self.ca_file)):
            if value is not None:
                out += [flag, str(value)]
        return out


NO_TLS = TLS()


def tls_flags(*, client: bool = True) -> tuple[Flag, ...]:
    """``--ssl-certfile``/``--ssl-keyfile`` (serving), and for a process that calls HTTPS
    servers (``client``) ``--ssl-ca-certs``."""
    serving = (
        Flag("--ssl-certfile", "serve HTTPS with this certificate (chain); then every URL this "
             "process advertises or calls in its cluster is https://",
             type=Path, metavar="PEM", sglang="--ssl-certfile"),
        Flag("--ssl-keyfile", "the certificate's private key",
             type=Path, metavar="PEM", sglang="--ssl-keyfile"),
    )
    if not client:
        return serving
    return (*serving, Flag(
        "--ssl-ca-certs", "verify the HTTPS servers this process calls against these CAs "
        "(default: the system's)", type=Path, metavar="PEM", sglang="--ssl-ca-certs",
    ))


def add_tls_arguments(p: argparse.ArgumentParser, *, client: bool = True) -> None:
    add_flags(p, tls_flags(client=client))


def tls_from_args(args: argparse.Namespace) -> TLS:
    """The settings, checked now (files readable, key matches certificate) so a mistake stops
    the process at start with the flag's name, not at the first connection."""
    cert, key = args.ssl_certfile, args.ssl_keyfile
    ca = getattr(args, "ssl_ca_certs", None)
    if (cert is None) != (key is None):
        raise TLSError("--ssl-certfile and --ssl-keyfile go together")
    if cert is not None:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise TLSError(f"--ssl-certfile {cert} / --ssl-keyfile {key}: {exc}") from None
    tls = TLS(cert, key, ca)
    if ca is not None:
        try:
            tls.client_context()
        except (OSError, ssl.SSLError) as exc:
            raise TLSError(f"--ssl-ca-certs {ca}: {exc}") from None
    return tls


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False)
    if done.returncode != 0:
        raise TLSError(f"openssl {args[0]} failed: {done.stderr.strip()[:500]}")


def throwaway_ca(directory: Path, hosts: list[str]) -> TLS:
    """A fresh CA (``ca.pem``) and a server certificate for ``hosts`` (IPs or names) signed by
    it, valid 2 days, in ``directory``. The CA's key is deleted after signing: nothing else can
    ever be signed by this CA."""
    directory.mkdir(parents=True, exist_ok=True)
    sans = ",".join(("IP:" if _is_ip(h) else "DNS:") + h for h in hosts)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=pd-fsm throwaway CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=pd-fsm",
             cwd=directory)
    (directory / "server.ext").write_text(
        f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "server.ext",
             cwd=directory)
    for leftover in ("ca.key", "server.csr", "server.ext", "ca.srl"):
        (directory / leftover).unlink(missing_ok=True)
    (directory / "server.key").chmod(0o600)
    return TLS(directory / "server.pem", directory / "server.key", directory / "ca.pem")


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True

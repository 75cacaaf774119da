"""Everything `pd-fsm serve` is told, in one frozen object (RFC-2 §7 flag names).

The same object reaches every backend: the colocated one reads the scheduler knobs; the prefill
and decode backends (``pd_backends.make_pd_backend(config)``) read the ``disaggregation_*`` ones.
Its fields' defaults are the flags' defaults: the flags themselves are declared in ``flags.py``,
and the parser and ``config_from_args`` are derived from those declarations.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from pd_fsm.core.config import DecodeConfig, LeaseConfig
from pd_fsm.io_trio.cli_common import DRAIN_TIMEOUT_S
from pd_fsm.io_trio.flag_spec import add_flags, read_flags
from pd_fsm.io_trio.tls import NO_TLS, TLS
from pd_fsm.io_trio.unix_sockets import (
    DEFAULT_MODE,
    UnixSocket,
    service_url,
    side_channel_endpoint,
    unix_url,
)
from pd_fsm.io_trio.worker.flag_hooks import SERVE_HOOKS
from pd_fsm.io_trio.worker.flags import DEFAULT_PORT, SERVE_FLAGS

if TYPE_CHECKING:
    from pd_fsm.io_trio.cluster.tpu_placement import TpuPlacement
    from pd_fsm.io_trio.side_channel.curve import CurveKeys
    from pd_fsm.schedulers.args import SchedulerArgs

DEFAULT_MAX_BODY = 8 * 1024 * 1024  # a 100k-token prompt as JSON ids is ~700 KB
# The core's own defaults for the PD windows (DESIGN §5): one place for each number.
_LEASE = LeaseConfig()
_DECODE = DecodeConfig()


@attrs.frozen(kw_only=True)
class ServeConfig:
    # -- HTTP
    host: str = "127.0.0.1"
    # None: no TCP listener (a worker on its unix socket alone, ``uds``).
    port: int | None = DEFAULT_PORT
    # A unix socket the worker serves HTTP on too (docs/unix_sockets.md), created with
    # ``uds_mode``; alone (``port`` None) the worker listens on no TCP port, and as P its side
    # channel binds ``ipc://<uds>.zmq``.
    uds: Path | None = None
    uds_mode: int = DEFAULT_MODE
    # The host peers are told (registry records, instance id); None: ``host``. Resolved and
    # checked at start (pd_fsm.io_trio.bootstrap.addresses): never a wildcard, never loopback to a
    # registry on another host. The transfer data plane binds this address only.
    advertise_host: str | None = None
    max_body: int = DEFAULT_MAX_BODY
    # The service-level objective a request is counted against in /metrics (goodput,
    # DistServe's: time to first token and mean inter-token latency both within bounds).
    slo_ttft: float = 2.0
    slo_itl: float = 0.1
    # On SIGTERM: out of the registry, new requests refused with 503 and Retry-After, and this
    # long for the requests in flight to finish before the process stops; the same bound for
    # the drain of a role switch.
    drain_timeout: float = DRAIN_TIMEOUT_S
    # A draining decode worker hands its running streams (those the proxy let it: accept_handoff)
    # to another D when the registry lists one (drain_gate.py): their KV is pulled, not
    # prefilled again. --no-drain-handoff: they finish in place.
    drain_handoff: bool = True
    served_model_name: str | None = None  # default: the model's name ("smollm2", "tiny")
    # --chat-template FILE's text (read and compiled at start): replaces the model's template.
    chat_template: str | None = attrs.field(default=None, repr=False)
    # -- scheduler (SchedulerArgs)
    model: str = "smollm2"
    load_format: str = "auto"  # "dummy": random weights at the model's shape
    dtype: str | None = None  # the weights' (--dtype); None: the backend's (weights_dtype)
    kv_dtype: str | None = None  # the KV cache's (--kv-dtype); None: ``dtype``
    model_seed: int = 0
    num_pages: int = 1024
    page_size: int = 16
    max_running: int = 8
    max_batched_tokens: int | None = None  # None: the backend's (schedulers/args.py)
    context_length: int | None = None
    random_seed: int = 0
    # Devices the model and KV pool are sharded over (tensor parallelism; on CPU the worker
    # forces that many host devices before JAX starts).
    tp_size: int = 1
    # One instance over several processes (sglang's flags): ``tp_size`` devices in all, split
    # evenly; rank 0 serves HTTP and commands the others (io_trio/worker/spmd). None: one process.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of rank 0's jax.distributed coordinator
    # The prefix cache (schedulers/radix_cache.py): on for colocated and prefill workers (as in
    # sglang), opt-in on decode workers, whose cached pages compete with running sequences.
    radix_cache: bool = True
    decode_radix_cache: bool = False
    max_queued: int = 1024  # jobs waiting to enter the scheduler; beyond that: 503
    # The roles this worker may take at runtime (POST /switch_role), each compiled
    # before ready; empty: only --disaggregation-mode's.
    roles: tuple[str, ...] = ()
    # -- disaggregation (RFC-2 §7)
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "jax"
    disaggregation_bootstrap_host: str = "127.0.0.1"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_bootstrap_heartbeat_interval: float = _DECODE.heartbeat_interval
    disaggregation_bootstrap_heartbeat_ttl: float = 15.0
    disaggregation_failure_policy: str = "fail"
    # P: checksum each registered KV array (READY carries them, and a spare registration); D:
    # verify every pull, re-pull once on a mismatch. P and D must both have it or neither.
    disaggregation_kv_checksum: bool = False
    # P: stream a room's KV to D in parts of this many prompt tokens while prefilling, so that
    # D pulls the first parts while P computes the rest; 0: the whole KV after the prefill.
    disaggregation_stream_tokens: int = 256
    disaggregation_queue_timeout: float = _DECODE.queue_timeout
    # P's side channel port (0: any free port); also the port routers know P by by default.
    disaggregation_side_channel_port: int = 0
    # Name on the side channel and in the registry (default: "<mode>-<host>-<port>").
    disaggregation_instance_id: str | None = None
    # D: the P port to assume when a router sends bootstrap_port null (sglang's mini-lb can).
    disaggregation_prefill_port: int | None = None
    # The PD windows (DESIGN §5 defaults; shorten them to test failures quickly).
    disaggregation_lease_initial: float = _LEASE.initial
    disaggregation_lease_extension: float = _LEASE.extension
    disaggregation_peer_timeout: float = _DECODE.peer_timeout
    disaggregation_ready_timeout: float = _DECODE.ready_timeout
    disaggregation_transfer_timeout: float = _DECODE.transfer_timeout
    disaggregation_pull_deadline: float = 60.0
    # D: threads that run pulls (each only waits on its transfer; the forward thread scatters).
    disaggregation_pull_workers: int = 2
    cluster_secret_file: Path | None = None
    # HTTPS for this worker's server, its registry calls and its advertised URL (tls.py).
    tls: TLS = NO_TLS
    # CURVE on the side channel (pd_fsm.io_trio.side_channel.curve): this worker's key pair and
    # the public keys it trusts, loaded (and checked) once from the two flags' files at start.
    side_channel_curve: CurveKeys | None = attrs.field(default=None, repr=False)
    log_level: str = "INFO"
    # "hugepages": large host buffers on transparent huge pages (pd_fsm.jax_engine.kv.host_memory)
    host_heap: str = "hugepages"
    # Cores this worker may run on ("0", "0-1", "0,2"): set before JAX starts (cpu_placement.py).
    cpus: str | None = None
    # The TPU chips it opens (--tpu-chips, checked against its host's layout): libtpu's
    # variables, set before JAX starts (tpu_placement.py). None: not told (every chip).
    tpu: TpuPlacement | None = None
    # "cpus": XLA's pools sized to ``cpus`` (pinned before JAX starts); "all": sized to every
    # core this process may use, and the threads pinned to ``cpus`` once they exist, so that
    # POST /set_cpus may widen them again (the planner's cores lever); "N": pools of N threads
    # (pinned to N of ``cpus`` until they exist, then on all of them).
    cpu_pools: str = "cpus"
    # The cores the process could run on when it was started, before ``cpus`` narrowed them:
    # where POST /set_cpus may move a worker whose pools are not sized to ``cpus``. None: the
    # affinity when the worker is built (a config made in code).
    cores_at_start: frozenset[int] | None = None
    # CPU priority of every thread of the worker (-20..19), set before JAX starts: with P and D
    # on the same cores, D above P (cpu_placement.set_nice).
    nice: int = 0
    # Each role's nice value ((role, nice) pairs), for a worker whose role switches at runtime:
    # the priority follows the role (cpu_placement.renice_threads); a role left out keeps `nice`.
    role_nice: tuple[tuple[str, int], ...] = ()
    # P/D: nice value for the transfer server's socket threads (-20..0; 0 leaves them), so a
    # pull is not queued behind compute (pd_fsm.jax_engine.transfer.thread_priority).
    transfer_nice: int = -10
    # Clients of the OpenAI / sglang endpoints must send "Authorization: Bearer <key>".
    api_key: str | None = attrs.field(default=None, repr=False)
    # Before ready: "full" compiles every shape the scheduler can run (no request waits for a
    # compile); "minimal" runs one short request (quicker start; requests compile new shapes).
    warmup: str = "full"
    # JAX's persistent compilation cache (pd_fsm.jax_engine.compilation.cache); None: its
    # default directory.
    compilation_cache: bool = True
    compilation_cache_dir: Path | None = None

    @property
    def cpus_after_pools(self) -> bool:
        """Whether the worker is put on ``cpus`` only once its pools exist (``--cpu-pools all``
        or N: its pools are not sized to ``cpus``, and POST /set_cpus may move it within the
        cores it had at start)."""
        return self.cpus is not None and self.cpu_pools != "cpus"

    def nice_of(self, role: str) -> int:
        """The CPU priority of this worker in ``role`` (``--role-nice``, else ``--nice``)."""
        return dict(self.role_nice).get(role, self.nice)

    @property
    def public_host(self) -> str:
        """The address peers reach this worker at (what the registry stores)."""
        return self.advertise_host or self.host

    @property
    def unix_socket(self) -> UnixSocket | None:
        return None if self.uds is None else UnixSocket(self.uds, self.uds_mode)

    @property
    def url(self) -> str:
        """This worker's base URL as peers reach it: TCP when it listens on TCP, else its unix
        socket's (``http://unix:PATH:``)."""
        if self.port is None:
            assert self.uds is not None, "a worker without a TCP port serves on --uds"
            return unix_url(str(self.uds))
        return f"{self.tls.scheme}://{self.public_host}:{self.port}"

    @property
    def side_channel_ipc(self) -> str | None:
        """P's side channel endpoint on the filesystem, for a worker on its unix socket alone
        (None: TCP, ``disaggregation_side_channel_port``)."""
        return None if self.port is not None or self.uds is None else (
            side_channel_endpoint(self.uds))

    @property
    def bootstrap_url(self) -> str:
        """The bootstrap server's (the registry's) URL: ``--disaggregation-bootstrap-host
        unix:PATH`` names its unix socket (the port is then unused)."""
        host = self.disaggregation_bootstrap_host
        if host.startswith("unix:"):
            return service_url(host, "--disaggregation-bootstrap-host")
        # TLS is on for the whole cluster or none of it (pd_fsm.io_trio.tls).
        return f"{self.tls.scheme}://{host}:{self.disaggregation_bootstrap_port}"

    @property
    def role_list(self) -> tuple[str, ...]:
        """Every role this worker may serve, the starting one (``disaggregation_mode``) first."""
        rest = tuple(r for r in self.roles if r != self.disaggregation_mode)
        return (self.disaggregation_mode, *rest)

    def in_role(self, role: str) -> ServeConfig:
        """This config for a worker serving ``role`` (a role switch's new backend)."""
        return attrs.evolve(self, disaggregation_mode=role)

    @property
    def model_name(self) -> str:
        # A checkpoint directory is served under its last path component.
        return self.served_model_name or Path(self.model).name

    def scheduler_args(self) -> SchedulerArgs:
        """The scheduler's knobs: this config's fields of the same names, but the prefix cache,
        which decode workers switch on with a flag of their own."""
        from pd_fsm.schedulers.args import SchedulerArgs, same_named

        radix_cache = (self.decode_radix_cache if self.disaggregation_mode == "decode"
                       else self.radix_cache)
        return SchedulerArgs(**{**same_named(self, SchedulerArgs), "radix_cache": radix_cache})

    def spmd_addr(self) -> str:
        """Where rank 0 takes the other ranks' connections: the coordinator's host, its port + 1."""
        assert self.dist_init_addr is not None
        host, _, port = self.dist_init_addr.rpartition(":")
        return f"{host}:{int(port) + 1}"

    def spmd_key(self) -> bytes | None:
        """The key of a multi-process instance's command stream (from the cluster secret)."""
        from pd_fsm.core.keys import spmd_key

        secret = self.cluster_secret()
        return None if secret is None else spmd_key(secret)

    def cluster_secret(self) -> bytes | None:
        """The secret's bytes (stripped), None when no file is configured; raises OSError or
        ValueError for an unreadable or empty file. The side channel and the bootstrap client
        each derive their own key from it (:mod:`pd_fsm.core.keys`) and keep only that."""
        if self.cluster_secret_file is None:
            return None
        secret = self.cluster_secret_file.read_bytes().strip()
        if not secret:
            raise ValueError(f"--cluster-secret-file {self.cluster_secret_file} is empty")
        return secret


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """`pd-fsm serve`'s flags, from their declarations (flags.py) and ServeConfig's defaults."""
    add_flags(p, SERVE_FLAGS, ServeConfig)


HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def force_host_devices(environ: MutableMapping[str, str], n: int) -> None:
    """Make JAX's host (CPU) platform show ``n`` devices, unless ``XLA_FLAGS`` already sets a
    count (the user's wins; the scheduler refuses a tp size it cannot place). Must run before
    anything starts a JAX backend."""
    flags = environ.get("XLA_FLAGS", "")
    if HOST_DEVICES_FLAG not in flags:
        environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICES_FLAG}={n}".strip()


def check_environment(environ: Mapping[str, str]) -> None:
    """RFC-2 §7's environment switches, read at start: a value we do not implement stops the
    worker with a clear message instead of being silently ignored."""
    d2h = environ.get("TPU_ENABLE_D2H_TRANSFER")
    if d2h is None or d2h.strip() in ("", "0"):
        return  # device-resident KV pulls: what the JAX transfer engine does
    if d2h.strip() == "1":
        raise ValueError(
            "TPU_ENABLE_D2H_TRANSFER=1 (stage KV through host memory, RFC-2 §7) is not "
            "implemented: unset it or set it to 0"
        )
    raise ValueError(f"TPU_ENABLE_D2H_TRANSFER must be 0 or 1, got {d2h!r}")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The config for parsed ``serve`` arguments; raises ValueError naming a bad value. Each
    flag's own check first, in declaration order, then the hooks (flag_hooks.py), in theirs."""
    return ServeConfig(**read_flags(args, SERVE_FLAGS, SERVE_HOOKS, ServeConfig))

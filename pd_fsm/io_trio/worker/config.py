"""Everything `pd-fsm serve` is told, in one frozen object (RFC-2 §7 flag names).

The same object reaches every backend: the colocated one reads the scheduler knobs; the prefill
and decode backends (``pd_backends.make_pd_backend(config)``) read the ``disaggregation_*`` ones.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import attrs

from pd_fsm.core.config import DecodeConfig
from pd_fsm.io_trio.api_key import add_api_key_arguments, api_key_from_args
from pd_fsm.io_trio.cluster.cpu_placement import parse_cpus
from pd_fsm.io_trio.tls import NO_TLS, TLS, add_tls_arguments, tls_from_args

if TYPE_CHECKING:
    from pd_fsm.io_trio.side_channel.curve import CurveKeys
    from pd_fsm.schedulers.args import SchedulerArgs

# The same tuples as pd_fsm.jax_engine.model.registry.MODEL_NAMES and
# pd_fsm.schedulers.args.DISAGGREGATION_MODES (a test keeps them equal): importing those pulls in
# JAX, and `pd-fsm --help` / `pd-fsm spec` must not pay for that.
MODEL_NAMES = ("smollm2", "tiny")
DISAGGREGATION_MODES = ("null", "prefill", "decode")

FAILURE_POLICIES = ("fail", "recompute")
TRANSFER_BACKENDS = ("jax",)
HOST_HEAP_POLICIES = ("hugepages", "default")  # pd_fsm.jax_engine.host_memory
WARMUP_MODES = ("full", "minimal")
DEFAULT_MAX_BODY = 8 * 1024 * 1024  # a 100k-token prompt as JSON ids is ~700 KB


class PDWindows(TypedDict):
    """``ServeConfig.pd_windows()``: the PD windows, named as DisaggregationArgs' fields."""

    lease_initial: float
    lease_extension: float
    peer_timeout: float
    ready_timeout: float
    transfer_timeout: float
    pull_deadline: float


@attrs.frozen(kw_only=True)
class ServeConfig:
    # -- HTTP
    host: str = "127.0.0.1"
    port: int = 30000
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
    # long for the requests in flight to finish before the process stops (issue 32 §3).
    drain_timeout: float = 30.0
    served_model_name: str | None = None  # default: the model's name ("smollm2", "tiny")
    # --chat-template FILE's text (read and compiled at start): replaces the model's template.
    chat_template: str | None = attrs.field(default=None, repr=False)
    # -- scheduler (SchedulerArgs)
    model: str = "smollm2"
    dtype: str = "float32"
    kv_dtype: str | None = None  # the KV cache's (--kv-dtype); None: ``dtype``
    model_seed: int = 0
    num_pages: int = 1024
    page_size: int = 16
    max_running: int = 8
    max_batched_tokens: int = 1024
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
    # -- disaggregation (RFC-2 §7)
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "jax"
    disaggregation_bootstrap_host: str = "127.0.0.1"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_bootstrap_heartbeat_interval: float = 5.0
    disaggregation_bootstrap_heartbeat_ttl: float = 15.0
    disaggregation_failure_policy: str = "fail"
    disaggregation_queue_timeout: float = DecodeConfig().queue_timeout
    # P's side channel port (0: any free port); also the port routers know P by by default.
    disaggregation_side_channel_port: int = 0
    # Name on the side channel and in the registry (default: "<mode>-<host>-<port>").
    disaggregation_instance_id: str | None = None
    # D: the P port to assume when a router sends bootstrap_port null (sglang's mini-lb can).
    disaggregation_prefill_port: int | None = None
    # The PD windows (DESIGN §5 defaults; shorten them to test failures quickly).
    disaggregation_lease_initial: float = 30.0
    disaggregation_lease_extension: float = 20.0
    disaggregation_peer_timeout: float = 15.0
    disaggregation_ready_timeout: float = 300.0
    disaggregation_transfer_timeout: float = 120.0
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
    # "hugepages": large host buffers on transparent huge pages (pd_fsm.jax_engine.host_memory)
    host_heap: str = "hugepages"
    # Cores this worker may run on ("0", "0-1", "0,2"): set before JAX starts (cpu_placement.py).
    cpus: str | None = None
    # P/D: nice value for the transfer server's socket threads (-20..0; 0 leaves them), so a
    # pull is not queued behind compute (pd_fsm.jax_engine.transfer.thread_priority).
    transfer_nice: int = -10
    # Clients of the OpenAI / sglang endpoints must send "Authorization: Bearer <key>".
    api_key: str | None = attrs.field(default=None, repr=False)
    # Before ready: "full" compiles every shape the scheduler can run (no request waits for a
    # compile); "minimal" runs one short request (quicker start; requests compile new shapes).
    warmup: str = "full"
    # JAX's persistent compilation cache (pd_fsm.jax_engine.compilation_cache); None: its
    # default directory.
    compilation_cache: bool = True
    compilation_cache_dir: Path | None = None

    @property
    def public_host(self) -> str:
        """The address peers reach this worker at (what the registry stores)."""
        return self.advertise_host or self.host

    @property
    def model_name(self) -> str:
        # A checkpoint directory is served under its last path component.
        return self.served_model_name or Path(self.model).name

    def scheduler_args(self) -> SchedulerArgs:
        from pd_fsm.schedulers.args import SchedulerArgs

        return SchedulerArgs(
            model=self.model,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            model_seed=self.model_seed,
            num_pages=self.num_pages,
            page_size=self.page_size,
            max_running=self.max_running,
            max_batched_tokens=self.max_batched_tokens,
            context_length=self.context_length,
            random_seed=self.random_seed,
            tp_size=self.tp_size,
            disaggregation_mode=self.disaggregation_mode,
            radix_cache=(self.decode_radix_cache if self.disaggregation_mode == "decode"
                         else self.radix_cache),
        )

    def pd_windows(self) -> PDWindows:
        """The PD windows as DisaggregationArgs fields."""
        return {
            "lease_initial": self.disaggregation_lease_initial,
            "lease_extension": self.disaggregation_lease_extension,
            "peer_timeout": self.disaggregation_peer_timeout,
            "ready_timeout": self.disaggregation_ready_timeout,
            "transfer_timeout": self.disaggregation_transfer_timeout,
            "pull_deadline": self.disaggregation_pull_deadline,
        }

    def spmd_addr(self) -> str:
        """Where rank 0 takes the other ranks' connections: the coordinator's host, its port + 1."""
        assert self.dist_init_addr is not None
        host, _, port = self.dist_init_addr.rpartition(":")
        return f"{host}:{int(port) + 1}"

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


def _model_arg(value: str) -> str:
    if value in MODEL_NAMES or Path(value).is_dir():
        return value
    raise argparse.ArgumentTypeError(
        f"unknown model {value!r} (expected {', '.join(MODEL_NAMES)} or a checkpoint directory)"
    )


_WINDOWS = {
    "lease-initial": "P: seconds a room's KV is held before D's first heartbeat (default 30)",
    "lease-extension": "P: each D heartbeat extends the lease to now + this (default 20)",
    "peer-timeout": "D: P silent this long (and 2 heartbeats unanswered) is lost (default 15)",
    "ready-timeout": "D: seconds to wait for P's READY (default 300)",
    "transfer-timeout": "D: backstop for one room's transfer (default 120)",
    "pull-deadline": "D: the pull executor's own deadline, < transfer-timeout (default 60)",
}


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    p.add_argument("--host", default=d.host, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=d.port, help="HTTP port (0: any free port)")
    p.add_argument(
        "--advertise-host", default=None, metavar="IP",
        help="P/D: the address peers on other hosts reach this worker at (registry records; "
        "the KV transfer server binds it); needed with --host 0.0.0.0 (default: --host)",
    )
    p.add_argument(
        "--advertise-interface", default=None, metavar="NAME",
        help="P/D: advertise the IPv4 address of this network interface instead",
    )
    p.add_argument(
        "--model",
        type=_model_arg,
        default=d.model,
        help=f"{' | '.join(MODEL_NAMES)} | a local HF Llama/Qwen2 checkpoint directory",
    )
    p.add_argument("--served-model-name", default=None, help="name clients use (default --model)")
    p.add_argument(
        "--chat-template", default=None, metavar="FILE",
        help="Jinja chat template to use instead of the model's own",
    )
    p.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16"),
                   help="the weights' (bfloat16 runs XLA:CPU's products slowly: see README)")
    p.add_argument("--kv-dtype", default=None, choices=("float32", "bfloat16"),
                   help="the KV cache's: pool, gather, transfer and scatter (default: --dtype); "
                        "bfloat16 halves the bytes each room moves; attention accumulates in f32. "
                        "P and D must agree (a D refuses a P of another --kv-dtype by name)")
    p.add_argument("--model-seed", type=int, default=d.model_seed, help="tiny model weights")
    p.add_argument("--num-pages", type=int, default=d.num_pages, help="KV pool pages (+null)")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    p.add_argument("--max-running", type=int, default=d.max_running, help="admitted requests")
    p.add_argument("--max-batched-tokens", type=int, default=d.max_batched_tokens)
    p.add_argument("--context-length", type=int, default=None, help="default: the model's")
    p.add_argument("--random-seed", type=int, default=d.random_seed)
    p.add_argument("--tp", "--tp-size", dest="tp_size", type=int, default=d.tp_size,
                   help="tensor parallelism: shard the model and the KV pool (on its kv-head "
                        "axis) over this many devices; must divide the model's kv-heads "
                        "(SmolLM2 3, tiny 4). On CPU the worker makes that many host devices")
    p.add_argument("--nnodes", type=int, default=d.nnodes,
                   help="colocated: processes (one per host) one tensor-parallel instance spans; "
                        "--tp counts the devices of all of them")
    p.add_argument("--node-rank", type=int, default=d.node_rank,
                   help="this process's rank among --nnodes: 0 serves HTTP, the others follow it")
    p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="with --nnodes > 1: rank 0's address; JAX's coordinator binds PORT on "
                        "rank 0 and rank 0 takes the other ranks' command connections on PORT+1")
    # Each names the roles it acts on, so one set of flags can go to every worker of a cluster
    # (`pd-fsm cluster --worker-args`).
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="colocated and prefill workers: no prefix cache of KV pages (on by "
                        "default: a prompt sharing a cached prefix prefills only the rest)")
    p.add_argument("--decode-radix-cache", action="store_true",
                   help="decode workers: a prefix cache of KV pages, and pulls of only the "
                        "pages it lacks (delta-only transfer; off by default)")
    p.add_argument("--max-queued", type=int, default=d.max_queued, help="then 503")
    p.add_argument("--max-body", type=int, default=d.max_body, help="request body limit (bytes)")
    p.add_argument("--slo-ttft", type=float, default=d.slo_ttft, metavar="SECONDS",
                   help="goodput's time-to-first-token bound: each finished request is counted "
                        "in pd_fsm_worker_requests_slo_total{met=true|false}")
    p.add_argument("--slo-itl", type=float, default=d.slo_itl, metavar="SECONDS",
                   help="goodput's bound on a request's mean inter-token latency")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout, metavar="SECONDS",
                   help="on SIGTERM: leave the registry, answer new requests 503 with "
                        "Retry-After, and let the requests in flight finish for at most this "
                        "long before stopping (default 30)")
    p.add_argument("--disaggregation-mode", choices=DISAGGREGATION_MODES, default="null")
    p.add_argument(
        "--disaggregation-transfer-backend", choices=TRANSFER_BACKENDS, default="jax"
    )
    p.add_argument("--disaggregation-bootstrap-host", default=d.disaggregation_bootstrap_host)
    p.add_argument(
        "--disaggregation-bootstrap-port", type=int, default=d.disaggregation_bootstrap_port
    )
    p.add_argument(
        "--disaggregation-bootstrap-heartbeat-interval",
        type=float,
        default=d.disaggregation_bootstrap_heartbeat_interval,
        help="seconds between registry heartbeats (default 5)",
    )
    p.add_argument(
        "--disaggregation-bootstrap-heartbeat-ttl",
        type=float,
        default=d.disaggregation_bootstrap_heartbeat_ttl,
        help="registry TTL this worker assumes until the registry names its own: the interval "
        "must be at most half of it; /health turns 503 once no write was acknowledged for that "
        "long (default 15)",
    )
    p.add_argument(
        "--disaggregation-failure-policy", choices=FAILURE_POLICIES, default="fail",
        help="on a failed KV transfer: fail the request, or recompute the prefill on D",
    )
    p.add_argument(
        "--disaggregation-queue-timeout",
        type=float,
        default=d.disaggregation_queue_timeout,
        help="D: seconds a request may wait for free pages (default 300)",
    )
    p.add_argument(
        "--disaggregation-side-channel-port",
        type=int,
        default=0,
        help="P: ZMQ side channel port, also its bootstrap port for routers (0: any free)",
    )
    p.add_argument("--disaggregation-instance-id", default=None,
                   help="name on the side channel and in the registry")
    p.add_argument("--disaggregation-prefill-port", type=int, default=None,
                   help="D: P port to use when a router sends bootstrap_port null")
    for flag, help_text in _WINDOWS.items():
        name = flag.replace("-", "_")
        p.add_argument(f"--disaggregation-{flag}", type=float,
                       default=getattr(d, f"disaggregation_{name}"), help=help_text)
    p.add_argument(
        "--cluster-secret-file", type=Path, default=None,
        help="file holding the cluster secret: keys derived from it sign side-channel frames "
        "and registry writes (the secret itself is never sent)",
    )
    p.add_argument("--log-level", default=d.log_level, help="DEBUG, INFO, WARNING, ...")
    p.add_argument(
        "--host-heap", choices=HOST_HEAP_POLICIES, default=d.host_heap,
        help="hugepages: large host buffers on huge pages (faster pulls on CPU); default: glibc's",
    )
    p.add_argument("--cpus", default=None, metavar="LIST",
                   help="pin the worker to these cores, e.g. 0 or 0-1 or 0,2 (default: all)")
    p.add_argument("--disaggregation-pull-workers", type=int, default=d.disaggregation_pull_workers,
                   metavar="N", help="D: pulls run at once, at most (default "
                   f"{d.disaggregation_pull_workers}; more queue for a free thread)")
    p.add_argument("--transfer-nice", type=int, default=d.transfer_nice, metavar="N",
                   help="P/D: nice value (-20..0) for the KV transfer threads, ahead of "
                   "compute; needs CAP_SYS_NICE (else logged and left); 0: leave them "
                   f"(default {d.transfer_nice})")
    p.add_argument(
        "--warmup", choices=WARMUP_MODES, default=os.environ.get("PD_FSM_WARMUP", d.warmup),
        help="before ready: full = compile every shape the scheduler can run (default, or "
        "$PD_FSM_WARMUP); minimal = one short request (faster start; new shapes compile on "
        "first use, on the request path)",
    )
    p.add_argument(
        "--compilation-cache-dir", type=Path, default=None, metavar="DIR",
        help="JAX's persistent compilation cache (default: ~/.cache/pd_fsm/xla, or "
        "$PD_FSM_CACHE_DIR/xla)",
    )
    p.add_argument("--no-compilation-cache", action="store_true",
                   help="compile everything afresh at every start")
    add_api_key_arguments(p)
    add_tls_arguments(p)
    p.add_argument("--side-channel-curve-key", type=Path, default=None, metavar="FILE",
                   help="P/D: CURVE-encrypt the side channel with this key pair (pyzmq's "
                   "NAME.key_secret, from zmq.auth.create_certificates)")
    p.add_argument("--side-channel-curve-peers", type=Path, default=None, metavar="DIR",
                   help="P/D: the public keys (*.key) of the peers to accept: P admits only "
                   "these D, D dials only these P")


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


def _check_nodes(args: argparse.Namespace) -> None:
    if args.nnodes < 1:
        raise ValueError("--nnodes must be >= 1")
    if args.nnodes == 1:
        if args.node_rank != 0 or args.dist_init_addr is not None:
            raise ValueError("--node-rank and --dist-init-addr are for --nnodes > 1")
        return
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.tp_size % args.nnodes:
        raise ValueError(f"--tp {args.tp_size} does not split over --nnodes {args.nnodes}")
    addr = args.dist_init_addr
    host, _, port = (addr or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"--nnodes > 1 needs --dist-init-addr HOST:PORT (PORT < 65535: PORT+1 "
                         f"is used too), got {addr!r}")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The config for parsed ``serve`` arguments; raises ValueError naming a bad value."""
    for name in ("num_pages", "page_size", "max_running", "max_batched_tokens", "max_queued",
                 "max_body", "tp_size", "slo_ttft", "slo_itl", "drain_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if args.context_length is not None and args.context_length <= 1:
        raise ValueError("--context-length must be > 1")
    if not 0 <= args.port < 65536:
        raise ValueError("--port must be in 0..65535")
    interval = args.disaggregation_bootstrap_heartbeat_interval
    ttl = args.disaggregation_bootstrap_heartbeat_ttl
    if interval > 0 and ttl > 0 and 2 * interval > ttl:
        raise ValueError(
            f"--disaggregation-bootstrap-heartbeat-interval {interval:g} cannot keep a "
            f"registration alive under --disaggregation-bootstrap-heartbeat-ttl {ttl:g}: "
            "keep it at most half the TTL, so one lost heartbeat does not expire it"
        )
    if args.cpus is not None:
        parse_cpus(args.cpus)  # a bad list fails here, naming itself
    _check_nodes(args)
    if args.disaggregation_pull_workers < 1:
        raise ValueError("--disaggregation-pull-workers must be >= 1")
    if not -20 <= args.transfer_nice <= 0:
        raise ValueError(f"--transfer-nice must be in -20..0, got {args.transfer_nice}")
    if args.warmup not in WARMUP_MODES:  # argparse does not check a default ($PD_FSM_WARMUP)
        raise ValueError(f"--warmup must be one of {', '.join(WARMUP_MODES)}, got {args.warmup!r}")
    if args.no_compilation_cache and args.compilation_cache_dir is not None:
        raise ValueError("--compilation-cache-dir and --no-compilation-cache contradict")
    windows = tuple(f"disaggregation_{w.replace('-', '_')}" for w in _WINDOWS)
    for name in ("disaggregation_bootstrap_heartbeat_interval",
                 "disaggregation_bootstrap_heartbeat_ttl", "disaggregation_queue_timeout",
                 *windows):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    advertise = args.advertise_host
    if args.disaggregation_mode != "null":
        # Imported here like the rest of io_trio's helpers; raises AddressError (a ValueError).
        from pd_fsm.io_trio.bootstrap.addresses import advertised_host

        advertise = advertised_host(
            args.host, args.advertise_host, args.advertise_interface,
            registry_host=args.disaggregation_bootstrap_host,
        )
    elif args.advertise_interface is not None:
        raise ValueError("--advertise-interface is for P and D workers (--disaggregation-mode)")
    if (args.side_channel_curve_key is None) != (args.side_channel_curve_peers is None):
        raise ValueError("--side-channel-curve-key and --side-channel-curve-peers go together")
    curve = None
    if args.side_channel_curve_key is not None:
        if args.disaggregation_mode == "null":
            raise ValueError("--side-channel-curve-key is for P and D workers")
        from pd_fsm.io_trio.side_channel.curve import CurveKeys

        # Raises CurveError (a ValueError) naming the flag.
        curve = CurveKeys.load(args.side_channel_curve_key, args.side_channel_curve_peers)
    chat_template = None
    if args.chat_template is not None:
        # Imported here: jinja2 is not needed for `pd-fsm --help`.
        from pd_fsm.jax_engine.chat_template import read_chat_template

        chat_template = read_chat_template(args.chat_template)
    return ServeConfig(
        host=args.host,
        port=args.port,
        advertise_host=advertise,
        max_body=args.max_body,
        slo_ttft=args.slo_ttft,
        slo_itl=args.slo_itl,
        drain_timeout=args.drain_timeout,
        served_model_name=args.served_model_name,
        chat_template=chat_template,
        model=args.model,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        model_seed=args.model_seed,
        num_pages=args.num_pages,
        page_size=args.page_size,
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        context_length=args.context_length,
        random_seed=args.random_seed,
        tp_size=args.tp_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        radix_cache=not args.disable_radix_cache,
        decode_radix_cache=args.decode_radix_cache,
        max_queued=args.max_queued,
        disaggregation_mode=args.disaggregation_mode,
        disaggregation_transfer_backend=args.disaggregation_transfer_backend,
        disaggregation_bootstrap_host=args.disaggregation_bootstrap_host,
        disaggregation_bootstrap_port=args.disaggregation_bootstrap_port,
        disaggregation_bootstrap_heartbeat_interval=args.disaggregation_bootstrap_heartbeat_interval,
        disaggregation_bootstrap_heartbeat_ttl=args.disaggregation_bootstrap_heartbeat_ttl,
        disaggregation_failure_policy=args.disaggregation_failure_policy,
        disaggregation_queue_timeout=args.disaggregation_queue_timeout,
        disaggregation_side_channel_port=args.disaggregation_side_channel_port,
        disaggregation_instance_id=args.disaggregation_instance_id,
        disaggregation_prefill_port=args.disaggregation_prefill_port,
        **{name: getattr(args, name) for name in windows},
        cluster_secret_file=args.cluster_secret_file,
        tls=tls_from_args(args),
        side_channel_curve=curve,
        log_level=args.log_level,
        host_heap=args.host_heap,
        cpus=args.cpus,
        transfer_nice=args.transfer_nice,
        disaggregation_pull_workers=args.disaggregation_pull_workers,
        api_key=api_key_from_args(args),
        warmup=args.warmup,
        compilation_cache=not args.no_compilation_cache,
        compilation_cache_dir=args.compilation_cache_dir,
    )

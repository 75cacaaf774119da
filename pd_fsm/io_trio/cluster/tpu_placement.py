"""TPU chips per process: the chips of one TPU host a worker opens (``serve --tpu-chips``), as
libtpu is told before JAX starts.

One process at a time may hold a TPU chip: a second program that opens a chip another holds stops
with "Internal error when accessing libtpu multi-process lockfile" (seen on this project's one-chip
v5e machine, /work/.library/device/KINDS.md), and a process told nothing opens every chip of its
host. P and D on one host (RFC-2 §4.5: P on chips 0-3, D on 4-7 of a v6e-8) must each be told
their own chips, how those chips are arranged, that the process is a slice of its own, and a port
of its own for libtpu's runtime. These are environment variables libtpu reads when JAX first starts
its TPU backend, so the worker sets them first thing (``worker/cli.py``).

What is set for a part of the host (a "block", below), and where each comes from:

- ``TPU_VISIBLE_CHIPS``: the chips, by their index on the host (``/dev/accelN``); Ray sets it for
  an actor given ``TPU`` resources (``ray/_private/accelerators/tpu.py``,
  ``set_current_process_visible_accelerator_ids``), tpu-inference for each data-parallel rank
  (``tpu_inference/worker/tpu_worker.py``, ``_setup_dp_chip_isolation``). ``TPU_VISIBLE_DEVICES``
  is its older name (Skye Wanderman-Milne's gist of these variables, gist.github.com/skye/
  f82ba45d2445bb19d53545538754f9a3): set to the same value, so that an inherited one cannot
  contradict it.
- ``TPU_CHIPS_PER_PROCESS_BOUNDS``: the shape of those chips as x,y,z chip counts, and
  ``TPU_PROCESS_BOUNDS=1,1,1``: this process is the only one of its slice (the gist's
  "non-communicating processes"; tpu-inference likewise). Their older names
  ``TPU_CHIPS_PER_HOST_BOUNDS`` and ``TPU_HOST_BOUNDS`` are what Ray sets in its actors (for one
  or two chips): set to the same values, for the same reason.
- a port of its own: ``TPU_PROCESS_PORT`` with ``TPU_PROCESS_ADDRESSES=localhost:PORT`` and
  ``CLOUD_TPU_TASK_ID=0`` (tpu-inference: "unique libtpu port per rank so the runtimes can coexist
  on a host"; JAX's own multi-process test launcher, ``jax/_src/test_multiprocess.py``, sets the
  same three), and the gist's older ``TPU_MESH_CONTROLLER_ADDRESS`` / ``TPU_MESH_CONTROLLER_PORT``
  ("pick a unique port per process") to the same port. Default ``8476`` (libtpu's default port;
  torch_xla's ``configure_topology`` counts per-process ports up from it) plus the block's first
  chip: blocks never overlap, so two workers of one host never pick the same port.

Which chip sets are blocks: a host of 1, 4 or 8 chips; a block is 1, 2 or 4 consecutive chips
starting at a multiple of its size (a chip, a pair, a quad), or the whole host. Their shapes:

- 1 chip: ``1,1,1``; 2 chips (0-1, 2-3, 4-5, 6-7): ``1,2,1``; 4 chips (0-3, 4-7): ``2,2,1``.
  JAX's launcher (above) runs a 4-chip host as 4 x 1 chip (chips ``1,1,1``), 2 x 2 chips {0,1},
  {2,3} (``1,2,1``) or 1 x 4 (``2,2,1``), and a v6e-8 (2x4) as 2 x 4 chips {0-3}, {4-7} (each
  ``2,2,1``, the two quads stacked along y) or 1 x 8 (``2,4,1``); Ray gives one chip ``1,1,1`` and
  two ``1,2,1`` on any host; the gist runs a v4-8 (2x2x1) as 4 x 1 chip or 2 x 2 chips {0,1},
  {2,3} (``1,2,1``). tpu-inference gives a quad of a v6e-8 ``1,4,1`` instead; pd_fsm follows
  JAX's launcher, whose shape is the quad's (2x2) on the host's 2x4.
- the whole host: nothing is set and nothing inherited is removed, so that libtpu takes the host's
  own settings (its metadata, and whatever the machine's environment sets), which describe the
  whole host; Ray does the same for an actor holding every chip of its node. This is also what
  ``--tpu-chips 0`` is on a one-chip host (the project's v5e machine).

Hosts (chips, shape): v4-8 (4, 2x2x1: "v4-8" counts TensorCores, two per chip), v5e-1 / v6e-1
(1), v5e-4 / v6e-4 (4, 2x2), v5e-8 / v6e-8 (8, 2x4): Cloud TPU's v5e page lists the single-host
shapes 1x1, 2x2 and 2x4 (and says an 8-chip VM's chips 0-3 and 4-7 sit on two NUMA nodes), Ray
the same three for v5e and v6e (``TPU_SINGLE_HOST_TOPOLOGIES``). Each chip of these is one JAX
device (v4 fuses its two TensorCores into one, "megacore"; v5e and v6e have one: Ray's
``SINGLE_CORE_TPU_TYPES``), so a worker's ``--tp`` is its chip count.

The host is named with ``--tpu-host``, or found: GKE's ``TPU_ACCELERATOR_TYPE`` (Ray reads the
same variable), else Google's TPUs on the PCI bus (vendor ``0x1ae0``; device ``0x005e`` v4,
``0x0063`` v5e, ``0x006f`` v6e: torch_xla's ``torch_xla/_internal/tpu.py``), counted.

``--tpu-chips none``: no chip at all, ``JAX_PLATFORMS=cpu``, so that the process never opens one
(a helper beside a worker that holds the chip). Nothing here imports JAX: the flags read it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import attrs

from pd_fsm.io_trio.cluster.cpu_placement import cpu_list, parse_cpus

DEFAULT_TPU_PORT = 8476
NO_CHIP = "none"


@attrs.frozen
class TpuHost:
    name: str  # "v6e-8"
    chips: int
    topology: str  # Cloud TPU's name for the host's shape

    def __str__(self) -> str:
        return f"{self.name} ({self.chips} chip{'s' if self.chips > 1 else ''}, {self.topology})"


HOSTS: dict[str, TpuHost] = {h.name: h for h in (
    TpuHost("v4-8", 4, "2x2x1"),
    TpuHost("v5e-1", 1, "1x1"), TpuHost("v5e-4", 4, "2x2"), TpuHost("v5e-8", 8, "2x4"),
    TpuHost("v6e-1", 1, "1x1"), TpuHost("v6e-4", 4, "2x2"), TpuHost("v6e-8", 8, "2x4"),
)}
# Cloud TPU's accelerator types name v5e "v5litepod" (GKE's TPU_ACCELERATOR_TYPE too).
_ALIASES = {"v5litepod": "v5e"}

GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = {"0x005e": "v4", "0x0063": "v5e", "0x006f": "v6e"}

# A block's chip count -> its TPU_CHIPS_PER_PROCESS_BOUNDS (the whole host: nothing is set).
BLOCK_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}
ALONE = "1,1,1"  # TPU_PROCESS_BOUNDS: the process is a slice of its own

# Every variable a block sets, in the order /server_info shows them; JAX_PLATFORMS for "none".
TPU_VARIABLES = (
    "TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS", "TPU_PROCESS_PORT",
    "TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID", "TPU_MESH_CONTROLLER_ADDRESS",
    "TPU_MESH_CONTROLLER_PORT", "TPU_VISIBLE_DEVICES", "TPU_CHIPS_PER_HOST_BOUNDS",
    "TPU_HOST_BOUNDS",
)
REPORTED = (*TPU_VARIABLES, "JAX_PLATFORMS")


def host_named(name: str) -> TpuHost:
    """``v6e-8``, ``v5litepod-4``, ... -> its host; ValueError listing the supported ones."""
    generation, dash, size = name.strip().lower().partition("-")
    host = HOSTS.get(f"{_ALIASES.get(generation, generation)}{dash}{size}")
    if host is None:
        raise ValueError(f"--tpu-host {name!r}: not a TPU host pd_fsm knows the layout of "
                         f"(one host: {', '.join(HOSTS)}; v5litepod-N is v5e-N)")
    return host


def detect_host(environ: Mapping[str, str], sys_root: Path = Path("/sys")) -> TpuHost | None:
    """This host's type: GKE's ``TPU_ACCELERATOR_TYPE``, else its Google TPUs on the PCI bus
    (ValueError for a TPU host of a type pd_fsm has no layout for); None: no TPU found."""
    named = environ.get("TPU_ACCELERATOR_TYPE", "").strip()
    if named:
        return host_named(named)
    found: list[str] = []
    for vendor in sorted((sys_root / "bus" / "pci" / "devices").glob("*/vendor")):
        try:
            if vendor.read_text().strip() != GOOGLE_PCI_VENDOR:
                continue
            device = (vendor.parent / "device").read_text().strip()
        except OSError:
            continue
        if device in TPU_PCI_DEVICES:
            found.append(TPU_PCI_DEVICES[device])
    if not found:
        return None
    # A TPU VM's chips are all of one kind.
    if len(set(found)) > 1:
        raise ValueError(f"this host's PCI bus shows TPUs of several kinds ({sorted(set(found))})"
                         ": name the host with --tpu-host")
    generation, chips = found[0], len(found)
    # v4's accelerator types count TensorCores, two a chip.
    return host_named(f"{generation}-{2 * chips if generation == 'v4' else chips}")


def find_host(name: str | None, environ: Mapping[str, str],
              sys_root: Path = Path("/sys")) -> TpuHost:
    """``--tpu-host``'s host (None or ``auto``: this host's, found); ValueError when none."""
    if name is not None and name != "auto":
        return host_named(name)
    host = detect_host(environ, sys_root)
    if host is None:
        raise ValueError("no TPU found on this host (no TPU_ACCELERATOR_TYPE, no Google TPU on "
                         f"its PCI bus): name its type with --tpu-host ({', '.join(HOSTS)})")
    return host


def blocks(host: TpuHost) -> list[frozenset[int]]:
    """Every chip set of ``host`` a process may be given: its blocks, and the whole host."""
    out = [frozenset(range(start, start + size)) for size in BLOCK_BOUNDS if size < host.chips
           for start in range(0, host.chips, size)]
    return [*out, frozenset(range(host.chips))]


def chip_list(chips: frozenset[int]) -> str:
    """The chips as ``TPU_VISIBLE_CHIPS`` lists them: ``"0,1,2,3"``."""
    return cpu_list(chips)


def chip_runs(chips: frozenset[int]) -> str:
    """The chips for a message: ``"0-3"``, ``"0-1,4"``."""
    ordered, runs = sorted(chips), []
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            first, last = ordered[start], ordered[i - 1]
            runs.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ",".join(runs)


def check_block(host: TpuHost, chips: frozenset[int], flag: str = "--tpu-chips") -> None:
    """ValueError naming what is wrong with ``chips`` as one process's chips of ``host``."""
    stray = sorted(c for c in chips if c >= host.chips)
    if stray:
        raise ValueError(f"{flag} {chip_runs(chips)}: a {host} has chips 0-{host.chips - 1}, "
                         f"not {', '.join(map(str, stray))}")
    if chips not in blocks(host):
        listed = " ".join(chip_runs(b) for b in blocks(host))
        raise ValueError(
            f"{flag} {chip_runs(chips)} is not a sub-mesh of a {host}: a process takes 1, 2 or "
            f"4 consecutive chips starting at a multiple of that count, or the whole host "
            f"({listed})")


@attrs.frozen
class TpuPlacement:
    """One process's chips: ``chips`` of ``host`` (empty, ``host`` None: no chip at all)."""

    host: TpuHost | None
    chips: frozenset[int]
    port: int | None = None  # libtpu's port; None for the whole host and for no chip

    @property
    def whole_host(self) -> bool:
        return self.host is not None and len(self.chips) == self.host.chips

    def env(self) -> dict[str, str]:
        """The variables to set (none for the whole host: libtpu's own settings stand)."""
        if self.host is None:
            return {"JAX_PLATFORMS": "cpu"}
        if self.whole_host:
            return {}
        assert self.port is not None
        listed, bounds = chip_list(self.chips), BLOCK_BOUNDS[len(self.chips)]
        address = f"localhost:{self.port}"
        return {
            "TPU_VISIBLE_CHIPS": listed, "TPU_CHIPS_PER_PROCESS_BOUNDS": bounds,
            "TPU_PROCESS_BOUNDS": ALONE, "TPU_PROCESS_PORT": str(self.port),
            "TPU_PROCESS_ADDRESSES": address, "CLOUD_TPU_TASK_ID": "0",
            "TPU_MESH_CONTROLLER_ADDRESS": address, "TPU_MESH_CONTROLLER_PORT": str(self.port),
            "TPU_VISIBLE_DEVICES": listed, "TPU_CHIPS_PER_HOST_BOUNDS": bounds,
            "TPU_HOST_BOUNDS": ALONE,
        }

    def apply(self, environ: MutableMapping[str, str]) -> dict[str, str]:
        """Set this placement's variables in ``environ`` (before JAX starts); returns them."""
        env = self.env()
        environ.update(env)
        return env

    def describe(self) -> str:
        if self.host is None:
            return "no TPU chip (JAX_PLATFORMS=cpu)"
        if self.whole_host:
            return f"every chip of this {self.host}: libtpu's own settings"
        return (f"TPU chips {chip_runs(self.chips)} of this {self.host}, libtpu port "
                f"{self.port}")

    def report(self, environ: Mapping[str, str]) -> dict[str, Any]:
        """For ``/server_info``: what the worker was given, and the variables as the process
        has them now."""
        return {"host": None if self.host is None else self.host.name,
                "chips": sorted(self.chips), "port": self.port,
                "env": {name: environ.get(name) for name in REPORTED}}


def placement(chips: str, host: TpuHost | None, port: int | None = None,
              flag: str = "--tpu-chips") -> TpuPlacement:
    """``--tpu-chips`` (a chip list, or ``none``) on ``host``, checked; ``port``: libtpu's,
    default 8476 + the first chip. ``host`` may be None only for ``none``."""
    if chips.strip() == NO_CHIP:
        return TpuPlacement(None, frozenset())
    if host is None:
        raise ValueError(f"{flag} {chips} needs the TPU host's type (--tpu-host)")
    given = parse_cpus(chips, flag)
    check_block(host, given, flag)
    if len(given) == host.chips:
        return TpuPlacement(host, given)
    return TpuPlacement(host, given, DEFAULT_TPU_PORT + min(given) if port is None else port)


def no_tpu_report(environ: Mapping[str, str]) -> dict[str, Any]:
    """``/server_info``'s ``tpu`` for a worker given no ``--tpu-chips``: what it inherited."""
    return {"host": None, "chips": None, "port": None,
            "env": {name: environ.get(name) for name in REPORTED}}


def divide(host: TpuHost, chips: frozenset[int], n: int, flag: str) -> list[frozenset[int]]:
    """``chips`` shared by ``n`` workers of one role: ``n`` runs of consecutive chips, in
    order, each a block (ValueError otherwise)."""
    ordered = sorted(chips)
    if n < 1 or len(ordered) % n:
        raise ValueError(f"{flag} {chip_runs(chips)}: {len(ordered)} chips do not split evenly "
                         f"into {n} workers")
    size = len(ordered) // n
    parts = [frozenset(ordered[i * size:(i + 1) * size]) for i in range(n)]
    for part in parts:
        check_block(host, part, flag if n == 1 else f"{flag} (a worker's share)")
    return parts


def default_split(host: TpuHost, n_prefill: int, n_decode: int) -> dict[str, list[frozenset[int]]]:
    """P and D on one host, as RFC-2 §4.5 places them: P the first half of the chips, D the
    second, each half shared by its role's workers (a v6e-8: P 0-3, D 4-7)."""
    if host.chips < 2:
        raise ValueError(f"a {host} cannot hold both P and D: give --prefill-chips and "
                         f"--decode-chips ({NO_CHIP} for a role on the CPU)")
    half = host.chips // 2
    return {"prefill": divide(host, frozenset(range(half)), n_prefill, "--prefill-chips"),
            "decode": divide(host, frozenset(range(half, host.chips)), n_decode,
                             "--decode-chips")}


def check_disjoint(workers: Mapping[str, frozenset[int]]) -> None:
    """ValueError naming two workers given the same chip (one chip, one process)."""
    owner: dict[int, str] = {}
    for name, chips in workers.items():
        for chip in sorted(chips):
            if chip in owner:
                raise ValueError(f"chip {chip} is given to both {owner[chip]} and {name}: a chip "
                                 "is one process's")
            owner[chip] = name

"""`pd-fsm cluster` on TPU hosts: which chips each P, D and colocated worker opens.

The local runner (one host): ``--prefill-chips`` / ``--decode-chips`` / ``--colocated-chips``
give each role's chips, shared in order by the role's workers (``--prefill 2 --prefill-chips
0-3``: 0-1 and 2-3); with neither of P's and D's given, on a TPU host (found, or named by
``--tpu-host``), P takes the first half of the chips and D the second (RFC-2 §4.5: a v6e-8's 0-3
and 4-7). Each worker gets ``serve --tpu-chips`` (and ``--tp``, its chip count, unless the role's
``--ROLE-tp`` says it, which must then agree); serve sets libtpu's variables itself
(``tpu_placement``). A split that does not fit the host is refused before anything starts. On a
host with no TPU and no chips given nothing changes.

On Ray (``--ray``) the chips are Ray's to assign: each P, D (and colocated) actor asks for Ray's
``TPU`` resource, ``--ROLE-tpu N`` chips, by default its share of its node's (the node's ``TPU``
count shared by the workers placed on it: all of it for a worker alone, half each for a P and a D,
in a block size libtpu takes), and none on a node without ``TPU``. Inside the actor the chips Ray
gave it are checked and libtpu's variables set (``ray_cluster.ServiceActor``); its worker gets
``--tpu-chips`` with them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from pd_fsm.io_trio.cluster.cpu_placement import parse_cpus
from pd_fsm.io_trio.cluster.tpu_placement import (
    BLOCK_BOUNDS,
    HOSTS,
    NO_CHIP,
    TpuHost,
    check_disjoint,
    chip_list,
    chip_runs,
    default_split,
    detect_host,
    divide,
    find_host,
    host_named,
)

ROLES = ("prefill", "decode", "colocated")
# Ray's TPU resource requests it accepts (ray/_private/accelerators/tpu.py,
# TPU_VALID_CHIP_OPTIONS): a block, or a whole 8-chip host.
RAY_TPU_COUNTS = (*BLOCK_BOUNDS, 8)


def add_tpu_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "TPU chips (docs/tpu_hosts.md): the local runner's one host, or each Ray node's")
    group.add_argument("--tpu-host", default=None, metavar="TYPE",
                       help=f"the TPU host's type ({', '.join(HOSTS)}); default (auto): found "
                            "on the host (GKE's TPU_ACCELERATOR_TYPE, else the PCI bus); passed "
                            "to every worker (`serve --tpu-host`)")
    for role in ROLES:
        group.add_argument(f"--{role}-chips", default=None, metavar="LIST|none",
                           help=f"the chips of this host the {role} workers open, shared in "
                                "order (`serve --tpu-chips` each; none: on the CPU)"
                                + ("; default on a TPU host: P the first half, D the second"
                                   if role != "colocated" else ""))
        group.add_argument(f"--{role}-tpu", type=int, default=None, metavar="N",
                           help=f"--ray: the TPU chips each {role} actor asks Ray for (0: none; "
                                "default: its share of its node's TPU resource)")


@attrs.frozen
class ChipPlan:
    """Each worker's chips (None: no chip, on the CPU), by role, in start order."""

    host: TpuHost
    workers: dict[str, list[frozenset[int] | None]]

    def describe(self) -> str:
        """For the runner's log: each role's chips."""
        def shown(chips: frozenset[int] | None) -> str:
            return NO_CHIP if chips is None else chip_runs(chips)

        roles = "; ".join(f"{role} {' / '.join(map(shown, chips))}"
                          for role, chips in self.workers.items())
        return f"TPU chips of this {self.host}: {roles}"

    def flags(self, args: argparse.Namespace, role: str, name: str) -> list[str]:
        """``serve``'s flags for worker ``name`` (``prefill-1``, ``colocated``) of ``role``."""
        shares = self.workers.get(role)
        if not shares:
            return []
        chips = shares[int(name.rsplit("-", 1)[1]) if role != "colocated" else 0]
        if chips is None:
            return ["--tpu-chips", NO_CHIP]
        tp = [] if getattr(args, f"{role}_tp", None) else ["--tp", str(len(chips))]
        return ["--tpu-chips", chip_list(chips), "--tpu-host", self.host.name, *tp]


def _counts(args: argparse.Namespace) -> dict[str, int]:
    return {"prefill": getattr(args, "prefill", 0), "decode": getattr(args, "decode", 0),
            "colocated": 1 if getattr(args, "colocated", False) else 0}


def chip_plan(args: argparse.Namespace, environ: Mapping[str, str] = os.environ,
              sys_root: Path = Path("/sys")) -> ChipPlan | None:
    """The local runner's chips for every worker; None on a host with no TPU where no chips are
    given. ValueError for a split that does not fit."""
    given = {role: getattr(args, f"{role}_chips", None) for role in ROLES}
    named = getattr(args, "tpu_host", None)
    host = host_named(named) if named not in (None, "auto") else detect_host(environ, sys_root)
    if host is None:
        if any(v is not None for v in given.values()):
            find_host(None, environ, sys_root)  # raises, naming --tpu-host
        return None
    counts = _counts(args)
    if sum(counts.values()) == 1 and not any(v is not None for v in given.values()):
        return None  # one worker alone on the host: every chip is its own (libtpu's default)
    _check_instances(args, host, counts)
    split: dict[str, list[frozenset[int]]] = {}
    if counts["prefill"] and counts["decode"]:
        if given["prefill"] is None and given["decode"] is None:
            split = default_split(host, counts["prefill"], counts["decode"])
        elif given["prefill"] is None or given["decode"] is None:
            raise ValueError("give both --prefill-chips and --decode-chips, or neither (the "
                             f"default split of this {host}: P the first half, D the second)")
    shares: dict[str, list[frozenset[int] | None]] = {}
    for role, n in counts.items():
        if n:
            shares[role] = _shares(host, role, n, given[role], split.get(role))
    check_disjoint({f"{role}-{i}": part for role, parts in shares.items()
                    for i, part in enumerate(parts) if part is not None})
    for role, parts in shares.items():
        tp = getattr(args, f"{role}_tp", None)
        sizes = {len(part) for part in parts if part is not None}
        if tp is not None and sizes and sizes != {tp}:
            raise ValueError(f"--{role}-tp {tp} does not match the {sizes.pop()} chip(s) each "
                             f"{role} worker opens (one device each): leave --{role}-tp out")
    return ChipPlan(host, shares)


def _check_instances(args: argparse.Namespace, host: TpuHost, counts: Mapping[str, int]) -> None:
    if any(getattr(args, f"{role}_nnodes", 1) > 1 for role in ROLES if counts[role]):
        raise ValueError(f"--ROLE-nnodes on one TPU host ({host}): the ranks of an instance "
                         "would need chips of their own, which is not built; give each rank a "
                         "host of its own (see docs/tpu_hosts.md)")
    if getattr(args, "max_workers", 0):
        raise ValueError(f"--max-workers on a TPU host ({host}): the launcher does not give the "
                         "workers it adds chips of their own")


def _shares(host: TpuHost, role: str, n: int, spec: str | None,
            split: list[frozenset[int]] | None) -> list[frozenset[int] | None]:
    flag = f"--{role}-chips"
    if spec is None:
        if split is None:
            raise ValueError(f"{flag}: beside other workers on this {host} a {role} worker needs "
                             f"chips of its own (or {NO_CHIP}: on the CPU)")
        return list(split)
    if spec.strip() == NO_CHIP:
        return [None] * n
    return list(divide(host, parse_cpus(spec, flag), n, flag))


def tpu_refusal(args: argparse.Namespace) -> str | None:
    """What makes the TPU flags impossible (the local runner's split, or Ray's counts)."""
    if args.ray is not None:
        given = [f"--{role}-chips" for role in ROLES if getattr(args, f"{role}_chips")]
        if given:
            return (f"{', '.join(given)}: on Ray the chips are Ray's to assign: ask for a count "
                    "with --prefill-tpu / --decode-tpu / --colocated-tpu")
        for role in ROLES:
            n = getattr(args, f"{role}_tpu")
            if n is not None and n not in (0, *RAY_TPU_COUNTS):
                return (f"--{role}-tpu {n}: Ray gives 1, 2, 4 or 8 TPU chips, or none (0)")
        return None
    if any(getattr(args, f"{role}_tpu") is not None for role in ROLES):
        return "--prefill-tpu / --decode-tpu / --colocated-tpu are for --ray"
    try:
        chip_plan(args)
    except ValueError as exc:
        return str(exc)
    return None


# ------------------------------------------------------------------------------------ Ray


def ray_tpu_requests(args: argparse.Namespace, specs: Mapping[str, Sequence[str]],
                     nodes: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The TPU chips each P, D and colocated actor asks Ray for: ``--ROLE-tpu``, else its share
    of its node's ``TPU`` resource (``specs``: each role's node specs, worker i on the i-th,
    round robin; ``nodes``: ``ray.nodes()``'s live ones). ValueError where a node's chips do not
    go round."""
    counts = _counts(args)
    workers = [(role, _node_of(specs[role][i % len(specs[role])], nodes))
               for role, n in counts.items() for i in range(n)]
    on_node: dict[str, int] = {}
    for _, (key, _) in workers:
        on_node[key] = on_node.get(key, 0) + 1
    out: dict[str, int] = {}
    for role in ROLES:
        explicit = getattr(args, f"{role}_tpu", None)
        if explicit is not None or not counts[role]:
            out[role] = explicit or 0
            continue
        shares = [_share(key, chips, on_node[key]) for r, (key, chips) in workers if r == role]
        out[role] = min(shares)
    return out


def _node_of(spec: str, nodes: Sequence[Mapping[str, Any]]) -> tuple[str, int]:
    """A placement spec's node (its IP, or the spec where several nodes may take it) and its
    TPU chips (the fewest of the nodes it may go to)."""
    if spec.startswith("resource:"):
        name = spec.split(":", 1)[1]
        holding = [n for n in nodes if n["Resources"].get(name)]
    else:
        holding = [n for n in nodes if n["NodeManagerAddress"] == spec]
    chips = min((int(n["Resources"].get("TPU", 0)) for n in holding), default=0)
    key = holding[0]["NodeManagerAddress"] if len(holding) == 1 else spec
    return key, chips


def _share(node: str, chips: int, workers: int) -> int:
    if not chips:
        return 0
    if workers == 1:
        return chips  # alone on its node: every chip
    fair = chips // workers
    fitting = [size for size in BLOCK_BOUNDS if size <= fair]
    if not fitting:
        raise ValueError(f"node {node} has {chips} TPU chip(s) for {workers} workers: give "
                         "--prefill-tpu / --decode-tpu / --colocated-tpu (0: none)")
    return max(fitting)

"""What a step and a KV move cost on an accelerator instance of ``tp`` chips, from a profile of
one chip (``perf_profile.Profile`` with ``platform`` ``tpu``: prefill by prompt tokens, decode
by rows and context, the KV legs by bytes), for the fleet model (``fleet.py``).

Measured (the profile, one chip): a prefill of one prompt, a decode step by rows and context,
the KV legs of one room (``gather`` on the chip, ``d2h`` chip to host, ``h2d`` host to chip,
``scatter`` into D's pool). Everything else here is a parameter, none of it measured on the
chip this project has (one v5e chip):

- **Tensor parallelism** over ``tp`` chips of one host: a step's time on one chip, less a fixed
  part that does not shrink (``ChipModel.step_fixed_s``: dispatch and the per-layer kernel
  launches), is divided by ``tp`` (each chip reads ``1/tp`` of the weights and of the KV heads
  and does ``1/tp`` of the FLOPs), plus two all-reduces per layer of the step's activations
  (``tokens x hidden x 2`` bytes) over the host's ICI as a ring: ``latency + 2 (tp-1)/tp x
  bytes / bandwidth`` each (``HostKind.ici_gbps``, ``ici_latency_s``). An instance of ``tp``
  chips holds ``tp`` chips' HBM less one copy of the weights for its KV.
- **Another chip kind** (``v6e-8``): the v5e profile's prefill scaled by the published bf16
  FLOP/s ratio and its decode and legs on the chip by the HBM-bandwidth ratio.
- **The KV path** P -> D (``Links``): ``host`` (pd_fsm's path today: P's chips to P's host,
  the network between hosts, D's host to D's chips; each TP chip moves its ``1/tp`` of the
  bytes at once) or ``ici`` (chip to chip within a host at the ICI bandwidth: not built in
  pd_fsm, a what-if). The three stages of ``host`` are a pipeline (``fleet.py``): each stage
  takes one transfer at a time.
"""

from __future__ import annotations

import attrs

from pd_fsm.sim.perf_profile import CoreProfile, Profile


@attrs.frozen
class HostKind:
    """A host of ``chips`` accelerators joined by ICI. The figures are published ones or
    assumed (see ``HOSTS``); only the profile's chip is measured."""

    name: str
    chips: int
    hbm_bytes: float  # per chip
    ici_gbps: float  # GB/s a ring all-reduce moves per chip (assumed: see HOSTS)
    ici_latency_s: float  # per all-reduce (assumed)
    flops_scale: float = 1.0  # this chip's bf16 FLOP/s over the profile's chip's
    hbm_scale: float = 1.0  # this chip's HBM bandwidth over the profile's chip's


# v5e: 16 GB HBM at 819 GB/s, 197 TFLOP/s bf16, ICI 1,600 Gbit/s a chip (published). v6e:
# 32 GB at 1,640 GB/s, 918 TFLOP/s, ICI 3,584 Gbit/s (published). The all-reduce bandwidth is
# taken as half the published ICI figure (a ring uses one direction of two links), its latency
# 10 us: both assumed, neither measured here.
HOSTS = {
    "v5e-8": HostKind("v5e-8", 8, 16e9, 100.0, 10e-6),
    "v6e-8": HostKind("v6e-8", 8, 32e9, 224.0, 10e-6, flops_scale=918 / 197,
                      hbm_scale=1640 / 819),
}


@attrs.frozen
class ChipModel:
    """What tensor parallelism's cost needs of the model beyond the profile: its layers and
    hidden size (the all-reduces' bytes), its weights' bytes (HBM left for KV). Defaults: the
    Qwen3-0.6B shape the TPU profile runs (bf16)."""

    layers: int = 28
    hidden: int = 1024
    weight_bytes: float = 1.19e9
    # The part of a step that does not shrink with tp: the one-row decode step's time on the
    # chip over its HBM floor (1.70 vs 1.53 ms, bench/RESULTS_tpu.md).
    step_fixed_s: float = 0.17e-3
    hbm_usable: float = 0.9  # of each chip's HBM, for weights and KV (the rest: activations)
    # A pool an instance was given (``--num-pages`` x ``--page-size``), in tokens, in place of
    # the HBM left after the weights: 0 for the latter.
    pool_tokens: int = 0


@attrs.frozen
class Links:
    """The KV path between a P and a D instance."""

    path: str = "host"  # "host" (d2h, network, h2d) or "ici" (chip to chip, one host)
    net_gbps: float = 5.0  # GB/s of one P instance's transfers over the network
    net_latency_s: float = 200e-6  # per transfer
    d2h_leg: str = "d2h"  # the profile's leg off the chip: "d2h" or "d2h_pinned"
    # GB/s off the chip in place of the profile's leg (0: the leg): the leg is noisy between
    # runs on the chip, so a plan can be read at the range measured.
    d2h_gbps: float = 0.0


class ChipCosts:
    """Seconds of each step and KV stage for an instance of ``tp`` chips (module docstring)."""

    def __init__(self, profile: Profile, host: HostKind, shape: ChipModel | None = None,
                 links: Links | None = None, mixed_extra: float = 0.0) -> None:
        self.profile, self.host = profile, host
        # A mixed step (decode rows and a prefill chunk in one program) costs its two parts
        # and this share of their sum more. 0 by default; the one mixed step measured on the
        # chip (64 rows x 2,048 + a 512-token chunk, 75.2 ms, bench/RESULTS_tpu.md run 1)
        # against its parts (41.98 ms + 7.5 ms) gives 0.52.
        self.mixed_extra = mixed_extra
        self.shape = shape or ChipModel()
        self.links = links or Links()
        if self.links.path not in ("host", "ici"):
            raise ValueError(f"KV path {self.links.path!r}: host or ici")
        self.chip: CoreProfile = profile.on(1)
        self.kv_per_token = profile.kv_bytes_per_token

    # -- tensor parallelism ----------------------------------------------------------------

    def all_reduce_s(self, tokens: int, tp: int) -> float:
        """The step's all-reduces: two a layer of ``tokens x hidden`` bf16 over the ICI ring."""
        if tp <= 1:
            return 0.0
        one = tokens * self.shape.hidden * 2 * 2 * (tp - 1) / tp / (self.host.ici_gbps * 1e9)
        return 2 * self.shape.layers * (self.host.ici_latency_s + one)

    def _split(self, one_chip_s: float, tp: int) -> float:
        fixed = min(self.shape.step_fixed_s, one_chip_s)
        return fixed + (one_chip_s - fixed) / tp

    def _prefill_one(self, tokens: int) -> float:
        return self.chip.prefill_s(tokens) / self.host.flops_scale

    def prefill_s(self, start: int, tokens: int, tp: int) -> float:
        """A chunk of ``tokens`` prompt tokens after ``start`` already in the pool: the whole
        prompt's prefill to its end less to its start (its attention over what came before
        included), at least a prefill of the chunk alone."""
        one = self._prefill_one(tokens)
        if start:
            one = max(one, self._prefill_one(start + tokens) - self._prefill_one(start))
        return self._split(one, tp) + self.all_reduce_s(tokens, tp)

    def decode_s(self, rows: int, context: float, tp: int) -> float:
        one = self.chip.decode_s(rows, context) / self.host.hbm_scale
        return self._split(one, tp) + self.all_reduce_s(rows, tp)

    def kv_capacity_tokens(self, tp: int) -> int:
        """Tokens of KV an instance of ``tp`` chips holds: their HBM less one copy of the
        weights (sharded over them)."""
        if self.shape.pool_tokens:
            return self.shape.pool_tokens
        free = tp * self.host.hbm_bytes * self.shape.hbm_usable - self.shape.weight_bytes
        return max(int(free // self.kv_per_token), 0)

    # -- the KV legs ------------------------------------------------------------------------

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_per_token

    def _leg(self, name: str, n_bytes: float) -> float:
        return self.chip.leg_s(name, int(n_bytes)) / (
            self.host.hbm_scale if name in ("gather", "scatter") else 1.0)

    def gather_s(self, tokens: int, tp: int) -> float:
        """P's gather of a room (or a chunk) on its chips: each its ``1/tp`` of the bytes."""
        return self._leg("gather", self.kv_bytes(tokens) / tp)

    def scatter_s(self, tokens: int, tp: int) -> float:
        return self._leg("scatter", self.kv_bytes(tokens) / tp)

    def stages_s(self, tokens: int, tp_p: int, tp_d: int) -> tuple[float, float, float]:
        """The three stages of moving ``tokens``' KV from P to D: off P's chips, across the
        link, onto D's chips (the ``ici`` path: the whole move in the middle stage)."""
        n = self.kv_bytes(tokens)
        links = self.links
        if links.path == "ici":
            wide = min(tp_p, tp_d)
            return 0.0, self.host.ici_latency_s + n / wide / (self.host.ici_gbps * 1e9), 0.0
        off = (n / tp_p / (links.d2h_gbps * 1e9) if links.d2h_gbps
               else self._leg(links.d2h_leg, n / tp_p))
        return (off, links.net_latency_s + n / (
            links.net_gbps * 1e9), self._leg("h2d", n / tp_d))

    def transfer_s(self, tokens: int, tp_p: int, tp_d: int) -> float:
        """One room's move, whole, after its prefill (not streamed)."""
        return sum(self.stages_s(tokens, tp_p, tp_d))

"""The KV path's legs for one room, timed on this backend with only the KV pool (no weights):

- ``gather:<method>``: P's gather of the room's pages from the pool into one packed array
  (``kv.room.gather_room``), for each method the backend has (``xla``, ``take``, ``pallas``);
- ``d2h``: the packed room, one array, device -> numpy (what a sender reading it whole pays);
- ``d2h_layers``: the room as one array per layer (each layer's pages taken from the pool),
  ``copy_to_host_async`` on all of them first, then each read into numpy. P's sender today hands
  the packed array to ``jax.experimental.transfer``, which reads it off the device itself (over
  TCP only); this is how a sender of pd_fsm's own would read a room (shared/TPU.md: the faster);
- ``d2h_pinned``: the packed room device -> ``pinned_host`` memory (``jax.device_put`` with that
  memory kind: RFC-2 §5.5's mode B), where the device has that memory;
- ``h2d``: numpy -> device, and ``h2d_pinned``: ``pinned_host`` -> device;
- ``scatter:<method>``: D's scatter of a room into other pages of the pool
  (``kv.room.scatter_room``), for each method (``xla``, ``pallas``).

Each leg's time is the best of ``repeats`` runs, each on arrays made fresh for it (a JAX array
read once keeps its host copy, so reading it again "measures" a memory copy); each leg's bytes
are checked equal to the room's once (``BytesDiffer`` otherwise). Rates are the room's bytes
over the seconds, beside the chip's HBM rate where the device kind is known.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from pd_fsm.jax_engine import backend
from pd_fsm.jax_engine.kv.gather_scatter import GatherMethod, ScatterMethod, page_bucket
from pd_fsm.jax_engine.kv.holder import KVCacheHolder
from pd_fsm.jax_engine.kv.pool import KVPoolConfig
from pd_fsm.jax_engine.kv.pool_spec import KVArgs, PoolTransferSpec, PoolType
from pd_fsm.jax_engine.kv.room import gather_room, scatter_room
from pd_fsm.jax_engine.kv.tiered import TIER_COUNTS
from pd_fsm.jax_engine.model.config import SMOLLM2_135M, TINY, ModelConfig
from pd_fsm.jax_engine.model.dummy import SHAPE_NAMES, shape_config

MAIN_KV = PoolType.MAIN_KV.value
GATHER_METHODS: tuple[GatherMethod, ...] = ("xla", "take", "pallas")
SCATTER_METHODS: tuple[ScatterMethod, ...] = ("xla", "pallas")
# Published HBM bandwidth by JAX's device kind, GB/s (the reference line: a room read once).
HBM_GBPS = {"TPU v4": 1200.0, "TPU v5 lite": 819.0, "TPU v5e": 819.0, "TPU v5p": 2765.0,
            "TPU v6 lite": 1640.0, "TPU v6e": 1640.0}
# How long the XLA tiers may take to compile their run loop in the background (kv/tiered.py)
# before the quick tier's time is what is reported (``room_legs``' ``tier_wait_s``).
TIER_WAIT_S = 60.0


class BytesDiffer(AssertionError):
    """A leg's bytes differ from the room's: the copy is wrong, and its time means nothing."""


@attrs.frozen
class Leg:
    """One leg of one room: ``seconds`` the best run (None: not run, ``note`` says why)."""

    name: str
    tokens: int
    nbytes: int
    seconds: float | None
    note: str = ""

    @property
    def gbps(self) -> float | None:
        return None if not self.seconds else self.nbytes / self.seconds / 1e9


@attrs.frozen
class LegSpec:
    """How to time one leg: ``fresh()`` makes its input (untimed), ``run(input)`` is the leg
    (timed, until its output is ready), ``read(output)`` the output's bytes as numpy."""

    name: str
    fresh: Callable[[], Any]
    run: Callable[[Any], Any]
    read: Callable[[Any], np.ndarray]


def model_config(name: str) -> ModelConfig:
    """A model's config by name: a published shape, ``smollm2`` or ``tiny``."""
    if name in SHAPE_NAMES:
        return shape_config(name)[0]
    known = {"smollm2": SMOLLM2_135M, "tiny": TINY}
    if name not in known:
        raise ValueError(f"no model shape {name!r}: known {', '.join([*SHAPE_NAMES, *known])}")
    return known[name]


def same_bytes(got: np.ndarray, want: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(got), np.ascontiguousarray(want)
    return a.nbytes == b.nbytes and bool(np.array_equal(a.view(np.uint8).ravel(),
                                                        b.view(np.uint8).ravel()))


def time_leg(spec: LegSpec, want: np.ndarray, repeats: int) -> float:
    """The best of ``repeats`` timed runs of ``spec`` after one unmeasured (its compile), each on
    a fresh input; the first run's bytes checked against ``want``."""
    out = spec.run(spec.fresh())
    if not same_bytes(spec.read(out), want):
        raise BytesDiffer(f"{spec.name}: the bytes it produced differ from the room's")
    del out
    best = float("inf")
    for _ in range(repeats):
        source = spec.fresh()
        if isinstance(source, jax.Array):
            source.block_until_ready()
        elif isinstance(source, list):
            _ready(source)
        start = time.perf_counter()
        out = spec.run(source)
        best = min(best, time.perf_counter() - start)
        del out, source
    return best


def pinned_host_supported(device: jax.Device) -> bool:
    return "pinned_host" in {m.kind for m in device.addressable_memories()}


def _random_pool(cfg: KVPoolConfig, seed: int) -> list[jax.Array]:
    """The pool's layers filled with random values (so a wrong page shows in the bytes check):
    random bits where the pool stores integers, normal floats (no NaN, whose bits a copy may
    canonicalise) where it stores floats; on the first device, as ``allocate_kv_pool``'s."""
    dtype = jnp.dtype(cfg.storage_dtype)

    @functools.partial(jax.jit, out_shardings=jax.sharding.SingleDeviceSharding(
        jax.devices()[0]))
    def fill(key: jax.Array) -> jax.Array:
        if jnp.issubdtype(dtype, jnp.integer):
            return jax.random.bits(key, cfg.layer_shape, dtype)
        return jax.random.normal(key, cfg.layer_shape, jnp.float32).astype(dtype)

    keys = jax.random.split(jax.random.key(seed), cfg.num_layers)
    return [fill(keys[i]) for i in range(cfg.num_layers)]


class LegRoom:
    """One room of ``tokens`` tokens in a pool of twice its pages (its own, then the pages D's
    scatter writes), in this backend's layout and storage dtype."""

    def __init__(self, config: ModelConfig, tokens: int, *, kv_dtype: str | None,
                 page_size: int = 16, seed: int = 0) -> None:
        be = backend.current()
        self.tokens, self.n = tokens, -(-tokens // page_size)
        self.pool_config = attrs.evolve(
            config.kv_pool_config(2 * self.n + 1, page_size, kv_dtype), lanes=be.kv_lanes,
            bf16_bits=be.bf16_bits)
        self.kv_args = KVArgs([PoolTransferSpec.from_config(MAIN_KV, self.pool_config)])
        self.holder = KVCacheHolder({MAIN_KV: _random_pool(self.pool_config, seed)})
        self.src = list(range(1, self.n + 1))
        self.dst = list(range(self.n + 1, 2 * self.n + 1))
        self.device = jax.devices()[0]
        self.want = np.asarray(self.gather("take"))[:, : self.n]  # the room's bytes
        self.nbytes = int(self.want.nbytes)

    def gather(self, method: GatherMethod) -> jax.Array:
        (packed,) = gather_room(self.holder, self.kv_args, self.src, method=method)
        return packed.block_until_ready()

    def layers(self) -> list[jax.Array]:
        """The room as one array per layer, fresh."""
        ids = jnp.asarray(self.src, jnp.int32)
        with self.holder.locked() as kv:
            out = [jnp.take(layer, ids, axis=0) for layer in kv[MAIN_KV]]
        return _ready(out)

    def scattered(self) -> np.ndarray:
        """What the scatter's destination pages hold."""
        (packed,) = gather_room(self.holder, self.kv_args, self.dst, method="take")
        return np.asarray(packed)[:, : self.n]


def _ready(arrays: list[jax.Array]) -> list[jax.Array]:
    for a in arrays:
        a.block_until_ready()
    return arrays


def _gather(room: LegRoom, method: GatherMethod, _: object) -> jax.Array:
    return room.gather(method)


def _scatter(room: LegRoom, method: ScatterMethod, packed: jax.Array) -> None:
    scatter_room(room.holder, room.kv_args, [packed], room.dst, method=method)


def _d2h_layers(arrays: Sequence[jax.Array]) -> list[np.ndarray]:
    for a in arrays:
        a.copy_to_host_async()
    return [np.asarray(a) for a in arrays]


def _sharding(device: jax.Device, kind: str) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device, memory_kind=kind)


def _specs(room: LegRoom, gathers: Sequence[GatherMethod], scatters: Sequence[ScatterMethod]
           ) -> list[LegSpec]:
    """The legs of ``room`` (module docstring), in the order a room travels."""
    n, dev = room.n, room.device
    bucketed = page_bucket(n)

    def cut(x: Any) -> np.ndarray:
        return np.asarray(x)[:, :n] if bucketed != n else np.asarray(x)

    specs = [LegSpec(f"gather:{m}", lambda: None, functools.partial(_gather, room, m), cut)
             for m in gathers]
    specs.append(LegSpec("d2h", lambda: room.gather("take"), np.asarray, cut))
    specs.append(LegSpec("d2h_layers", room.layers, _d2h_layers,
                         lambda arrays: np.stack(arrays)))
    if pinned_host_supported(dev):
        pinned = _sharding(dev, "pinned_host")
        specs.append(LegSpec("d2h_pinned", lambda: room.gather("take"), lambda x: jax.device_put(
            x, pinned).block_until_ready(), cut))
    host = np.ascontiguousarray(room.want)
    device = _sharding(dev, "device")
    specs.append(LegSpec("h2d", lambda: host, lambda x: jax.device_put(
        x, device).block_until_ready(), np.asarray))
    if pinned_host_supported(dev):
        staged = jax.device_put(host, _sharding(dev, "pinned_host")).block_until_ready()
        specs.append(LegSpec("h2d_pinned", lambda: staged, lambda x: jax.device_put(
            x, device).block_until_ready(), np.asarray))
    for m in scatters:
        specs.append(LegSpec(f"scatter:{m}", lambda: room.gather("take"),
                             functools.partial(_scatter, room, m), lambda _: room.scattered()))
    return specs


def _settle_tier(spec: LegSpec, wait_s: float) -> str:
    """For an XLA-tier leg, run it until the run loop serves it (it compiles in the background:
    kv/tiered.py), at most ``wait_s``; which tier its time is then of."""
    what = spec.name.split(":")[0]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        before = TIER_COUNTS[f"{what}_runs"]
        spec.run(spec.fresh())
        if TIER_COUNTS[f"{what}_runs"] > before:
            return "the run loop"
        time.sleep(0.2)
    return f"the quick tier (the run loop did not compile within {wait_s:.0f} s)"


def room_legs(config: ModelConfig, tokens: int, *, kv_dtype: str | None, repeats: int,
              gathers: Sequence[GatherMethod] | None = None,
              scatters: Sequence[ScatterMethod] | None = None,
              tier_wait_s: float = TIER_WAIT_S) -> list[Leg]:
    """Every leg of one room of ``tokens`` tokens at ``config``'s KV shape (module docstring).
    ``gathers`` / ``scatters``: the methods to time (default: all where the backend compiles
    Pallas, the XLA ones where it would only interpret it)."""
    be = backend.current()
    if gathers is None:
        gathers = [m for m in GATHER_METHODS if m != "pallas" or not be.pallas_interpret]
    if scatters is None:
        scatters = [m for m in SCATTER_METHODS if m != "pallas" or not be.pallas_interpret]
    room = LegRoom(config, tokens, kv_dtype=kv_dtype)
    legs: list[Leg] = []
    for spec in _specs(room, gathers, scatters):
        note = _settle_tier(spec, tier_wait_s) if spec.name in ("gather:xla", "scatter:xla") else ""
        seconds = time_leg(spec, room.want, repeats)
        legs.append(Leg(spec.name, tokens, room.nbytes, seconds, note))
    if not pinned_host_supported(room.device):
        legs += [Leg(name, tokens, room.nbytes, None, "no pinned_host memory on "
                     f"{room.device.device_kind}") for name in ("d2h_pinned", "h2d_pinned")]
    return legs  # the room's pool goes with it


def reference_gbps(device_kind: str) -> float | None:
    """The device's published HBM rate, GB/s (None where not known: a CPU)."""
    return HBM_GBPS.get(device_kind)


def table(legs: Sequence[Leg], hbm_gbps: float | None) -> list[str]:
    """The legs as text lines: one per leg and room, its time and rate, and the HBM line."""
    lines = [f"{'leg':<16} {'tokens':>7} {'MB':>9} {'ms':>10} {'GB/s':>8}  note"]
    for leg in legs:
        ms = "-" if leg.seconds is None else f"{leg.seconds * 1e3:.3f}"
        rate = "-" if leg.gbps is None else f"{leg.gbps:.2f}"
        lines.append(f"{leg.name:<16} {leg.tokens:>7} {leg.nbytes / 1e6:>9.2f} {ms:>10} "
                     f"{rate:>8}  {leg.note}")
    if hbm_gbps is not None:
        rooms = sorted({(leg.tokens, leg.nbytes) for leg in legs})
        lines.append(f"{'HBM (published)':<16} {'':>7} {'':>9} {'':>10} {hbm_gbps:>8.2f}  a room "
                     "read once: " + ", ".join(f"{t} tokens {b / hbm_gbps / 1e6:.3f} ms"
                                               for t, b in rooms))
    else:
        lines.append("HBM reference: none (no published rate for this device)")
    return lines


def schema_legs(legs: Sequence[Leg], gather: str, scatter: str
                ) -> dict[str, tuple[tuple[int, float], ...]]:
    """The legs as the profile holds them (``perf_profile.LEGS``), by bytes: ``gather`` and
    ``scatter`` the methods the backend runs, ``d2h`` the faster of the two ways measured."""
    def points(*names: str) -> tuple[tuple[int, float], ...]:
        best: dict[int, float] = {}
        for leg in legs:
            if leg.name in names and leg.seconds is not None:
                best[leg.nbytes] = min(best.get(leg.nbytes, leg.seconds), leg.seconds)
        return tuple(sorted(best.items()))

    return {"gather": points(f"gather:{gather}"), "d2h": points("d2h", "d2h_layers"),
            "d2h_pinned": points("d2h_pinned"), "h2d": points("h2d"),
            "scatter": points(f"scatter:{scatter}")}

"""Gather (paged pool -> packed) and scatter (packed -> paged pool) of a request's KV pages.

Wire format. One pool's KV for one request is ONE array ``packed[layer, i] == kv[layer][pages[i]]``
of shape ``(num_layers, page_bucket(n), *page_shape)``: packed per layer along axis 1, the layers
stacked on a leading axis. Stacking is deliberate: ``jax.experimental.transfer`` sends 64 or more
arrays as one request each and many small arrays moved ~2x slower than one big one
(shared/JAX_TRANSFER.md), so one array per pool is what crosses the wire.

Bounded compilation. The page count is padded to :func:`page_bucket` (powers of two up to 8, then
four steps per octave, so at most 25% padding). Every jitted function here is keyed only by the
bucket (and the pool's own shape/dtype), never by the exact page count or the number of runs: the
run table is padded to the bucket too and the loop trip count is a traced scalar. The gathered
padding rows are zeros; on the scatter side the padding rows are never written (runs stop at ``n``),
so no page of the destination other than ``pages`` is touched.

Contiguous runs. Pages are allocated LIFO and freed per request, so a request's pages are mostly
runs of consecutive ids. Both directions copy run by run; a run of length ``m`` is copied as the
power-of-two pieces of ``m``'s binary form (static sizes, dynamic offsets) — that is what lets XLA
and the Pallas DMA kernel work with static shapes. Measured on CPU (bench/RESULTS_transfer.md):
the scatter moves 8 layers x 200 fragmented 64 KiB pages (100 MiB) in ~10-12 ms, ~7x faster
than an XLA ``.at[ids].set`` scatter of the same bytes. The gather is slower on CPU because its
output is fresh memory: allocating and first touching 100+ MiB costs ~50 ms of page faults there
(a numpy ``take`` into a fresh array pays the same), which an accelerator does not.

Donation. The scatter donates the destination pool arrays and returns new ones; callers must swap
them in under :class:`pd_fsm.jax_engine.kv.holder.KVCacheHolder` (DESIGN §6 ordering hazard).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Literal

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from pd_fsm.jax_engine import backend
from pd_fsm.jax_engine.compilation.upload import upload
from pd_fsm.jax_engine.kv.counters import TRACE_COUNTS
from pd_fsm.jax_engine.kv.pool import NULL_PAGE
from pd_fsm.jax_engine.parallel.tensor_parallel import packed_sharding

ScatterMethod = Literal["xla", "pallas"]
# P's: "xla" the tiers (take, then the run loop once compiled), "take" the quick tier alone,
# "pallas" the DMA kernel.
GatherMethod = Literal["xla", "take", "pallas"]


def default_scatter_method() -> ScatterMethod:
    """D's scatter of a pulled room on this backend: the Pallas DMA kernel on a TPU, the XLA
    copy elsewhere (a CPU runs the kernel only in interpret mode). Measured on one TPU v5e at
    SmolLM2's pool (bench/bench_tpu.py): 256 scattered pages in 8.5 ms against 310 ms for the
    XLA run loop, whose every run rewrites a whole layer there (bf16: 6.1 against 124 ms; 64
    pages 6.6 against 18 ms; 1-8 pages alike), the two equal bit for bit."""
    return backend.current().scatter_method


def default_gather_method() -> GatherMethod:
    """P's gather of a room it sends, on this backend: XLA ``take`` alone on a TPU, the XLA
    tiers (``kv/tiered.py``: ``take`` until the run loop has compiled, then the run loop)
    elsewhere. Measured on one TPU v5e at SmolLM2's pool (bench/bench_tpu.py, float32): 1 / 8 /
    64 / 256 pages by ``take`` 1.4 / 2.5 / 2.9 / 4.4 ms, by the run loop 3.8 / 4.2 / 6.6 / 21.6
    ms, by the Pallas DMA kernel 4.5 / 4.7 / 5.3 / 8.2 ms (bfloat16 alike), all three equal bit
    for bit; on the same host's CPU the run loop is the faster (256 pages: 149 against 278 ms
    by ``take``), which is why the tiers move to it there."""
    return "take" if jax.default_backend() == "tpu" else "xla"


def page_bucket(n: int) -> int:
    """Padded page count for ``n`` pages: powers of two up to 8, then 4 evenly spaced steps per
    octave (10, 12, 14, 16, 20, 24, 28, 32, 40, ...) so padding stays under 25%."""
    if n <= 8:
        return 1 << max(n - 1, 0).bit_length()
    step = (1 << ((n - 1).bit_length() - 1)) // 4
    return -(-n // step) * step


def page_buckets_upto(max_pages: int) -> list[int]:
    """Every bucket a request of 1..max_pages pages can land in (sorted)."""
    return sorted({page_bucket(n) for n in range(1, max_pages + 1)})


@attrs.frozen
class PageRuns:
    """Runs of consecutive pages padded to ``bucket`` rows: ``table[:, r] = (src, dst, length)``."""

    table: np.ndarray  # int32, shape (3, bucket)
    n_runs: int
    n_pages: int
    bucket: int


def contiguous_runs(src: Sequence[int], dst: Sequence[int], bucket: int) -> PageRuns:
    """Maximal runs where both ``src[i]`` and ``dst[i]`` advance by one."""
    s = np.asarray(src, dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    n = len(s)
    if len(d) != n:
        raise ValueError(f"src has {n} entries, dst {len(d)}")
    if n > bucket:
        raise ValueError(f"{n} pages do not fit bucket {bucket}")
    table = np.zeros((3, bucket), dtype=np.int32)
    if n == 0:
        return PageRuns(table, 0, 0, bucket)
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [n])))
    k = len(starts)
    table[0, :k] = s[starts]
    table[1, :k] = d[starts]
    table[2, :k] = lengths
    return PageRuns(table, k, n, bucket)


def validate_pages(pages: Sequence[int], num_pages: int) -> None:
    """Refuse empty lists, the null page, ids outside the pool and duplicates."""
    arr = np.asarray(pages, dtype=np.int64)
    if arr.size == 0:
        raise ValueError("empty page list")
    if arr.min() <= NULL_PAGE or arr.max() >= num_pages:
        raise ValueError(f"page ids must be in [1, {num_pages}); got {arr.min()}..{arr.max()}")
    if len(np.unique(arr)) != arr.size:
        raise ValueError("duplicate page ids")


def _runs_loop(
    dst: list[jax.Array],
    piece: Callable[[int, jax.Array, int], list[jax.Array]],
    place: Callable[[list[jax.Array], list[jax.Array], jax.Array], list[jax.Array]],
    table: jax.Array,
    n_runs: jax.Array,
    n_bits: int,
) -> list[jax.Array]:
    """For every run ``(s, d, m)`` and every set bit ``k`` of ``m``: take ``piece(k, s + off, 2^k)``
    and ``place`` it at ``d + off``, where ``off = m mod 2^k`` (pieces laid out low bit first).

    One loop over runs carrying every layer, one ``cond`` per bit covering every layer: separate
    loops per layer measured ~7x slower on CPU (the carries were copied)."""

    def body(r: jax.Array, out: list[jax.Array]) -> list[jax.Array]:
        s, d, m = table[0, r], table[1, r], table[2, r]
        for k in range(n_bits):
            off = m & ((1 << k) - 1)

            def put(o: list[jax.Array], k: int = k, off: jax.Array = off) -> list[jax.Array]:
                return place(o, piece(k, s + off, 1 << k), d + off)

            out = jax.lax.cond((m >> k) & 1 == 1, put, lambda o: o, out)
        return out

    return jax.lax.fori_loop(0, n_runs, body, dst)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _packed_zeros(
    shape: tuple[int, ...], dtype: jnp.dtype, sharding: jax.sharding.Sharding | None = None
) -> jax.Array:
    """Zeros for a packed array, placed as ``sharding`` (that of the pool's packed arrays:
    ``tensor_parallel.packed_sharding``), or on the default device."""
    TRACE_COUNTS.bump("gather_alloc")
    zeros = jnp.zeros(shape, dtype)
    return zeros if sharding is None else jax.lax.with_sharding_constraint(zeros, sharding)


@functools.partial(jax.jit, donate_argnums=(0,))
def _gather_into(
    out: jax.Array, kv_caches: list[jax.Array], table: jax.Array, n_runs: jax.Array
) -> jax.Array:
    TRACE_COUNTS.bump("gather")

    def piece(k: int, start: jax.Array, size: int) -> list[jax.Array]:
        return [jax.lax.dynamic_slice_in_dim(c, start, size, 0) for c in kv_caches]

    def place(o: list[jax.Array], p: list[jax.Array], at: jax.Array) -> list[jax.Array]:
        stacked = o[0]
        for layer, x in enumerate(p):
            index = (layer, at) + (0,) * (stacked.ndim - 2)
            stacked = jax.lax.dynamic_update_slice(stacked, x[None], index)
        return [stacked]

    # The output is allocated by a separate call and donated: zeros created inside this jit and
    # then filled by the loop measured ~1.3x slower on CPU.
    (packed,) = _runs_loop([out], piece, place, table, n_runs, table.shape[1].bit_length())
    return packed


def select_from_kv_caches(kv_caches: Sequence[jax.Array], pages: Sequence[int], *,
                          method: ScatterMethod = "xla", interpret: bool | None = None
                          ) -> jax.Array:
    """Gather ``pages`` of every layer into one packed array
    ``(num_layers, page_bucket(len(pages)), *page_shape)``; rows past ``len(pages)`` are zeros.
    ``method`` "pallas": the DMA kernel (compiled on a TPU, interpreted elsewhere unless
    ``interpret`` says otherwise)."""
    validate_pages(pages, kv_caches[0].shape[0])
    bucket = page_bucket(len(pages))
    runs = contiguous_runs(pages, range(len(pages)), bucket)
    first = kv_caches[0]
    out = _packed_zeros(
        (len(kv_caches), bucket, *first.shape[1:]), first.dtype, packed_sharding(first.sharding)
    )
    table, n_runs = upload(runs.table), jnp.int32(runs.n_runs)
    if method == "xla":
        return _gather_into(out, list(kv_caches), table, n_runs)
    if method == "pallas":
        return _pallas_gather(kv_caches, out, runs, interpret)
    raise ValueError(f"unknown gather method {method!r}")


def _pallas_gather(kv_caches: Sequence[jax.Array], out: jax.Array, runs: PageRuns,
                   interpret: bool | None) -> jax.Array:
    """The Pallas gather of ``runs`` into ``out`` (donated)."""
    from pd_fsm.jax_engine.kv.pallas_copy import multi_layer_gather_pallas_per_shard

    return multi_layer_gather_pallas_per_shard(
        out, list(kv_caches), upload(runs.table), jnp.int32(runs.n_runs),
        interpret=_interpret(interpret))


def warm_pallas_gather(kv_caches: Sequence[jax.Array], bucket: int) -> None:
    """Compile the Pallas gather for packed arrays of ``bucket`` pages by running it with no
    runs (it reads nothing and only writes the packed array it is given)."""
    first = kv_caches[0]
    out = _packed_zeros((len(kv_caches), bucket, *first.shape[1:]), first.dtype,
                        packed_sharding(first.sharding))
    jax.block_until_ready(_pallas_gather(kv_caches, out, scatter_runs([], bucket), None))


@functools.partial(jax.jit, donate_argnums=(0,))
def multi_layer_copy(
    kv_caches: list[jax.Array], packed: jax.Array, table: jax.Array, n_runs: jax.Array
) -> list[jax.Array]:
    """Portable XLA scatter: for every layer ``l`` and run ``(s, d, m)`` of ``table``,
    ``kv_caches[l][d:d+m] = packed[l, s:s+m]``. ``kv_caches`` is donated."""
    TRACE_COUNTS.bump("multi_layer_copy")

    def piece(k: int, start: jax.Array, size: int) -> list[jax.Array]:
        return [jax.lax.dynamic_slice_in_dim(packed[i], start, size, 0)
                for i in range(len(kv_caches))]

    def place(o: list[jax.Array], p: list[jax.Array], at: jax.Array) -> list[jax.Array]:
        return [jax.lax.dynamic_update_slice_in_dim(c, x, at, 0) for c, x in zip(o, p, strict=True)]

    return _runs_loop(list(kv_caches), piece, place, table, n_runs, packed.shape[1].bit_length())


def check_packed(
    kv_caches: Sequence[jax.Array | jax.ShapeDtypeStruct], packed: jax.Array, pages: Sequence[int]
) -> None:
    """Refuse a packed array that does not fit the pool (layers, page shape, dtype, page ids)."""
    if packed.shape[0] != len(kv_caches):
        raise ValueError(f"packed has {packed.shape[0]} layers, pool {len(kv_caches)}")
    if packed.shape[2:] != kv_caches[0].shape[1:] or packed.dtype != kv_caches[0].dtype:
        raise ValueError(
            f"packed page {packed.shape[2:]}/{packed.dtype} does not match pool page "
            f"{kv_caches[0].shape[1:]}/{kv_caches[0].dtype}"
        )
    validate_pages(pages, kv_caches[0].shape[0])


def as_struct(a: jax.Array) -> jax.ShapeDtypeStruct:
    """The abstract value of ``a`` (for ahead-of-time compilation)."""
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)


def scatter_runs(pages: Sequence[int], bucket: int) -> PageRuns:
    """Runs for writing packed rows ``0..n-1`` into destination ``pages``."""
    return contiguous_runs(range(len(pages)), pages, bucket)


def _pallas_copy(kv_caches: Sequence[jax.Array], packed: jax.Array, runs: PageRuns,
                 interpret: bool | None) -> list[jax.Array]:
    """The Pallas scatter of ``runs``; compiled for the chip on a TPU, interpreted elsewhere
    unless ``interpret`` says otherwise."""
    from pd_fsm.jax_engine.kv.pallas_copy import multi_layer_copy_pallas_per_shard

    return multi_layer_copy_pallas_per_shard(
        list(kv_caches), packed, upload(runs.table), jnp.int32(runs.n_runs),
        interpret=_interpret(interpret))


def _interpret(interpret: bool | None) -> bool:
    """Pallas in interpret mode unless told: compiled only on a TPU."""
    return backend.current().pallas_interpret if interpret is None else interpret


def warm_pallas_scatter(kv_caches: Sequence[jax.Array], bucket: int) -> list[jax.Array]:
    """Compile the Pallas scatter for packed arrays of ``bucket`` pages by running it with no
    runs (nothing is written); returns the pool's new arrays (the old ones are donated)."""
    first = kv_caches[0]
    packed = _packed_zeros((len(kv_caches), bucket, *first.shape[1:]), first.dtype,
                           packed_sharding(first.sharding))
    return _pallas_copy(kv_caches, packed, scatter_runs([], bucket), None)


def insert_kv_chunks(
    kv_caches: Sequence[jax.Array],
    packed: jax.Array,
    pages: Sequence[int],
    *,
    method: ScatterMethod = "xla",
    interpret: bool | None = None,
) -> list[jax.Array]:
    """Write packed rows ``0..len(pages)-1`` of every layer into ``pages`` of the pool; returns the
    new per-layer arrays (the old ones are donated — never use them again)."""
    check_packed(kv_caches, packed, pages)
    runs = scatter_runs(pages, packed.shape[1])
    if method == "xla":
        return multi_layer_copy(list(kv_caches), packed, upload(runs.table),
                                jnp.int32(runs.n_runs))
    if method == "pallas":
        return _pallas_copy(kv_caches, packed, runs, interpret)
    raise ValueError(f"unknown scatter method {method!r}")

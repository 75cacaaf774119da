"""Where a PD request's time to first token goes: one histogram per phase, on the side doing it.

The schedulers stamp each room as it passes a boundary (``PhaseRecorder.lap``, on the
scheduler's clock, ``time.monotonic`` in a worker) and queue ``(phase key, value)`` samples; the
PD backend takes them at the end of each tick (same thread) and observes them here on the trio
loop. D's pull thread reports its timings inside the :class:`PullResult` it publishes, so no
value is read across threads. Labels: none (no request ids; one histogram per phase). Names:
``pd_fsm_worker_<key>_seconds`` on P and D, ``pd_fsm_proxy_<key without proxy_>_seconds`` on
the proxy, and ``pd_fsm_worker_kv_transfer_bytes`` / ``..._kv_transfer_gigabytes_per_second``.

Prefill worker (P), in the order a room passes them:

- ``prefill_queue``: the leg's job handed to the backend (``_Stream.accepted``) -> its pages
  reserved and it joins the prefill batch (the wait for the loop's next tick, then for pages
  and a running slot, FIFO).
- ``prefill_forward``: joined the prefill batch -> first token sampled (the forward passes of
  all its chunks and the steps between them).
- ``kv_gather``: the gather of the room's prompt pages into packed arrays, as the scheduler
  thread spends it (the pool lock, the copy's dispatch, a compile if the shape is new; the
  device copy itself may still run afterwards, before D's pull reads it). With
  ``--disaggregation-kv-checksum`` it lasts until the arrays' checksums are computed, which
  waits for the copy itself.
- ``kv_register``: registering those arrays with the transfer server.

Decode worker (D):

- ``decode_bootstrap``: the leg's job handed to the backend -> P's route known (from the
  resolution cache, or a registry lookup) and the pages requested.
- ``decode_page_wait``: pages requested -> reserved for the whole sequence (FIFO); RECV_INIT
  goes to P at this point.
- ``decode_ready_wait``: pages reserved -> P's READY received and the pull submitted (P's
  queue, prefill, gather and registration as D sees them, plus the side channel).
- ``kv_pull``: pull submitted to the executor -> the KV arrived (``is_ready``), including a wait
  for a free pull thread; with ``--disaggregation-kv-checksum``, -> the KV arrived and passed its
  checksums (of the re-pull alone, when the first pull's failed them).
- ``kv_scatter``: KV arrived -> its copy into the reserved pages dispatched by the forward
  thread between two steps (the wait for the step in flight included; the copy itself runs
  before the next step, which JAX orders after it).
- ``kv_scatter_steps``: iterations of D's loop that ended between the KV's arrival and its
  scatter: 1 when it waited for the step in flight, 0 when it arrived between two steps; more
  would mean a scatter left behind ("never waits longer than one step").
- ``decode_pull_report``: scatter dispatched -> the scheduler loop took the result and the
  request joined the decode batch with P's first token.
- ``kv_tail``: P's READY received -> the request joined the decode batch: what of the transfer
  is not hidden behind P's prefill. Without streamed KV that is the whole pull, scatter and
  report; with it (``--disaggregation-stream-tokens``), the part still in flight at READY and
  READY's rest.
- ``kv_transfer_bytes`` / ``kv_transfer_gbps``: bytes of one successful pull, and those bytes
  over the pull's own time (``start_pull`` -> ready, without the wait for a thread), in GB/s.

D's own time to first token is the worker's ``pd_fsm_worker_time_to_first_token_seconds``
(metrics.py): HTTP arrival -> first token out, about the sum of D's phases above.

Proxy:

- ``proxy_decode_first_byte``: D leg posted -> first body bytes of D's 2xx answer received (a
  streamed answer's first chunk; a plain answer is read whole, so its end).
- ``proxy_prefill_leg``: P leg posted -> P's whole 2xx answer read.
- ``proxy_decode_leg``: D leg posted -> D's whole 2xx answer read and relayed.

sglang's per-stage names (``sglang:per_stage_req_latency_seconds{stage=...}``) cut a request at
other boundaries, so these keep names of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from prometheus_client import CollectorRegistry, Histogram

# 0.5 ms .. 5 min: a phase can be a dispatch (sub-ms) or a first compile (seconds). Finer from
# 5 ms to 1 s, where pulls, scatters and steps fall: the bench's p99 is interpolated inside one
# bucket, so a bucket there is the bench's resolution (the bench compares p99s within 2x).
PHASE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06,
    0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60, 120, 300,
)
STEPS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0)
BYTES_BUCKETS = tuple(float(2**k) for k in range(12, 33))  # 4 KiB .. 4 GiB
GBPS_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10,
    25, 50, 100, 250,
)


@attrs.frozen
class PhaseMetric:
    key: str  # what the scheduler (or proxy) reports
    role: str  # "prefill" | "decode" | "proxy": who observes it
    name: str  # the Prometheus metric name
    doc: str
    buckets: Sequence[float] = PHASE_BUCKETS


def _w(key: str, role: str, doc: str, suffix: str = "_seconds",
       buckets: Sequence[float] = PHASE_BUCKETS) -> PhaseMetric:
    return PhaseMetric(key, role, f"pd_fsm_worker_{key}{suffix}", doc, buckets)


# In the order a PD request meets them (the bench prints them in this order).
PHASES: tuple[PhaseMetric, ...] = (
    _w("decode_bootstrap", "decode", "D: leg accepted -> P's route known, pages requested"),
    _w("decode_page_wait", "decode", "D: pages requested -> reserved (RECV_INIT sent)"),
    _w("prefill_queue", "prefill", "P: leg accepted -> pages reserved, joins the prefill batch"),
    _w("prefill_forward", "prefill", "P: joins the prefill batch -> first token sampled"),
    _w("kv_gather", "prefill", "P: gather of the room's pages (scheduler thread)"),
    _w("kv_register", "prefill", "P: registration with the transfer server"),
    _w("decode_ready_wait", "decode", "D: pages reserved -> READY received, pull submitted"),
    _w("kv_pull", "decode", "D: pull submitted -> KV arrived"),
    _w("kv_scatter", "decode", "D: KV arrived -> its copy dispatched between two steps"),
    _w("kv_scatter_steps", "decode",
       "D: loop iterations ended between the KV's arrival and its scatter (1 = the step in "
       "flight)", "", STEPS_BUCKETS),
    _w("decode_pull_report", "decode", "D: scatter dispatched -> request in the decode batch"),
    _w("kv_tail", "decode",
       "D: READY received -> request in the decode batch (the transfer not hidden behind P's "
       "prefill)"),
    PhaseMetric("kv_transfer_bytes", "decode", "pd_fsm_worker_kv_transfer_bytes",
          "D: bytes of one successful pull", BYTES_BUCKETS),
    PhaseMetric("kv_transfer_gbps", "decode", "pd_fsm_worker_kv_transfer_gigabytes_per_second",
          "D: one pull's bytes / (start_pull -> ready), GB/s", GBPS_BUCKETS),
    PhaseMetric("proxy_decode_first_byte", "proxy", "pd_fsm_proxy_decode_first_byte_seconds",
          "proxy: D leg posted -> first bytes of D's 2xx answer"),
    PhaseMetric("proxy_prefill_leg", "proxy", "pd_fsm_proxy_prefill_leg_seconds",
          "proxy: P leg posted -> P's whole 2xx answer read"),
    PhaseMetric("proxy_decode_leg", "proxy", "pd_fsm_proxy_decode_leg_seconds",
          "proxy: D leg posted -> D's whole 2xx answer relayed"),
)
PHASE_BY_KEY = {p.key: p for p in PHASES}
# The worker's own TTFT histogram (metrics.py), printed with the phases by the bench.
TTFT_NAME = "pd_fsm_worker_time_to_first_token_seconds"


def role_phases(role: str) -> tuple[PhaseMetric, ...]:
    return tuple(p for p in PHASES if p.role == role)


class PhaseHistograms:
    """The histograms of the phases of ``role`` and of ``more`` roles in ``registry`` (none for a
    colocated worker): a worker that may switch roles has those of every role it may take."""

    def __init__(self, registry: CollectorRegistry, role: str, *more: str) -> None:
        self._hist = {
            p.key: Histogram(p.name, p.doc, buckets=p.buckets, registry=registry)
            for r in dict.fromkeys((role, *more)) for p in role_phases(r)
        }

    def observe(self, key: str, value: float) -> None:
        """Record one sample; a key of another role (or unknown) is ignored."""
        hist = self._hist.get(key)
        if hist is not None:
            hist.observe(max(0.0, value))

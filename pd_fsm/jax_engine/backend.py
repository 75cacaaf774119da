"""What the JAX backend decides, in one place: how a step runs, how the KV pool is laid out and
stored, how pages are copied, and how many tokens a prefill forward takes by default.

On a TPU every jitted call and host round trip costs more than the work of a small step (the
chain of ~34 calls ``model/forward.py`` runs took >= 9 ms a step there whatever its size), so a
step is one program (``step/program.py``) over a pool in the lanes layout, bf16 kept as bf16,
with pd_fsm's ragged paged attention kernel. On a CPU the chain stays: a new shape compiles one
layer instead of all of them, and its dispatches cost little next to a step; XLA:CPU updates a
donated bf16 array by copying it, so bf16 KV is stored as its bits there.

Everything below ``ModelRunner`` asks :func:`current`; the schedulers and everything above them
do not know which backend runs. Tests run the accelerator's choices on a CPU with
:func:`using` (the kernel in Pallas's interpret mode, or its XLA reference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import attrs
import jax

Attention = Literal["pallas", "interpret", "reference"]


@attrs.frozen
class Backend:
    platform: str
    fused_step: bool  # one jitted program per step (step/program.py); else the chain
    attention: Attention  # the fused step's attention
    kv_lanes: bool  # the pool's lanes layout (kv/pool.py); else the heads layout
    bf16_bits: bool  # bf16 KV stored as its bits in uint16
    pallas_interpret: bool  # Pallas copy kernels in interpret mode (no chip to compile for)
    scatter_method: Literal["xla", "pallas"]  # D's scatter of a pulled room
    gather_method: Literal["xla", "take", "pallas"]  # P's gather of a room it sends
    prefill_tokens: int  # --max-batched-tokens when not given
    # The weights' dtype when --dtype is not given: a TPU's native bf16 there; f32 on a CPU,
    # whose XLA runs bf16 products slowly (bench/RESULTS_model.md).
    dtype: str = "float32"
    # Decode steps dispatched before the previous one's tokens are read (the fused step only):
    # the host's work for a step hides behind the device's.
    overlap_steps: bool = False

    def for_tp(self, tp: int) -> Backend:
        """The choices for an instance over ``tp`` devices: the fused step and its lanes pool
        on one device only (the kernel is not sharded)."""
        if tp == 1 or not self.fused_step:
            return self
        return attrs.evolve(self, fused_step=False, kv_lanes=False)


def for_platform(platform: str) -> Backend:
    if platform == "tpu":
        # The scatter and gather methods: measured on one v5e (bench/RESULTS_tpu.md).
        return Backend(platform, fused_step=True, attention="pallas", kv_lanes=True,
                       bf16_bits=False, pallas_interpret=False, scatter_method="pallas",
                       gather_method="take", prefill_tokens=1024, overlap_steps=True,
                       dtype="bfloat16")
    # A CPU's forward grows much faster than its tokens past a few hundred: SmolLM2 prefills a
    # 788-token prompt in 2.0 s in chunks of 256, 2.7 s of 512, 5.0 s in one padded forward of
    # 1,024 (2 vCPUs, bench/RESULTS_prefill_chunk.md).
    budget = 256 if platform == "cpu" else 1024
    return Backend(platform, fused_step=False, attention="reference", kv_lanes=False,
                   bf16_bits=True, pallas_interpret=True, scatter_method="xla",
                   gather_method="xla", prefill_tokens=budget)


_override: list[Backend] = []


def current() -> Backend:
    """This process's backend choices (``using``'s, inside one)."""
    return _override[-1] if _override else for_platform(jax.default_backend())


@contextlib.contextmanager
def using(backend: Backend) -> Iterator[Backend]:
    """Run the block with ``backend``'s choices (tests: the accelerator's on a CPU)."""
    _override.append(backend)
    try:
        yield backend
    finally:
        _override.pop()


def accelerator_on_cpu(attention: Attention = "reference") -> Backend:
    """The TPU's choices on a CPU: the fused step over the lanes pool, bf16 as bf16, the
    kernel in interpret mode (``attention="interpret"``) or its XLA reference."""
    return attrs.evolve(for_platform("tpu"), platform="cpu", attention=attention,
                        pallas_interpret=True, scatter_method="xla", gather_method="xla",
                        prefill_tokens=256)

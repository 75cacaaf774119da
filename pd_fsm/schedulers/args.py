"""The scheduler's knobs (RFC-2 §7 names where one exists)."""

from __future__ import annotations

from typing import Any

import attrs
from attrs import AttrsInstance

from pd_fsm.jax_engine import backend

DISAGGREGATION_MODES = ("null", "prefill", "decode")
KV_DTYPES = ("float32", "bfloat16")


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def prefill_budget(requested: int | None) -> int:
    """``requested`` (--max-batched-tokens), or this backend's default
    (``jax_engine.backend``: 256 tokens on a CPU, 1,024 on an accelerator)."""
    return requested if requested is not None else backend.current().prefill_tokens


def weights_dtype(requested: str | None) -> str:
    """``requested`` (--dtype), or this backend's default (bf16 on a TPU, f32 on a CPU)."""
    return requested if requested is not None else backend.current().dtype


def _mode(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in DISAGGREGATION_MODES:
        raise ValueError(f"{attribute.name} must be one of {DISAGGREGATION_MODES}, got {value!r}")


# kw_only so that the PD work can subclass and add fields (with or without defaults).
@attrs.frozen(kw_only=True)
class SchedulerArgs:
    model: str = "smollm2"  # "smollm2" | "tiny" | a checkpoint directory | a shape (dummy)
    # "auto": the model's weights; "dummy": random weights at its shape (model/dummy.py).
    load_format: str = "auto"
    dtype: str | None = None  # the weights'; None: the backend's (weights_dtype)
    # The KV pool's dtype (pool, gather, transfer, scatter); None: ``dtype``. Attention
    # accumulates in f32 either way.
    kv_dtype: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.in_(KV_DTYPES)))
    model_seed: int = 0  # weights of the random "tiny" model
    num_pages: int = attrs.field(default=1024, validator=_positive)  # including the null page
    page_size: int = attrs.field(default=16, validator=_positive)
    max_running: int = attrs.field(default=8, validator=_positive)  # admitted requests, at most
    # Padded tokens (rows x bucketed length) one prefill forward may process; longer prompts are
    # prefilled in chunks of at most this many tokens. None: the backend's (prefill_budget).
    max_batched_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive))
    # Longest sequence (prompt + output); None: the model's own context length.
    context_length: int | None = None
    # Seeds requests that did not bring their own, so a whole run is reproducible.
    random_seed: int = 0
    disaggregation_mode: str = attrs.field(default="null", validator=_mode)
    # A prefix cache of KV pages (radix_cache.py): prompts sharing a cached prefix prefill only
    # the rest. Requests this scheduler prefills and decodes itself (not PD rooms, yet).
    radix_cache: bool = False
    # Devices this instance's model and KV pool are sharded over (tensor parallelism,
    # jax_engine/parallel/tensor_parallel.py): the first ``tp_size`` devices of the process.
    tp_size: int = attrs.field(default=1, validator=_positive)


def same_named(source: AttrsInstance, target: type[AttrsInstance], prefix: str = ""
               ) -> dict[str, Any]:
    """``source``'s values for the fields of ``target`` it has by name: ``name``, else ``prefix +
    name`` (``disaggregation_peer_timeout`` for ``peer_timeout``). How one config is built from
    another without copying each field by hand: the caller names only the fields that differ, and
    the rest keep ``target``'s defaults (tests/unit/test_config_derivation.py lists which)."""
    have = attrs.fields_dict(type(source))
    values = {}
    for field in attrs.fields(target):
        for name in (field.name, prefix + field.name) if prefix else (field.name,):
            if name in have:
                values[field.name] = getattr(source, name)
                break
    return values

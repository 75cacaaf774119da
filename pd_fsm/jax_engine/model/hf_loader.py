"""Load a local Hugging Face Llama / Qwen2 checkpoint (``config.json`` + ``*.safetensors``).

The safetensors format (8-byte little-endian header length, a JSON header, raw little-endian data)
is read directly with numpy, so no extra dependency is needed. HF stores linear weights
``[out, in]`` in the rotate-half rotary layout; we transpose to ``[in, out]`` and keep the layout.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from pd_fsm.jax_engine.model.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "mixtral")
# Where a mixture of experts keeps its router and experts, and its experts' gate, up and down.
_MOE_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}

_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to f32 below
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file as float32 (floats) or its integer dtype."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        arr = np.frombuffer(raw[base + begin : base + end], dtype=dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        elif arr.dtype.kind == "f":
            arr = arr.astype(np.float32)
        out[name] = np.array(arr)  # detach from the memmap
    return out


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; known: {SUPPORTED_MODEL_TYPES}")
    # transformers 5 writes the rotation's settings as rope_parameters (4.x: rope_theta and
    # rope_scaling).
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"rotary scaling {rope!r}: only the default rotation and Llama 3's "
                         "are implemented")
    scaling = None if kind == "default" else (
        float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]))
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position=_context(cfg),
        model_type=str(model_type),
        **_experts(cfg),
    )


def _experts(cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' settings, and which layers are sparse (transformers' rule for
    Qwen3-MoE: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``; Mixtral: all,
    its top-k weights always renormalised)."""
    n = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # 4.x / 5.x names
    if not n:
        return {}
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("a shared expert is not implemented")
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(int(cfg["num_hidden_layers"]))
                   if i not in dense and (i + 1) % step == 0)
    mixtral = cfg.get("model_type") == "mixtral"
    return {"num_experts": n, "experts_per_token": int(cfg["num_experts_per_tok"]),
            "norm_topk_prob": mixtral or bool(cfg.get("norm_topk_prob", True)),
            "sparse_layers": sparse}


def _context(cfg: dict[str, Any]) -> int:
    """The longest sequence served exactly: the model's, or its sliding attention window when
    one applies (Mistral v0.1's 4,096; the attention here is over the whole context, which
    equals the windowed one only up to the window)."""
    longest = int(cfg.get("max_position_embeddings", 4096))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return min(longest, int(window)) if window else longest


_LAYER = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    # Qwen3: an RMSNorm over each head's dimension of q and of k, before the rotation.
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}


def hf_to_params(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, Any]:
    layers = []
    for i in range(config.num_layers):
        layer: dict[str, np.ndarray] = {}
        sparse = i in config.sparse_layers
        if sparse:
            layer.update(_expert_params(tensors, i, config))
        for suffix, (name, transpose) in _LAYER.items():
            if sparse and suffix.startswith("mlp."):
                continue  # the experts replace the dense MLP
            w = tensors.get(f"model.layers.{i}.{suffix}")
            if w is None:
                if name.startswith("b") or (name.endswith("_norm") and name[0] in "qk"
                                            and config.model_type != "qwen3"):
                    continue  # biases exist only in Qwen2-style checkpoints, q/k norms in Qwen3
                raise KeyError(f"checkpoint lacks model.layers.{i}.{suffix}")
            layer[name] = np.ascontiguousarray(w.T) if transpose else w
        layers.append(layer)
    params: dict[str, Any] = {
        "embed": tensors["model.embed_tokens.weight"],
        "final_norm": tensors["model.norm.weight"],
        "layers": layers,
    }
    if not config.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(tensors["lm_head.weight"].T)
    return params


def _expert_params(tensors: dict[str, np.ndarray], i: int, config: ModelConfig
                   ) -> dict[str, np.ndarray]:
    """Layer ``i``'s router ``[H, E]`` and its experts stacked: gate and up ``[E, H, I]``, down
    ``[E, I, H]`` (transformers saves each expert's ``[out, in]`` linears apart)."""
    block, (gate, up, down) = _MOE_NAMES[config.model_type]
    prefix = f"model.layers.{i}.{block}"

    def stacked(proj: str) -> np.ndarray:
        try:
            return np.stack([tensors[f"{prefix}.experts.{e}.{proj}.weight"].T
                             for e in range(config.num_experts)])
        except KeyError as exc:
            raise KeyError(f"checkpoint lacks {exc.args[0]}") from None

    return {"router": np.ascontiguousarray(tensors[f"{prefix}.gate.weight"].T),
            "e_gate": stacked(gate), "e_up": stacked(up), "e_down": stacked(down)}


def load_hf_checkpoint(directory: Path) -> tuple[ModelConfig, dict[str, Any], dict[str, Any]]:
    """Config, numpy params pytree and the raw ``config.json`` of a checkpoint directory."""
    raw_cfg = json.loads((directory / "config.json").read_text())
    config = config_from_hf(raw_cfg)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        tensors.update(read_safetensors(path))
    return config, hf_to_params(tensors, config), raw_cfg

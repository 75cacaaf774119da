"""An HF-layout safetensors checkpoint (Llama and Qwen2 naming) loads to the same model."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import attrs
import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine.model import TINY, new_kv_pool, prefill
from pd_fsm.jax_engine.model.hf_loader import read_safetensors
from pd_fsm.jax_engine.model.params import random_params_np, to_device
from pd_fsm.jax_engine.model.registry import load_hf


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], bf16: set[str]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, arr in tensors.items():
        if name in bf16:
            data = (np.ascontiguousarray(arr, np.float32).view(np.uint32) >> 16).astype("<u2")
            dtype = "BF16"
        else:
            data, dtype = np.ascontiguousarray(arr, "<f4"), "F32"
        raw = data.tobytes()
        span = [offset, offset + len(raw)]
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": span}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def _byte_level_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return str(tok.to_str())


def _export(tmp: Path, p: dict[str, Any], model_type: str, tied: bool) -> None:
    """Write ``p`` the way transformers saves a Llama/Qwen2: ``[out, in]`` linears, HF names."""
    t: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": p["embed"],
        "model.norm.weight": p["final_norm"],
    }
    names = {
        "attn_norm": "input_layernorm.weight",
        "wq": "self_attn.q_proj.weight",
        "wk": "self_attn.k_proj.weight",
        "wv": "self_attn.v_proj.weight",
        "wo": "self_attn.o_proj.weight",
        "bq": "self_attn.q_proj.bias",
        "bk": "self_attn.k_proj.bias",
        "bv": "self_attn.v_proj.bias",
        "mlp_norm": "post_attention_layernorm.weight",
        "w_gate": "mlp.gate_proj.weight",
        "w_up": "mlp.up_proj.weight",
        "w_down": "mlp.down_proj.weight",
    }
    for i, layer in enumerate(p["layers"]):
        for key, w in layer.items():
            t[f"model.layers.{i}.{names[key]}"] = w.T if w.ndim == 2 else w
    if not tied:
        t["lm_head.weight"] = p["lm_head"].T
    # Two shards, one of them bf16 (the bf16 values are what the reference must use too).
    keys = list(t)
    half = len(keys) // 2
    bf16 = {k for k in keys[:half] if k.endswith("up_proj.weight")}
    first, second = {k: t[k] for k in keys[:half]}, {k: t[k] for k in keys[half:]}
    _write_safetensors(tmp / "model-00001-of-00002.safetensors", first, bf16)
    _write_safetensors(tmp / "model-00002-of-00002.safetensors", second, set())
    cfg = TINY
    (tmp / "config.json").write_text(
        json.dumps(
            {
                "model_type": model_type,
                "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size,
                "num_hidden_layers": cfg.num_layers,
                "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads,
                "rope_theta": cfg.rope_theta,
                "rms_norm_eps": cfg.rms_eps,
                "tie_word_embeddings": tied,
                "max_position_embeddings": 512,
                "eos_token_id": [3, 4],
            }
        )
    )
    (tmp / "tokenizer.json").write_text(_byte_level_tokenizer_json())


def _bf16_round(w: np.ndarray) -> np.ndarray:
    return ((np.ascontiguousarray(w, np.float32).view(np.uint32) >> 16) << 16).view(np.float32)


@pytest.mark.parametrize(("model_type", "tied"), [("llama", False), ("qwen2", True)])
def test_hf_checkpoint_loads_to_the_same_logits(
    tmp_path: Path, model_type: str, tied: bool
) -> None:
    cfg = attrs.evolve(TINY, tie_embeddings=tied, max_position=512)
    p = random_params_np(cfg, seed=3)
    rng = np.random.default_rng(4)
    if model_type == "qwen2":
        for layer in p["layers"]:  # type: ignore[attr-defined]
            layer["bq"] = rng.standard_normal(cfg.num_heads * cfg.head_dim).astype(np.float32)
            layer["bk"] = rng.standard_normal(cfg.num_kv_heads * cfg.head_dim).astype(np.float32)
            layer["bv"] = rng.standard_normal(cfg.num_kv_heads * cfg.head_dim).astype(np.float32)
    _export(tmp_path, p, model_type, tied)
    loaded = load_hf(tmp_path)
    assert loaded.config == attrs.evolve(cfg, model_type=model_type)
    assert loaded.tokenizer.eos_token_ids == frozenset({3, 4})
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("héllo 12")) == "héllo 12"

    # The reference: the same weights, with the bf16-stored ones rounded as the file holds them.
    shard = read_safetensors(tmp_path / "model-00001-of-00002.safetensors")
    for i, layer in enumerate(p["layers"]):  # type: ignore[attr-defined]
        if f"model.layers.{i}.mlp.up_proj.weight" in shard:
            layer["w_up"] = _bf16_round(layer["w_up"])
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, 8), jnp.int32)
    pages = jnp.asarray([1, 2], jnp.int32)
    outs = []
    for params in (to_device(p, "float32"), loaded.params):
        kv = new_kv_pool(cfg.kv_pool_config(4, 4))
        logits, _ = prefill(params, kv, tokens, 8, pages, config=cfg, all_logits=True)
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5)


def test_unsupported_checkpoints_fail_clearly(tmp_path: Path) -> None:
    from pd_fsm.jax_engine.model.hf_loader import config_from_hf

    with pytest.raises(ValueError, match="model_type"):
        config_from_hf({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="rotary scaling"):
        config_from_hf({"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}})


def test_llama3_rotary_scaling_divides_the_low_frequencies_only() -> None:
    """Llama 3.2's scaling (factor 32, bands at 8192 / 1 and 8192 / 4 tokens of wavelength):
    the fast rotations stay, the slow ones are divided by the factor, the band between lies
    between the two."""
    import math

    import numpy as np

    from pd_fsm.jax_engine.model.hf_loader import config_from_hf

    raw = {"model_type": "llama", "vocab_size": 8, "hidden_size": 128, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    cfg = config_from_hf(raw)
    assert cfg.rope_scaling == (32.0, 1.0, 4.0, 8192)
    plain = 1.0 / (500000.0 ** (np.arange(0, 64, 2) / 64))
    scaled = np.asarray(cfg.rope_frequencies(), np.float64)
    wavelen = 2 * math.pi / plain
    fast, slow = wavelen < 8192 / 4, wavelen > 8192
    np.testing.assert_allclose(scaled[fast], plain[fast], rtol=1e-6)
    np.testing.assert_allclose(scaled[slow], plain[slow] / 32, rtol=1e-6)
    mid = ~fast & ~slow
    assert mid.any()
    assert np.all(scaled[mid] <= plain[mid] * (1 + 1e-6))
    assert np.all(scaled[mid] >= plain[mid] / 32 * (1 - 1e-6))

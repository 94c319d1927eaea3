#!/usr/bin/env python3
"""Reference logits for a GGUF model, computed by Hugging Face transformers.

    python3 tools/golden/golden_logits.py --gguf FILE --ids 1,2,3 [--ids ...] --out DIR
        [--gguf-ref models/x.gguf] [--device cuda|cpu] [--set KEY=JSON ...]

Reads the GGUF with tools/gguf_py (pure Python + numpy, independent of kvq's
C++ reader), dequantizes every tensor (F32, F16, BF16, Q8_0, Q4_0, Q1_0) to
float32, builds a transformers Qwen3ForCausalLM / LlamaForCausalLM from a
config derived from the metadata, loads the weights (undoing llama.cpp's Q/K
row permutation for llama), and runs the prompts in float32 with eager
attention and TF32 off. Writes DIR/golden.json and DIR/caseN.npy (float32
[T, vocab], the logits of every position). kvq's CPU forward is compared with
these by tests/ (the golden-logits test).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "gguf_py"))

import numpy as np  # noqa: E402

import kvq_export as ex  # noqa: E402
import kvq_gguf as g  # noqa: E402


def hf_config_from_gguf(f: g.GGUFFile):
    """A transformers config for the GGUF's architecture, from its metadata."""
    import transformers

    arch = f.require("general.architecture")
    if arch not in ("qwen3", "llama"):
        raise g.GGUFError(f"{f.path}: architecture {arch} unsupported (qwen3, llama)")
    a = arch
    n_heads = int(f.require(f"{a}.attention.head_count"))
    d_model = int(f.require(f"{a}.embedding_length"))
    head_dim = int(f.get(f"{a}.attention.key_length", d_model // n_heads))
    vdim = int(f.get(f"{a}.attention.value_length", head_dim))
    if vdim != head_dim:
        raise g.GGUFError(f"{f.path}: value_length {vdim} != key_length {head_dim} is unsupported")
    scaling = f.get(f"{a}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise g.GGUFError(f"{f.path}: rope scaling {scaling} is not supported by the golden script")
    if "rope_freqs.weight" in f.tensors:
        raise g.GGUFError(f"{f.path}: rope_freqs tensor (llama3 scaling) is not supported by the golden script")
    vocab = f.tensor("token_embd.weight").ne[1]
    theta = float(f.get(f"{a}.rope.freq_base", 1e6 if arch == "qwen3" else 1e4))
    kw = dict(
        vocab_size=vocab,
        hidden_size=d_model,
        intermediate_size=int(f.require(f"{a}.feed_forward_length")),
        num_hidden_layers=int(f.require(f"{a}.block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(f.get(f"{a}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(f.get(f"{a}.context_length", 4096)),
        rms_norm_eps=float(f.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        attention_bias=False,
        tie_word_embeddings="output.weight" not in f.tensors,
    )
    if arch == "qwen3":
        kw.update(use_sliding_window=False)
        cfg = transformers.Qwen3Config(**kw)
    else:
        kw.update(mlp_bias=False)
        cfg = transformers.LlamaConfig(**kw)
    try:
        cfg._attn_implementation = "eager"
    except Exception:  # noqa: BLE001 - older/newer transformers spell it differently
        cfg.attn_implementation = "eager"
    return arch, cfg, theta


def load_hf_model(gguf_path: str, device: str = "cpu"):
    """(model in float32, eval mode, on device; the parsed GGUF)."""
    import torch
    import transformers

    f = g.read(gguf_path)
    arch, cfg, theta = hf_config_from_gguf(f)
    cls = transformers.Qwen3ForCausalLM if arch == "qwen3" else transformers.LlamaForCausalLM
    with torch.device("cpu"):
        model = cls(cfg)
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    sd = {}
    for name in f.tensors:
        w = f.to_float32(name)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = ex.llama_unpermute(w, n_heads if ".attn_q." in name else n_kv)
        sd[ex.hf_name(name)] = torch.from_numpy(np.ascontiguousarray(w))
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise g.GGUFError(f"{gguf_path}: state dict mismatch: missing {missing}, unexpected {unexpected}")
    model = model.to(device=device, dtype=torch.float32).eval()
    # The RoPE frequencies must be the GGUF's, whatever the config spelling.
    inv = model.model.rotary_emb.inv_freq.detach().double().cpu()
    want = 1.0 / (theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    if not torch.allclose(inv, want, rtol=1e-5):
        raise g.GGUFError(f"transformers did not take rope_theta={theta} from the config")
    return model, f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--ids", action="append", required=True, help="comma-separated token ids, one prompt each")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf-ref", help="path recorded in golden.json (default: --gguf as given)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help='extra top-level golden.json entry, e.g. --set \'synth={"shape": "tiny", "seed": 1}\'')
    args = ap.parse_args(argv)
    extra = {}
    for kv in args.set:
        key, sep, val = kv.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {kv!r}: expected KEY=JSON")
        try:
            extra[key] = json.loads(val)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--set {key}: value is not JSON ({e})")

    import torch
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, f = load_hf_model(args.gguf, device)
    os.makedirs(args.out, exist_ok=True)
    cases = []
    with torch.no_grad():
        for i, s in enumerate(args.ids):
            ids = [int(x) for x in s.split(",") if x.strip()]
            if not ids or max(ids) >= model.config.vocab_size or min(ids) < 0:
                raise SystemExit(f"--ids {s[:40]}...: ids must be in [0, {model.config.vocab_size})")
            logits = model(torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()
            fn = f"case{i}.npy"
            np.save(os.path.join(args.out, fn), logits.astype(np.float32))
            cases.append({"ids": ids, "logits": fn, "argmax": [int(x) for x in logits.argmax(axis=1)]})
    doc = {
        "model": os.path.basename(args.gguf),
        "gguf": args.gguf_ref or args.gguf,
        "architecture": f.require("general.architecture"),
        "dtype": "float32",
        "generator": "tools/golden/golden_logits.py",
        "reference": f"transformers {transformers.__version__} {type(model).__name__}, torch {torch.__version__}, "
                     f"{device}, float32, eager attention, TF32 off",
        "cases": cases,
    }
    doc.update(extra)
    with open(os.path.join(args.out, "golden.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"golden: {len(cases)} cases -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

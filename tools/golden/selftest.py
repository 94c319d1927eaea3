#!/usr/bin/env python3
"""Self-test of the golden-logits path (GPU machine or any machine with torch,
transformers and numpy): random tiny HF Qwen3 and Llama models are written to
GGUF with tools/gguf_py (Llama Q/K permuted as llama.cpp does), read back by
golden_logits.load_hf_model, and must give the original model's logits.
Every tensor type is also round-tripped through GGUF and checked against the
original weights within that type's error bound.

    python3 tools/golden/selftest.py
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "gguf_py"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import golden_logits as gl  # noqa: E402
import kvq_export as ex  # noqa: E402
import kvq_gguf as g  # noqa: E402

HP = dict(n_layers=2, d_model=128, d_ff=256, n_heads=4, n_kv_heads=2, head_dim=32,
          context_length=256, norm_eps=1e-6, rope_theta=1e6)


def tiny_hf(arch: str, tied: bool, seed: int):
    torch.manual_seed(seed)
    kw = dict(vocab_size=320, hidden_size=HP["d_model"], intermediate_size=HP["d_ff"],
              num_hidden_layers=HP["n_layers"], num_attention_heads=HP["n_heads"],
              num_key_value_heads=HP["n_kv_heads"], head_dim=HP["head_dim"],
              max_position_embeddings=HP["context_length"], rms_norm_eps=HP["norm_eps"],
              rope_theta=HP["rope_theta"], rope_parameters={"rope_type": "default", "rope_theta": HP["rope_theta"]},
              attention_bias=False, tie_word_embeddings=tied)
    cfg = transformers.Qwen3Config(**kw) if arch == "qwen3" else transformers.LlamaConfig(**kw)
    try:
        cfg._attn_implementation = "eager"
    except Exception:  # noqa: BLE001 - spelled differently across transformers versions
        cfg.attn_implementation = "eager"
    m = (transformers.Qwen3ForCausalLM if arch == "qwen3" else transformers.LlamaForCausalLM)(cfg)
    with torch.no_grad():  # non-trivial norm weights so a swapped norm would show
        for n, p in m.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return m.float().eval()


def check_logits(arch: str, tied: bool, d: str) -> float:
    m = tiny_hf(arch, tied, seed=1 if arch == "qwen3" else 2)
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight", None)
    path = os.path.join(d, f"{arch}_{tied}.gguf")
    hp = dict(HP, tied=tied)
    ex.write_model(path, arch, hp, sd, None, matrix_type=g.F32, name=f"selftest-{arch}")
    f = g.read(path)
    assert ("output.weight" in f.tensors) == (not tied), "output.weight presence must follow tying"
    m2, _ = gl.load_hf_model(path, "cpu")
    ids = torch.tensor([[1, 5, 9, 300, 17, 2, 2, 64, 128, 255, 7, 3]])
    with torch.no_grad():
        a = m(ids).logits
        b = m2(ids).logits
    err = (a - b).abs().max().item()
    assert err < 1e-4, f"{arch} tied={tied}: logits differ by {err}"
    return err


def check_types() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 256)).astype(np.float32)
    bounds = {g.F32: 0, g.F16: 1e-3, g.BF16: 8e-3, g.Q8_0: 0.03, g.Q4_0: 0.6}
    for t, rel in bounds.items():
        back = g.dequantize(g.quantize(w, t), t, w.size).reshape(w.shape)
        blockmax = np.abs(w).reshape(-1, 32).max(axis=1).repeat(32).reshape(w.shape)
        err = np.abs(back - w) / np.maximum(blockmax, 1e-30)
        assert err.max() <= rel + 1e-7, f"{g.TENSOR_TYPES[t][0]}: relative error {err.max()} > {rel}"
    back = g.dequantize(g.quantize(w, g.Q1_0), g.Q1_0, w.size).reshape(w.shape)
    assert np.array_equal(np.sign(back), np.where(w >= 0, 1.0, -1.0)), "Q1_0 signs"
    assert np.allclose(np.abs(back).reshape(-1, 128).mean(1), np.abs(w).reshape(-1, 128).mean(1), rtol=1e-3)
    # llama permutation is a true inverse pair
    q = rng.standard_normal((4 * 32, 128)).astype(np.float32)
    assert np.array_equal(ex.llama_unpermute(ex.llama_permute(q, 4), 4), q)
    assert not np.array_equal(ex.llama_permute(q, 4), q)


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    check_types()
    with tempfile.TemporaryDirectory() as d:
        for arch in ("qwen3", "llama"):
            for tied in (False, True):
                err = check_logits(arch, tied, d)
                print(f"selftest {arch} tied={tied}: max |logit diff| = {err:.2e}")
    print("golden selftest: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

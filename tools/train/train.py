#!/usr/bin/env python3
"""Train kvq's embedded default model (kvq-tiny-code) end to end on one GPU.

    python3 tools/train/train.py --out DIR [--train-end-s 480] [...]

One process does everything, each phase timed in DIR/train_log.json:
  1. corpus: text files of this machine's own installed software (.py, .c, .h,
     .md, .rst, .txt, ... under the Python library dirs, the venv's
     site-packages, /usr/include, /usr/share/doc), exact duplicates removed,
     sorted by path; the sorted list is written out and hashed (sha256). A
     file is held out for evaluation when sha256(path) says so (--heldout-permille).
  2. tokenizer: Hugging Face `tokenizers` byte-level BPE; pre-tokenizer = the
     Qwen2 regex split + ByteLevel(use_regex=False), no normalizer, so that
     GGUF `tokenizer.ggml.pre = qwen2` describes it exactly.
  3. model: Qwen3 architecture in plain PyTorch, parameter names equal to
     transformers' Qwen3ForCausalLM (so the export is a name map): RMSNorm,
     per-head q/k RMSNorm, NEOX RoPE (theta 1e6), GQA, SwiGLU, tied embeddings.
  4. training: bf16 autocast, AdamW, warmup then cosine over *time*, stopping
     at --train-end-s seconds after the script started (stop by time, not steps).
  5. evaluation: held-out perplexity and bits per byte.
  6. export: GGUF (Q8_0 matrices, F32 norms) with tools/gguf_py; the GGUF is
     read back through transformers (tools/golden) and checked: an F32 export
     must reproduce the PyTorch model's logits, the Q8_0 one its perplexity.
  7. artefacts: tokenizer.json, tokenizer reference ids (jsonl), samples,
     golden logits for kvq's CPU forward test.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import sys
import sysconfig
import time

T0 = time.time()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "gguf_py"))
sys.path.insert(0, os.path.join(HERE, "..", "golden"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kvq_export as ex  # noqa: E402
import kvq_gguf as g  # noqa: E402

# The Qwen2 pre-tokenizer regex (the one llama.cpp's `qwen2` pre-type implements).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
TEXT_EXTS = {".py", ".pyi", ".pyx", ".pxd", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".inl", ".inc", ".cu",
             ".cuh", ".md", ".rst", ".txt", ".toml", ".cfg", ".ini", ".sh", ".cmake", ".json", ".yaml", ".yml",
             ".html", ".js", ".css", ".pl", ".pm", ".el", ".rs", ".go", ".java", ".tcl", ".lua", ".m4", ".mk",
             ".texi", ".tex", ".xml", ".proto", ".f90", ".rb"}
MAX_FILE_BYTES = 512 * 1024   # larger files are mostly generated tables and data
MIN_FILE_BYTES = 64
MAX_LINE_CHARS = 1000         # minified/encoded content is not the text we want

LOG: dict = {"phases": {}, "train": [], "heldout_curve": []}


def elapsed() -> float:
    return time.time() - T0


def say(msg: str) -> None:
    print(f"[{elapsed():7.1f}s] {msg}", flush=True)


class Phase:
    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.t = time.time()
        say(f"== {self.name}")

    def __exit__(self, *exc):
        LOG["phases"][self.name] = round(time.time() - self.t, 2)
        say(f"== {self.name} done in {LOG['phases'][self.name]:.1f}s")


def path_hash(p: str) -> int:
    return int.from_bytes(hashlib.sha256(p.encode()).digest()[:8], "little")


# ---------------------------------------------------------------------------
# 1. Corpus
# ---------------------------------------------------------------------------
def corpus_roots() -> list[str]:
    roots = set()
    for key in ("stdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            roots.add(os.path.realpath(p))
    for p in ("/usr/lib/python3", "/usr/include", "/usr/share", "/usr/local", "/opt"):
        if os.path.isdir(p):
            roots.add(os.path.realpath(p))
    # drop roots nested in another root
    out = sorted(roots)
    return [r for r in out if not any(r != o and r.startswith(o + os.sep) for o in out)]


def gather_corpus(args):
    roots = corpus_roots()
    cands = []  # (path, size)
    seen_real = set()
    for root in roots:
        for dp, dns, fns in os.walk(root):
            dns.sort()
            for fn in sorted(fns):
                if os.path.splitext(fn)[1].lower() not in TEXT_EXTS:
                    continue
                p = os.path.join(dp, fn)
                try:
                    if os.path.islink(p):
                        continue
                    sz = os.path.getsize(p)
                except OSError:
                    continue
                if MIN_FILE_BYTES <= sz <= MAX_FILE_BYTES and p not in seen_real:
                    seen_real.add(p)
                    cands.append((p, sz))
    cands.sort()
    total = sum(s for _, s in cands)
    # Deterministic subsample by path hash when the candidates exceed the cap.
    cap = int(args.corpus_mb * 2**20)
    if total > cap:
        by_hash = sorted(cands, key=lambda c: path_hash("sample:" + c[0]))
        keep, acc = set(), 0
        for p, s in by_hash:
            if acc >= cap:
                break
            keep.add(p)
            acc += s
        cands = [c for c in cands if c[0] in keep]
    docs, seen = [], set()
    skipped = {"binary_or_not_utf8": 0, "long_lines": 0, "duplicate": 0}
    for p, _ in cands:
        try:
            with open(p, "rb") as fh:
                b = fh.read()
        except OSError:
            continue
        if b"\0" in b:
            skipped["binary_or_not_utf8"] += 1
            continue
        try:
            t = b.decode("utf-8")
        except UnicodeDecodeError:
            skipped["binary_or_not_utf8"] += 1
            continue
        if max(map(len, t.split("\n"))) > MAX_LINE_CHARS:
            skipped["long_lines"] += 1
            continue
        h = hashlib.sha256(b).digest()
        if h in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(h)
        docs.append((p, t, h))
    heldout = [d for d in docs if path_hash(d[0]) % 1000 < args.heldout_permille]
    train = [d for d in docs if path_hash(d[0]) % 1000 >= args.heldout_permille]
    listing = "\n".join(p for p, _, _ in docs) + "\n"
    content = hashlib.sha256(b"".join(h for _, _, h in docs)).hexdigest()
    by_ext: dict[str, list[int]] = {}
    by_root: dict[str, list[int]] = {}
    for p, t, _ in docs:
        e = os.path.splitext(p)[1].lower()
        r = next(r for r in roots if p.startswith(r))
        for dct, k in ((by_ext, e), (by_root, r)):
            v = dct.setdefault(k, [0, 0])
            v[0] += 1
            v[1] += len(t.encode())
    info = {
        "roots": roots,
        "extensions": sorted(TEXT_EXTS),
        "file_filters": f"{MIN_FILE_BYTES}..{MAX_FILE_BYTES} bytes, UTF-8, no NUL, lines <= {MAX_LINE_CHARS} chars, "
                        f"no symlinks, exact duplicates (sha256 of content) removed keeping the first by sorted path",
        "candidate_bytes_before_cap": total,
        "cap_bytes": cap,
        "files": len(docs),
        "bytes": sum(len(t.encode()) for _, t, _ in docs),
        "skipped": skipped,
        "file_list_sha256": hashlib.sha256(listing.encode()).hexdigest(),
        "content_sha256": content,
        "heldout_rule": f"sha256(path)[:8] as little-endian int % 1000 < {args.heldout_permille}",
        "train_files": len(train),
        "train_bytes": sum(len(t.encode()) for _, t, _ in train),
        "heldout_files": len(heldout),
        "heldout_bytes": sum(len(t.encode()) for _, t, _ in heldout),
        "by_extension": {k: {"files": v[0], "bytes": v[1]} for k, v in sorted(by_ext.items())},
        "by_root": {k: {"files": v[0], "bytes": v[1]} for k, v in sorted(by_root.items())},
    }
    with gzip.open(os.path.join(args.out, "corpus_files.txt.gz"), "wt") as fh:
        for p, _, _ in docs:
            fh.write(("H " if path_hash(p) % 1000 < args.heldout_permille else "T ") + p + "\n")
    return train, heldout, info


# ---------------------------------------------------------------------------
# 2. Tokenizer
# ---------------------------------------------------------------------------
def train_tokenizer(train_docs, args):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab, min_frequency=2, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    cap = int(args.tok_sample_mb * 2**20)
    sample, acc = [], 0
    for p, t, _ in sorted(train_docs, key=lambda d: path_hash("tok:" + d[0])):
        if acc >= cap:
            break
        sample.append(t)
        acc += len(t)
    tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
    if tok.get_vocab_size() != args.vocab:
        say(f"note: tokenizer vocab is {tok.get_vocab_size()} (asked {args.vocab})")
    return tok, {"sample_files": len(sample), "sample_chars": acc}


def tokenize_docs(tok, docs) -> np.ndarray:
    eot = tok.token_to_id("<|endoftext|>")
    enc = getattr(tok, "encode_batch_fast", tok.encode_batch)
    parts = []
    B = 4096
    for i in range(0, len(docs), B):
        texts = [t for _, t, _ in docs[i:i + B]]
        for e in enc(texts, add_special_tokens=False):
            parts.append(np.asarray(e.ids, dtype=np.uint16))
            parts.append(np.array([eot], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


# ---------------------------------------------------------------------------
# 3. Model: Qwen3 with transformers' parameter names
# ---------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.nh, self.nkv, self.hd = c.n_heads, c.n_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos[:T].to(q.dtype), sin[:T].to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.up_proj = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.down_proj = nn.Linear(c.d_ff, c.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.d_model, c.norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.d_model, c.norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.d_model)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.d_model, c.norm_eps)


class Qwen3(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        ang = torch.outer(torch.arange(c.ctx, dtype=torch.float64), inv)
        ang = torch.cat([ang, ang], dim=-1)
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)
        for n, p in self.named_parameters():
            if p.ndim == 2:
                std = 0.02
                if n.endswith(("o_proj.weight", "down_proj.weight")):
                    std = 0.02 / math.sqrt(2 * c.n_layers)
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, self.cos, self.sin)
        x = self.model.norm(x)
        return F.linear(x, self.model.embed_tokens.weight)  # tied output


class Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


# ---------------------------------------------------------------------------
# Evaluation helpers
# ---------------------------------------------------------------------------
def windows(stream: np.ndarray, T: int, n: int) -> torch.Tensor:
    k = min(n, (len(stream) - 1) // T)
    return torch.from_numpy(stream[: k * T + 1].astype(np.int64))


@torch.no_grad()
def eval_loss(fwd, stream: np.ndarray, T: int, n: int, device, bs: int = 8, autocast: bool = True) -> tuple[float, int]:
    """Mean next-token loss (nats) over the first n non-overlapping windows of length T."""
    k = min(n, (len(stream) - 1) // T)
    tot, cnt = 0.0, 0
    for i in range(0, k, bs):
        rows = range(i, min(k, i + bs))
        x = torch.stack([torch.from_numpy(stream[r * T:r * T + T].astype(np.int64)) for r in rows]).to(device)
        y = torch.stack([torch.from_numpy(stream[r * T + 1:r * T + T + 1].astype(np.int64)) for r in rows]).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = fwd(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        tot += loss.item()
        cnt += y.numel()
    return tot / max(cnt, 1), cnt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="kvq-tiny-code")
    ap.add_argument("--corpus-mb", type=float, default=1200)
    ap.add_argument("--tok-sample-mb", type=float, default=24)
    ap.add_argument("--heldout-permille", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=1536)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32, help="sequences of --ctx tokens per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--train-end-s", type=float, default=470, help="stop training this many s after the script started")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--bench-eager-steps", type=int, default=0, help="time this many eager steps before compiling")
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max-gguf-mib", type=float, default=32)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    LOG["args"] = vars(args)
    LOG["command"] = "python3 tools/train/train.py " + " ".join(sys.argv[1:])
    device = "cuda"
    torch.manual_seed(args.seed)
    LOG["env"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    try:
        import tokenizers
        import transformers
        LOG["env"].update(tokenizers=tokenizers.__version__, transformers=transformers.__version__)
    except ImportError as e:
        say(f"import: {e}")

    def save_log():
        with open(os.path.join(args.out, "train_log.json"), "w") as fh:
            json.dump(LOG, fh, indent=1)

    with Phase("corpus"):
        train_docs, held_docs, cinfo = gather_corpus(args)
        LOG["corpus"] = cinfo
        say(f"corpus: {cinfo['files']} files, {cinfo['bytes'] / 2**20:.1f} MiB; held out {cinfo['heldout_files']} files "
            f"{cinfo['heldout_bytes'] / 2**20:.2f} MiB; list sha256 {cinfo['file_list_sha256'][:16]}")
    with Phase("tokenizer"):
        tok, tinfo = train_tokenizer(train_docs, args)
        tok.save(os.path.join(args.out, "tokenizer.json"))
        LOG["tokenizer"] = dict(tinfo, vocab=tok.get_vocab_size(), specials=SPECIALS, pre="qwen2 regex split + ByteLevel",
                                normalizer=None)
    with Phase("tokenize"):
        train_ids = tokenize_docs(tok, train_docs)
        held_ids = tokenize_docs(tok, held_docs)
        LOG["tokens"] = {"train": int(len(train_ids)), "heldout": int(len(held_ids)),
                         "train_bytes_per_token": cinfo["train_bytes"] / max(1, len(train_ids)),
                         "heldout_bytes_per_token": cinfo["heldout_bytes"] / max(1, len(held_ids))}
        say(f"tokens: train {len(train_ids):,} heldout {len(held_ids):,} "
            f"({LOG['tokens']['train_bytes_per_token']:.2f} bytes/token)")
    save_log()

    # -------------------------------------------------------------------
    c = Cfg(vocab=tok.get_vocab_size(), d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
            n_kv_heads=args.kv_heads, head_dim=args.head_dim, d_ff=args.d_ff, ctx=args.ctx, norm_eps=1e-6,
            rope_theta=1e6)
    model = Qwen3(c).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    LOG["model"] = dict(c.__dict__, params=n_params, tied_embeddings=True, arch="qwen3")
    say(f"model: {n_params / 1e6:.2f}M params, {c.__dict__}")
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    data = torch.from_numpy(train_ids.astype(np.int32)).to(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    T, B = args.ctx, args.batch
    ar = torch.arange(T + 1, device=device)
    held_probe = held_ids[: 8 * T + 1]

    def batch():
        starts = torch.randint(0, len(data) - T - 1, (B,), device=device, generator=gen)
        chunk = data[starts[:, None] + ar].long()
        return chunk[:, :-1], chunk[:, 1:]

    def step_fn(fwd, x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        return loss

    fwd = model
    compiled = None
    step, tokens_seen = 0, 0
    loss_acc = torch.zeros((), device=device)
    loss_n = 0
    t_train0 = time.time()
    t_warm_end = None
    last_log, last_log_step = time.time(), 0
    last_probe = time.time()
    with Phase("train"):
        while True:
            now = elapsed()
            if now >= args.train_end_s:
                break
            if step == args.bench_eager_steps and args.compile and compiled is None:
                if args.bench_eager_steps:
                    torch.cuda.synchronize()
                    dt = time.time() - t_bench
                    LOG["bench_eager_tok_s"] = (args.bench_eager_steps - 2) * B * T / dt
                    say(f"eager: {LOG['bench_eager_tok_s']:,.0f} tok/s")
                compiled = torch.compile(model)
                fwd = compiled
                t_compile = time.time()
            if step == 2 and args.bench_eager_steps:
                torch.cuda.synchronize()
                t_bench = time.time()
            # lr: linear warmup by steps, then cosine by wall time to the deadline
            if step < args.warmup_steps:
                lr = args.lr * (step + 1) / args.warmup_steps
            else:
                if t_warm_end is None:
                    t_warm_end = now
                p = min(1.0, (now - t_warm_end) / max(1e-6, args.train_end_s - t_warm_end))
                lr = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))
            for gp in opt.param_groups:
                gp["lr"] = lr
            x, y = batch()
            try:
                loss = step_fn(fwd, x, y)
            except Exception as e:  # noqa: BLE001 - a compiler failure must not lose the run
                if fwd is model:
                    raise
                say(f"torch.compile failed ({type(e).__name__}: {str(e)[:200]}); continuing eager")
                LOG["compile_error"] = f"{type(e).__name__}: {str(e)[:500]}"
                opt.zero_grad(set_to_none=True)
                fwd = model
                loss = step_fn(fwd, x, y)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if compiled is not None and step == args.bench_eager_steps and "compile_s" not in LOG:
                torch.cuda.synchronize()
                LOG["compile_s"] = round(time.time() - t_compile, 1)
                say(f"first compiled step done after {LOG['compile_s']}s")
            step += 1
            tokens_seen += B * T
            loss_acc += loss.detach()
            loss_n += 1
            if step % 20 == 0 or step == 1:
                l = (loss_acc / loss_n).item()
                tnow = time.time()
                rec = {"step": step, "tokens": tokens_seen, "loss": round(l, 4), "lr": lr, "grad_norm": round(gn.item(), 3),
                       "t": round(elapsed(), 1),
                       "tok_s": round((step - last_log_step) * B * T / (tnow - last_log)) if step > 1 else None}
                LOG["train"].append(rec)
                say(f"step {step} loss {l:.4f} lr {lr:.2e} gn {gn.item():.2f} tok/s {rec['tok_s']}")
                last_log, last_log_step = tnow, step
                loss_acc.zero_()
                loss_n = 0
                if tnow - last_probe > 60:
                    model.eval()
                    hl, _ = eval_loss(model, held_probe, T, 8, device)
                    model.train()
                    LOG["heldout_curve"].append({"step": step, "tokens": tokens_seen, "loss": round(hl, 4),
                                                 "t": round(elapsed(), 1)})
                    say(f"  held-out probe loss {hl:.4f} (ppl {math.exp(hl):.2f})")
                    last_probe = tnow
                    save_log()
        torch.cuda.synchronize()
    LOG["steps"] = step
    LOG["tokens_seen"] = tokens_seen
    LOG["epochs"] = tokens_seen / max(1, len(train_ids))
    LOG["train_wall_s"] = round(time.time() - t_train0, 1)
    save_log()

    model.eval()
    with Phase("eval"):
        hl, hn = eval_loss(model, held_ids, T, args.eval_windows, device)
        tl, _ = eval_loss(model, train_ids, T, min(16, args.eval_windows), device)
        bpt = LOG["tokens"]["heldout_bytes_per_token"]
        LOG["eval"] = {"heldout_loss": hl, "heldout_ppl": math.exp(hl), "heldout_tokens": hn,
                       "heldout_bits_per_byte": hl / math.log(2) / bpt, "train_slice_loss": tl,
                       "context": T, "dtype": "bf16 autocast (PyTorch model)"}
        say(f"held-out: loss {hl:.4f} ppl {math.exp(hl):.2f} bpb {hl / math.log(2) / bpt:.3f} over {hn} tokens; "
            f"train slice loss {tl:.4f}")
    save_log()

    with Phase("export"):
        sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
        hp = dict(n_layers=c.n_layers, d_model=c.d_model, d_ff=c.d_ff, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                  head_dim=c.head_dim, context_length=c.ctx, norm_eps=c.norm_eps, rope_theta=c.rope_theta, tied=True)
        tmeta = ex.tokenizer_metadata_from_file(os.path.join(args.out, "tokenizer.json"))
        gguf_path = os.path.join(args.out, f"{args.name}.gguf")
        extra = {"general.description": "kvq's embedded default model: a small Qwen3-architecture code/text model "
                                        "trained by tools/train/train.py on this machine's installed files",
                 "general.license": "MIT"}
        types = ex.write_model(gguf_path, "qwen3", hp, sd, tmeta, matrix_type=g.Q8_0, name=args.name, extra_meta=extra)
        f32_path = "/tmp/kvq-export-f32.gguf"
        ex.write_model(f32_path, "qwen3", hp, sd, tmeta, matrix_type=g.F32, name=args.name)
        size = os.path.getsize(gguf_path)
        LOG["gguf"] = {"file": os.path.basename(gguf_path), "bytes": size, "mib": size / 2**20,
                       "sha256": hashlib.sha256(open(gguf_path, "rb").read()).hexdigest(),
                       "types": {k: g.TENSOR_TYPES[v][0] for k, v in types.items()}}
        say(f"gguf: {size / 2**20:.2f} MiB")
        if size > args.max_gguf_mib * 2**20:
            say(f"ERROR: GGUF is {size / 2**20:.2f} MiB > {args.max_gguf_mib} MiB")
    save_log()

    import golden_logits as gl

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    with Phase("verify"):
        # (a) the F32 export read back by transformers reproduces the PyTorch model in fp32
        hf32, _ = gl.load_hf_model(f32_path, device)
        probe = torch.from_numpy(held_ids[:512].astype(np.int64))[None].to(device)
        with torch.no_grad():
            a = model(probe).float()
            b = hf32(probe).logits.float()
        diff = (a - b).abs().max().item()
        LOG["verify"] = {"f32_export_vs_pytorch_max_abs_logit_diff": diff, "probe_tokens": 512,
                         "logit_abs_max": a.abs().max().item()}
        say(f"F32 GGUF via transformers vs PyTorch model: max |dlogit| = {diff:.2e}")
        del hf32
        # (b) the Q8_0 export's perplexity through transformers, fp32, same windows
        hq, _ = gl.load_hf_model(gguf_path, device)
        nq = min(16, args.eval_windows)
        ql, qn = eval_loss(lambda x: hq(x).logits, held_ids, T, nq, device, bs=1, autocast=False)
        bl, _ = eval_loss(model, held_ids, T, nq, device)
        LOG["verify"].update({"q8_gguf_heldout_loss": ql, "q8_gguf_heldout_ppl": math.exp(ql),
                              "pytorch_bf16_same_windows_loss": bl, "windows": nq, "tokens": qn})
        say(f"Q8_0 GGUF via transformers fp32: held-out ppl {math.exp(ql):.3f} vs PyTorch bf16 {math.exp(bl):.3f} "
            f"({qn} tokens)")
    save_log()

    with Phase("samples"):
        samples = []
        gsm = torch.Generator(device=device)
        for prompt in ("def ", "import ", "The "):
            for temp in (0.0, 0.8):
                gsm.manual_seed(7)
                ids = tok.encode(prompt).ids
                with torch.no_grad():
                    for _ in range(96):
                        lg = hq(torch.tensor([ids], device=device)).logits[0, -1].float()
                        if temp == 0:
                            nxt = int(lg.argmax())
                        else:
                            nxt = int(torch.multinomial(torch.softmax(lg / temp, -1), 1, generator=gsm))
                        ids.append(nxt)
                        if nxt == tok.token_to_id("<|endoftext|>"):
                            break
                text = tok.decode(ids)
                samples.append({"prompt": prompt, "temperature": temp, "seed": 7 if temp else None, "text": text})
                say(f"--- sample {prompt!r} T={temp}:\n{text}\n---")
        LOG["samples"] = samples
        LOG["samples_note"] = "generated from the Q8_0 GGUF loaded into transformers (fp32), 96 new tokens max"
    save_log()

    with Phase("tokenizer_refs"):
        refs = []
        edge = ["Hello world", "  leading spaces\tand\ttabs", "don't  we'll THEY'RE I'M you'd", "x = 12345 + 0.5e-3",
                "line1\r\nline2\n\n\nline5", "naïve café — 東京 🙂 Ωmega", "    def f(self):\n        return 42\n",
                "#include <stdio.h>\nint main(void) { return 0; }\n", "", " ", "\n", "trailing spaces   ",
                "😀😀 multi-byte emoji", "a\u00a0b\u2009c", "ALLCAPS_and_snake_case CamelCaseWord"]
        for t in edge:
            refs.append({"text": t, "ids": tok.encode(t).ids})
        for p, t, _ in sorted(held_docs)[:200]:
            if len(refs) >= 55:
                break
            if "<|" in t or "<think>" in t or "</think>" in t:
                continue
            h = path_hash("snip:" + p)
            lines = t.split("\n")
            start = h % max(1, len(lines))
            snip = "\n".join(lines[start:start + 3 + h % 20])[: 100 + h % 700]
            if snip.strip():
                refs.append({"text": snip, "ids": tok.encode(snip).ids})
        with open(os.path.join(args.out, "kvq_tiny_code_ref.jsonl"), "w") as fh:
            for r in refs:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        for r in refs:  # the decoder must give back the text exactly
            assert tok.decode(r["ids"]) == r["text"], f"tokenizer round trip failed on {r['text'][:40]!r}"
        LOG["tokenizer_refs"] = len(refs)
        del hq
        torch.cuda.empty_cache()

    with Phase("golden"):
        eot = tok.token_to_id("<|endoftext|>")
        starts = [0]
        for i, t in enumerate(held_ids[:200000]):
            if t == eot:
                starts.append(i + 1)
        cases, lens = [], [16, 48, 96]
        for s in starts:
            if len(cases) == len(lens):
                break
            L = lens[len(cases)]
            seg = held_ids[s:s + L]
            if len(seg) == L and eot not in seg:
                cases.append(",".join(str(int(v)) for v in seg))
        gdir = os.path.join(args.out, "golden")
        argv = ["--gguf", gguf_path, "--out", gdir, "--gguf-ref", f"models/{args.name}.gguf"]
        for cs in cases:
            argv += ["--ids", cs]
        gl.main(argv)
        LOG["golden_cases"] = [len(cs.split(",")) for cs in cases]
    LOG["total_s"] = round(elapsed(), 1)
    save_log()
    say(f"all done in {elapsed():.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

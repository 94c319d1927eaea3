#!/usr/bin/env python3
"""Reference ids from Hugging Face `tokenizers` (the Rust library the models
ship for), in the same format as make_ref.mjs, and a comparison with the
committed JavaScript references.

  python3 tools/tokref/hf_ref.py --tokenizer models/tokenizers/qwen3/tokenizer.json \
      --out /tmp/qwen3_hf.jsonl --compare tests/data/tokenizer/qwen3_ref.jsonl

Needs `pip install tokenizers` (present on the GPU machine). With --chat it
also renders tests/data/tokenizer/chat_cases.json with Jinja2 (the engine
transformers uses) and compares with chat_ref.json.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "tests", "data", "tokenizer")


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(l) for l in f if l.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json")
    ap.add_argument("--corpus", default=os.path.join(DATA, "corpus.jsonl"))
    ap.add_argument("--out", help="write one JSON id list per corpus line here")
    ap.add_argument("--compare", help="reference jsonl to compare with (e.g. the JS one)")
    ap.add_argument("--chat", action="store_true", help="also check chat_ref.json with Jinja2")
    args = ap.parse_args()

    from tokenizers import Tokenizer  # noqa: imported late so --help works without it

    tok = Tokenizer.from_file(args.tokenizer)
    corpus = read_jsonl(args.corpus)
    ids = [tok.encode(t, add_special_tokens=False).ids for t in corpus]
    if args.out:
        with open(args.out, "w") as f:
            for x in ids:
                f.write(json.dumps(x, separators=(",", ":")) + "\n")
        print(f"wrote {len(ids)} id lists to {args.out}")
    bad = 0
    if args.compare:
        ref = read_jsonl(args.compare)
        assert len(ref) == len(ids), "corpus and reference differ in length"
        for i, (a, b) in enumerate(zip(ids, ref)):
            if a != b:
                bad += 1
                print(f"line {i + 1}: HF {a[:20]} != ref {b[:20]}  text={json.dumps(corpus[i])[:100]}")
        print(f"{len(ids) - bad} passed, {bad} failed (HF tokenizers vs {os.path.basename(args.compare)})")
    if args.chat:
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader())
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
        cases = json.load(open(os.path.join(DATA, "chat_ref.json"), encoding="utf-8"))
        cfgs = {"chatml": os.path.join(HERE, "..", "..", "models", "tokenizers", "qwen3", "tokenizer_config.json")}
        for c in cases:
            if c["family"] not in cfgs:
                continue
            cfg = json.load(open(cfgs[c["family"]], encoding="utf-8"))
            vars = dict(messages=c["messages"], add_generation_prompt=c["add_generation_prompt"],
                        bos_token=cfg.get("bos_token") or "", eos_token=cfg.get("eos_token") or "")
            if "enable_thinking" in c:
                vars["enable_thinking"] = c["enable_thinking"]
            got = env.from_string(cfg["chat_template"]).render(**vars)
            ok = got == c["expected"]
            bad += not ok
            print(("ok  " if ok else "BAD ") + c["name"] + ("" if ok else f"\n  jinja2: {got!r}\n  ref:    {c['expected']!r}"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Seed corpus for fuzz_tokenizer_json: small valid byte-level BPE
tokenizer.json files (qwen2 and llama-bpe regexes, with and without NFC,
merges in both formats, added tokens, a tokenizer_config.json part) and a few
near-misses. usage: make_tokenizer_seeds.py OUT_DIR"""
import json
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
src = open(os.path.join(ROOT, "src", "tokenizer", "pretokenizer.cpp"), encoding="utf-8").read()
# The regexes as kvq knows them: the raw strings R"(...)" of its pre-tokenizer table.
regexes = dict(re.findall(r'\{"([a-z0-9-]+)",\s*R"\((.*?)\)",', src, re.S))
assert set(regexes) >= {"qwen2", "llama-bpe"}, regexes


def byte_chars():
    """GPT-2's byte -> printable character map (printable Latin-1 maps to
    itself; the other 68 bytes to U+0100 upwards, in byte order)."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


B = byte_chars()


def tokenizer(pre, nfc, pair_merges, added, words):
    vocab = {B[b]: b for b in range(256)}
    merges = []
    for w in words:  # merge each word left to right
        cur = B[ord(w[0])]
        for ch in w[1:]:
            nxt = cur + B[ord(ch)]
            merges.append([cur, B[ord(ch)]] if pair_merges else cur + " " + B[ord(ch)])
            vocab.setdefault(nxt, len(vocab))
            cur = nxt
    added_tokens = [{"id": len(vocab) + i, "content": t, "special": t.startswith("<|")} for i, t in enumerate(added)]
    return {
        "version": "1.0",
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"} if nfc else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regexes[pre]}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "model": {"type": "BPE", "ignore_merges": pre == "llama-bpe", "byte_fallback": False,
                  "vocab": vocab, "merges": merges},
    }


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    words = ["the", " the", "in", "def", " x", "  ", "ll", "er"]
    added = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    cfg = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"},
           "add_bos_token": False, "chat_template": "{% for m in messages %}<|im_start|>{% endfor %}"}
    seeds = {
        "qwen2_none": (tokenizer("qwen2", False, True, added, words), None),
        "qwen2_nfc_cfg": (tokenizer("qwen2", True, False, added, words), cfg),
        "llama_bpe": (tokenizer("llama-bpe", False, True, ["<|begin_of_text|>", "<|eot_id|>"], words),
                      {"bos_token": "<|begin_of_text|>", "chat_template": [{"name": "default", "template": "x"}]}),
        "qwen2_bytes_only": (tokenizer("qwen2", False, False, [], []), None),
    }
    for name, (tok, config) in seeds.items():
        text = json.dumps(tok, ensure_ascii=False)
        if config is not None:
            text += "\n=====\n" + json.dumps(config)
        with open(os.path.join(out, name + ".json"), "w", encoding="utf-8") as f:
            f.write(text)
    # Near-misses that exercise the checks.
    bad = tokenizer("qwen2", False, True, added, words)
    bad["added_tokens"][0]["id"] = -1
    with open(os.path.join(out, "negative_id.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(bad))
    bad["added_tokens"][0]["id"] = 1.5
    with open(os.path.join(out, "float_id.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(bad))
    with open(os.path.join(out, "deep.json"), "w", encoding="utf-8") as f:
        f.write('{"model": {"type": "BPE"}, "pre_tokenizer": ' + '{"type": "Sequence", "pretokenizers": [' * 40 +
                "null" + "]}" * 40 + "}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Write tests/data/tokenizer/probe.jsonl: 3000 seeded random strings over many Unicode blocks
(odd spaces, marks, CJK compatibility, jamo, emoji, contractions, special tokens). Their reference
ids (qwen3_hf_probe_ref.jsonl) come from Hugging Face tokenizers via hf_ref.py:
  python3 tools/tokref/hf_ref.py --tokenizer models/tokenizers/qwen3/tokenizer.json \
      --corpus tests/data/tokenizer/probe.jsonl --out tests/data/tokenizer/qwen3_hf_probe_ref.jsonl
"""
import json,random,sys
r=random.Random(99)
R=[(0x20,0x7e)]*6+[(0xa0,0x24f),(0x300,0x36f),(0x370,0x3ff),(0x400,0x4ff),(0x590,0x5ff),(0x600,0x6ff),(0x900,0x97f),(0xe00,0xe7f),(0x1100,0x11ff),(0x1680,0x1680),(0x180e,0x180e),(0x2000,0x206f),(0x20a0,0x20cf),(0x2100,0x214f),(0x2190,0x21ff),(0x2460,0x24ff),(0x3000,0x303f),(0x3040,0x30ff),(0x4e00,0x4e80),(0xac00,0xac40),(0xf900,0xf910),(0xfb00,0xfb06),(0xfe00,0xfe0f),(0xfeff,0xfeff),(0xff00,0xffef),(0x1d400,0x1d4ff),(0x1f300,0x1f64f),(0x1f1e6,0x1f1ff),(0x1f900,0x1f9ff),(0x85,0x85),(0x9,0xd),(0x200b,0x200d),(0x17f,0x17f),(0x212a,0x212a),(0x1c5,0x1c6)]
S=["<|im_start|>","<|im_end|>","<think>","</think>","<|endoftext|>","'s","'S","'ll","'ſ","\r\n","  ","\n\n"," 123","4567890"]
import os
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data", "tokenizer", "probe.jsonl")
o=open(OUT,"w")
for i in range(3000):
    n=r.randint(1,40);s=""
    for _ in range(n):
        if r.random()<0.1:s+=r.choice(S)
        else:
            a,b=r.choice(R);c=r.randint(a,b)
            if 0xd800<=c<=0xdfff:continue
            s+=chr(c)
    o.write(json.dumps(s)+"\n")

#!/usr/bin/env python3
"""Writes tests/data/kquant/kquants.gguf: K-quant tensors and their values
decoded by tools/gguf_py/kquants.py (pure Python, written from the layouts
independently of kvq's C++ dequantizers), which tests/test_kquant.cpp checks
kvq against. (llama.cpp's `gguf` Python package is not packaged for Debian 12,
so the fixtures come from this independent implementation instead.)

For each type T in Q2_K..Q6_K:
  T.quantized      3 x 512 values of a seeded normal, quantized by kquants.py
  T.quantized.ref  F32: kquants.dequantize of it
  T.random         2 x 512: random bytes (every field, every bit pattern), with
                   finite fp16 super-scales in [2^-8, 2^-4] (either sign for d)
  T.random.ref     F32: kquants.dequantize of it

    python3 tools/gguf_py/make_kquant_fixtures.py
"""

import os
import random
import struct
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import kquants  # noqa: E402
import kvq_gguf as g  # noqa: E402

# Byte offsets of the fp16 super-scales in each block layout.
SCALE_OFFSETS = {kquants.Q2_K: (80, 82), kquants.Q3_K: (108,), kquants.Q4_K: (0, 2), kquants.Q5_K: (0, 2),
                 kquants.Q6_K: (208,)}


def random_blocks(rng: random.Random, t: int, n_blocks: int) -> bytes:
    size = kquants.TYPES[t][2]
    out = bytearray()
    for _ in range(n_blocks):
        b = bytearray(rng.getrandbits(8) for _ in range(size))
        for i, off in enumerate(SCALE_OFFSETS[t]):
            v = rng.uniform(2.0**-8, 2.0**-4)
            if i == 0 and rng.random() < 0.5:
                v = -v
            b[off:off + 2] = struct.pack("<e", v)
        out += b
    return bytes(out)


def main() -> None:
    rng = random.Random(17)
    w = g.GGUFWriter()
    w.add("general.description", "K-quant fixtures: tools/gguf_py/make_kquant_fixtures.py")
    for t, (name, _, _) in sorted(kquants.TYPES.items()):
        x = [rng.gauss(0.0, 1.0) for _ in range(3 * 512)]
        q = kquants.quantize(x, t)
        w.add_tensor(f"{name}.quantized", (512, 3), t, q)
        w.add_tensor(f"{name}.quantized.ref", (512, 3), g.F32, g.quantize(kquants.dequantize(q, t), g.F32))
        r = random_blocks(rng, t, 2 * 2)
        w.add_tensor(f"{name}.random", (512, 2), t, r)
        w.add_tensor(f"{name}.random.ref", (512, 2), g.F32, g.quantize(kquants.dequantize(r, t), g.F32))
    out = os.path.join(here, "..", "..", "tests", "data", "kquant", "kquants.gguf")
    w.write(out)
    print(f"wrote {os.path.normpath(out)} ({os.path.getsize(out)} bytes)")


if __name__ == "__main__":
    main()

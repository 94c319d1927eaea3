"""Tests for kvq_gguf (run: python3 tools/gguf_py/test_kvq_gguf.py). Pure Python;
when numpy is installed the numpy paths are checked against the pure-Python ones."""

import os
import struct
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvq_gguf as g  # noqa: E402


def lcg_values(n, seed=1, scale=1.0):
    # Deterministic pseudo-random floats in [-scale, scale), exact in float32.
    out, s = [], seed
    for _ in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append(struct.unpack("<f", struct.pack("<f", ((s >> 40) / 2**24 * 2 - 1) * scale))[0])
    return out


class FormatTest(unittest.TestCase):
    def test_roundtrip_metadata_and_tensors(self):
        w = g.GGUFWriter()
        w.add("general.architecture", "qwen3")
        w.add("qwen3.block_count", 2)
        w.add("qwen3.rope.freq_base", 1e6)
        w.add("tokenizer.ggml.add_bos_token", False)
        w.add("tokenizer.ggml.tokens", ["a", "Ġb", "<|im_end|>"])
        w.add("tokenizer.ggml.token_type", g.Typed(g.ARRAY, [1, 1, 3], g.INT32))
        w.add("big", 2**40)
        vals = lcg_values(64 * 3)
        w.add_tensor("f32", (64, 3), g.F32, g.quantize(vals, g.F32))
        w.add_tensor("q8", (64, 3), g.Q8_0, g.quantize(vals, g.Q8_0))
        w.add_tensor("odd", (5,), g.F32, g.quantize(vals[:5], g.F32))  # forces padding after it
        w.add_tensor("q1", (128, 1), g.Q1_0, g.quantize(lcg_values(128), g.Q1_0))
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "t.gguf")
            w.write(p)
            f = g.read(p)
            self.assertEqual(f.version, 3)
            self.assertEqual(f.metadata["general.architecture"], "qwen3")
            self.assertEqual(f.metadata["qwen3.block_count"], 2)
            self.assertEqual(f.metadata_types["qwen3.block_count"], g.UINT32)
            self.assertEqual(f.metadata["qwen3.rope.freq_base"], 1e6)
            self.assertIs(f.metadata["tokenizer.ggml.add_bos_token"], False)
            self.assertEqual(f.metadata["tokenizer.ggml.tokens"], ["a", "Ġb", "<|im_end|>"])
            self.assertEqual(f.metadata["tokenizer.ggml.token_type"], [1, 1, 3])
            self.assertEqual(f.metadata["big"], 2**40)
            self.assertEqual(f.metadata["general.alignment"], 32)
            self.assertEqual(list(f.tensors), ["f32", "q8", "odd", "q1"])
            for t in f.tensors.values():
                self.assertEqual(t.offset % 32, 0, t.name)
            self.assertEqual(f.tensors["f32"].ne, (64, 3))
            got = g.dequantize(f.raw("f32"), g.F32, 192)
            self.assertEqual(list(got), vals)
            self.assertEqual(f.tensors["q1"].n_bytes, 18)

    def test_bad_magic_and_truncation_are_errors(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "bad.gguf")
            with open(p, "wb") as fh:
                fh.write(b"GGUX" + b"\0" * 20)
            with self.assertRaisesRegex(g.GGUFError, "bad magic"):
                g.read(p)
            w = g.GGUFWriter()
            w.add_tensor("x", (32,), g.F32, g.quantize([1.0] * 32, g.F32))
            w.write(p)
            with open(p, "rb") as fh:
                b = fh.read()
            with open(p, "wb") as fh:
                fh.write(b[:-8])
            with self.assertRaisesRegex(g.GGUFError, "past the end"):
                g.read(p)

    def test_wrong_byte_count_is_an_error(self):
        w = g.GGUFWriter()
        with self.assertRaisesRegex(g.GGUFError, "needs"):
            w.add_tensor("x", (32,), g.Q8_0, b"\0" * 33)


class CodecTest(unittest.TestCase):
    def test_q8_0_layout_and_error(self):
        vals = lcg_values(64, seed=3, scale=2.0)
        data = g.quantize(vals, g.Q8_0)
        self.assertEqual(len(data), 68)
        (d,) = struct.unpack_from("<e", data, 0)
        amax = max(abs(v) for v in vals[:32])
        self.assertAlmostEqual(d, amax / 127, delta=amax / 127 * 1e-3)
        # the largest-magnitude value codes to +-127
        q = struct.unpack_from("<32b", data, 2)
        self.assertEqual(max(abs(x) for x in q), 127)
        back = list(g.dequantize(data, g.Q8_0, 64))
        for a, b in zip(vals, back):
            self.assertLessEqual(abs(a - b), 2.0 / 127 * 0.5 * 1.01 + 1e-3)

    def test_q4_0_layout(self):
        vals = [float(i - 8) for i in range(16)] + [0.0] * 16  # max magnitude -8 -> d = 1
        data = g.quantize(vals, g.Q4_0)
        (d,) = struct.unpack_from("<e", data, 0)
        self.assertEqual(d, 1.0)
        back = list(g.dequantize(data, g.Q4_0, 32))
        # d = max/-8 = 1 so w = nibble - 8 maps back exactly (sign flips twice)
        self.assertEqual(back[:16], [float(-(i - 8)) * -1 for i in range(16)])
        self.assertEqual(data[2] & 0xF, 0)  # -8 -> nibble 0

    def test_q1_0_layout(self):
        vals = [1.0 if i % 3 == 0 else -1.0 for i in range(128)]
        data = g.quantize(vals, g.Q1_0)
        self.assertEqual(len(data), 18)
        self.assertEqual(data[2], 0b01001001)  # bits 0,3,6 set: LSB first
        back = list(g.dequantize(data, g.Q1_0, 128))
        self.assertEqual(back, vals)

    def test_bf16_and_f16(self):
        vals = [1.0, -2.5, 3.140625, 65504.0]
        self.assertEqual(list(g.dequantize(g.quantize(vals, g.BF16), g.BF16, 4))[:3], vals[:3])
        self.assertEqual(list(g.dequantize(g.quantize(vals, g.F16), g.F16, 4)), vals)
        # bf16 rounds to nearest even: 1 + 2^-8 is a tie between 1 and 1 + 2^-7
        self.assertEqual(list(g.dequantize(g.quantize([1.0 + 2**-8], g.BF16), g.BF16, 1)), [1.0])

    @unittest.skipIf(g.np is None, "numpy not installed: numpy paths not compared")
    def test_numpy_matches_pure_python(self):
        np = g.np
        for t, n in [(g.F32, 256), (g.F16, 256), (g.BF16, 256), (g.Q8_0, 256), (g.Q4_0, 256), (g.Q1_0, 256)]:
            vals = lcg_values(n, seed=t + 7, scale=3.0)
            a = g.quantize(np.array(vals, dtype=np.float32), t)
            b = g._quantize_py(vals, t)
            self.assertEqual(list(g.dequantize(a, t, n)), g._dequantize_py(a, t, n))
            if t in (g.F32, g.F16, g.BF16, g.Q4_0):
                self.assertEqual(a, b, g.TENSOR_TYPES[t][0])
            else:  # scales may differ in the last bit (float32 vs float64 arithmetic)
                for x, y in zip(g.dequantize(a, t, n), g._dequantize_py(b, t, n)):
                    self.assertLessEqual(abs(x - y), 3.0 / 127 + 1e-3 * abs(y), g.TENSOR_TYPES[t][0])


class KQuantTest(unittest.TestCase):
    def test_hand_built_q4_k_block(self):
        # d = 1, dmin = 0.5; sub-block 0: scale 2, min 1; sub-block 5: scale 37, min 50
        # (their high bits in the top bits of sm[1] and sm[5]); weight 0 q = 3, weight 167 q = 9.
        b = bytearray(144)
        b[0:2] = struct.pack("<e", 1.0)
        b[2:4] = struct.pack("<e", 0.5)
        sm = bytearray(12)
        sm[0], sm[4] = 2, 1
        sm[9] = 5 | (2 << 4)
        sm[1] |= 2 << 6
        sm[5] |= 3 << 6
        b[4:16] = sm
        b[16 + 0] = 3
        b[16 + 71] = 0x90
        w = g.dequantize(bytes(b), g.Q4_K, 256)
        self.assertEqual(w[0], 2 * 3 - 0.5)
        self.assertEqual(w[167], 37 * 9 - 0.5 * 50)
        self.assertEqual(w[32], 0.0)

    def test_round_trip_error_shrinks_with_bits(self):
        vals = lcg_values(512, seed=3)
        errs = []
        for t in (g.Q2_K, g.Q3_K, g.Q4_K, g.Q5_K, g.Q6_K):
            data = g.quantize(vals, t)
            self.assertEqual(len(data), 2 * g.TENSOR_TYPES[t][2])
            back = g.dequantize(data, t, 512)
            errs.append(max(abs(a - b) for a, b in zip(vals, back)))
        self.assertEqual(errs, sorted(errs, reverse=True))
        # Q6_K on values in [-1, 1): within one step (amax / 32; the code range -32..31 costs a
        # step when a value of the other sign is as large as the largest)
        self.assertLess(errs[-1], 1.0 / 32 * 1.1)


if __name__ == "__main__":
    unittest.main()

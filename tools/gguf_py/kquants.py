"""ggml K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) in pure Python, for kvq's test
fixtures. Written from the block layouts independently of kvq's C++ code (the
C++ reference walks weights and reads their bytes; this walks the stored bytes
and assigns their bit fields to weights), so the two check each other.

Every type packs 256 weights (a super-block). Layouts (little endian, fp16 d/dmin):
  Q4_K 144 B: d, dmin, sm[12], qs[128]   8 sub-blocks of 32: w = d*sc*q - dmin*m, q 0..15
  Q5_K 176 B: d, dmin, sm[12], qh[32], qs[128]   as Q4_K with a fifth bit, q 0..31
      sm: sub-block s<4: sc = sm[s] & 63, m = sm[s+4] & 63; s>=4: the low 4 bits of
      sc and m in sm[s+4] (sc low nibble, m high nibble), their high 2 bits in the
      top 2 bits of sm[s-4] (sc) and sm[s] (m).
      qs[32p + l]: low nibble = weight 64p + l, high nibble = weight 64p + 32 + l;
      Q5_K: bit (2p) of qh[l] is bit 4 of weight 64p + l, bit (2p+1) of weight 64p+32+l.
  Q6_K 210 B: ql[128], qh[64], int8 sc[16], d   16 sub-blocks of 16: w = d*sc*(q - 32), q 0..63
      half h (128 weights): ql[64h + l] low/high nibble = weights 128h + l / 128h + 64 + l,
      ql[64h + 32 + l] low/high = 128h + 32 + l / 128h + 96 + l (l < 32);
      qh[32h + l] bits 0-1, 2-3, 4-5, 6-7 = high 2 bits of weights 128h + l, +32, +64, +96.
  Q2_K 84 B: sm[16], qs[64], d, dmin   16 sub-blocks of 16: w = d*(sm&15)*q - dmin*(sm>>4), q 0..3
      qs[32n + l] bits 2j..2j+1 = weight 128n + 32j + l.
  Q3_K 110 B: hm[32], qs[64], sc[12], d   16 sub-blocks of 16: w = d*(s - 32)*q, q -4..3
      low 2 bits as Q2_K's qs; bit (4n + j) of hm[l] set means "no -4" for weight
      128n + 32j + l; 6-bit s of sub-block k: low 4 bits in sc[k] (k < 8, low nibble)
      or sc[k-8] (high nibble), high 2 bits in bits 2(k/4).. of sc[8 + k%4].
"""

from __future__ import annotations

import math
import struct

Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
TYPES = {
    Q2_K: ("Q2_K", 256, 84),
    Q3_K: ("Q3_K", 256, 110),
    Q4_K: ("Q4_K", 256, 144),
    Q5_K: ("Q5_K", 256, 176),
    Q6_K: ("Q6_K", 256, 210),
}


def _f16(b: bytes, o: int) -> float:
    return struct.unpack_from("<e", b, o)[0]


def _f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _unpack_sm12(sm: bytes) -> tuple[list[int], list[int]]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K block."""
    sc = [0] * 8
    m = [0] * 8
    for s in range(4):
        sc[s] = sm[s] & 63
        m[s] = sm[s + 4] & 63
        sc[s + 4] = (sm[s + 8] & 15) | ((sm[s] >> 6) << 4)
        m[s + 4] = (sm[s + 8] >> 4) | ((sm[s + 4] >> 6) << 4)
    return sc, m


def _unpack_q3_scales(sc12: bytes) -> list[int]:
    """The 16 six-bit scales (already minus 32) of a Q3_K block."""
    s = [0] * 16
    for byte_index in range(8):  # low nibbles: sub-blocks 0..7, high nibbles: 8..15
        s[byte_index] |= sc12[byte_index] & 15
        s[byte_index + 8] |= sc12[byte_index] >> 4
    for b in range(4):  # byte 8 + b holds the high 2 bits of sub-blocks b, b+4, b+8, b+12
        for field in range(4):
            s[b + 4 * field] |= ((sc12[8 + b] >> (2 * field)) & 3) << 4
    return [v - 32 for v in s]


def dequantize_block(t: int, b: bytes) -> list[float]:
    """256 floats of one super-block, each rounded to float32 as (d*sc)*q - dmin*m."""
    q = [0] * 256
    if t in (Q4_K, Q5_K):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, m = _unpack_sm12(b[4:16])
        qs = b[16:144] if t == Q4_K else b[48:176]
        for byte_index, byte in enumerate(qs):
            p, l = divmod(byte_index, 32)
            q[64 * p + l] = byte & 15
            q[64 * p + 32 + l] = byte >> 4
        if t == Q5_K:
            for l, byte in enumerate(b[16:48]):
                for bit in range(8):
                    if (byte >> bit) & 1:
                        p, odd = divmod(bit, 2)
                        q[64 * p + 32 * odd + l] += 16
        out = []
        for i in range(256):
            s = i // 32
            scale = _f32(d * sc[s])
            offset = _f32(dmin * m[s])
            out.append(_f32(_f32(scale * q[i]) - offset))
        return out
    if t == Q6_K:
        ql, qh = b[0:128], b[128:192]
        sc = struct.unpack_from("<16b", b, 192)
        d = _f16(b, 208)
        for byte_index, byte in enumerate(ql):
            h, r = divmod(byte_index, 64)
            g, l = divmod(r, 32)  # g: 0 for ql[64h + l], 1 for ql[64h + 32 + l]
            q[128 * h + 32 * g + l] = byte & 15
            q[128 * h + 32 * (g + 2) + l] = byte >> 4
        for byte_index, byte in enumerate(qh):
            h, l = divmod(byte_index, 32)
            for g in range(4):
                q[128 * h + 32 * g + l] |= ((byte >> (2 * g)) & 3) << 4
        return [_f32(_f32(d * sc[i // 16]) * (q[i] - 32)) for i in range(256)]
    if t == Q2_K:
        sm, qs = b[0:16], b[16:80]
        d, dmin = _f16(b, 80), _f16(b, 82)
        for byte_index, byte in enumerate(qs):
            n, l = divmod(byte_index, 32)
            for j in range(4):
                q[128 * n + 32 * j + l] = (byte >> (2 * j)) & 3
        out = []
        for i in range(256):
            k = i // 16
            out.append(_f32(_f32(_f32(d * (sm[k] & 15)) * q[i]) - _f32(dmin * (sm[k] >> 4))))
        return out
    if t == Q3_K:
        hm, qs = b[0:32], b[32:96]
        s = _unpack_q3_scales(b[96:108])
        d = _f16(b, 108)
        for byte_index, byte in enumerate(qs):
            n, l = divmod(byte_index, 32)
            for j in range(4):
                q[128 * n + 32 * j + l] = ((byte >> (2 * j)) & 3) - 4
        for l, byte in enumerate(hm):
            for bit in range(8):
                if (byte >> bit) & 1:
                    n, j = divmod(bit, 4)
                    q[128 * n + 32 * j + l] += 4
        return [_f32(_f32(d * s[i // 16]) * q[i]) for i in range(256)]
    raise ValueError(f"not a K-quant type: {t}")


def dequantize(data: bytes, t: int) -> list[float]:
    size = TYPES[t][2]
    out: list[float] = []
    for o in range(0, len(data), size):
        out += dequantize_block(t, data[o:o + size])
    return out


# ---------------------------------------------------------------------------
# Quantizers: simple round-to-nearest against per-sub-block ranges (valid
# encodings, not llama.cpp's error-minimising search).
def _rnd(v: float) -> int:
    return int(math.floor(v + 0.5))


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


def _h(v: float) -> tuple[bytes, float]:
    """fp16 bytes of v and the value they hold."""
    b = struct.pack("<e", v)
    return b, struct.unpack("<e", b)[0]


def _asym(x: list[float], sub: int, nmax: int, smax: int):
    """Scales and mins (codes 0..smax) of sub-blocks of `sub` values with codes 0..nmax."""
    ranges = []
    for k in range(0, 256, sub):
        v = x[k:k + sub]
        lo = min(0.0, min(v))
        ranges.append(((max(v) - lo) / nmax, -lo))
    db, d = _h(max(r[0] for r in ranges) / smax)
    mb, dm = _h(max(r[1] for r in ranges) / smax)
    sc = [_clamp(_rnd(r[0] / d), 0, smax) if d > 0 else 0 for r in ranges]
    m = [_clamp(_rnd(r[1] / dm), 0, smax) if dm > 0 else 0 for r in ranges]
    q = []
    for k in range(len(ranges)):
        step, off = d * sc[k], dm * m[k]
        for v in x[k * sub:(k + 1) * sub]:
            q.append(_clamp(_rnd((v + off) / step), 0, nmax) if step > 0 else 0)
    return db, mb, sc, m, q


def _sym(x: list[float], sub: int, qmin: int, smax: int):
    """Signed scales (codes -smax..smax) of sub-blocks whose largest-magnitude
    value maps to the code qmin (< 0); codes qmin..-qmin-1."""
    scales = []
    for k in range(0, 256, sub):
        v = max(x[k:k + sub], key=abs)
        scales.append(v / qmin)
    db, d = _h(max(abs(s) for s in scales) / smax)
    sc = [_clamp(_rnd(s / d), -smax, smax) if d > 0 else 0 for s in scales]
    q = []
    for k in range(len(scales)):
        step = d * sc[k]
        for v in x[k * sub:(k + 1) * sub]:
            q.append(_clamp(_rnd(v / step), qmin, -qmin - 1) if step != 0 else 0)
    return db, sc, q


def quantize_block(t: int, x: list[float]) -> bytes:
    x = [_f32(v) for v in x]
    if t in (Q4_K, Q5_K):
        nmax = 15 if t == Q4_K else 31
        db, mb, sc, m, q = _asym(x, 32, nmax, 63)
        sm = bytearray(12)
        for s in range(4):
            sm[s] = (sc[s] & 63) | ((sc[s + 4] >> 4) << 6)
            sm[s + 4] = (m[s] & 63) | ((m[s + 4] >> 4) << 6)
            sm[s + 8] = (sc[s + 4] & 15) | ((m[s + 4] & 15) << 4)
        qs = bytearray(128)
        qh = bytearray(32)
        for i in range(256):
            p, r = divmod(i, 64)
            half, l = divmod(r, 32)
            qs[32 * p + l] |= (q[i] & 15) << (4 * half)
            if q[i] & 16:
                qh[l] |= 1 << (2 * p + half)
        return db + mb + bytes(sm) + (bytes(qh) if t == Q5_K else b"") + bytes(qs)
    if t == Q6_K:
        db, sc, q = _sym(x, 16, -32, 127)
        ql = bytearray(128)
        qh = bytearray(64)
        for i in range(256):
            u = q[i] + 32
            h, r = divmod(i, 128)
            g, l = divmod(r, 32)
            ql[64 * h + 32 * (g % 2) + l] |= (u & 15) << (4 * (g // 2))
            qh[32 * h + l] |= (u >> 4) << (2 * g)
        return bytes(ql) + bytes(qh) + struct.pack("<16b", *sc) + db
    if t == Q2_K:
        db, mb, sc, m, q = _asym(x, 16, 3, 15)
        qs = bytearray(64)
        for i in range(256):
            n, r = divmod(i, 128)
            j, l = divmod(r, 32)
            qs[32 * n + l] |= q[i] << (2 * j)
        return bytes(sc[k] | (m[k] << 4) for k in range(16)) + bytes(qs) + db + mb
    if t == Q3_K:
        db, sc, q = _sym(x, 16, -4, 31)
        hm = bytearray(32)
        qs = bytearray(64)
        for i in range(256):
            n, r = divmod(i, 128)
            j, l = divmod(r, 32)
            u = q[i] + 4
            qs[32 * n + l] |= (u & 3) << (2 * j)
            if u & 4:
                hm[l] |= 1 << (4 * n + j)
        s6 = [min(63, v + 32) for v in sc]  # codes -32..31 stored as 0..63
        sc12 = bytearray(12)
        for k in range(16):
            sc12[k % 8] |= (s6[k] & 15) << (4 * (k // 8))
            sc12[8 + k % 4] |= (s6[k] >> 4) << (2 * (k // 4))
        return bytes(hm) + bytes(qs) + bytes(sc12) + db
    raise ValueError(f"not a K-quant type: {t}")


def quantize(x: list[float], t: int) -> bytes:
    if len(x) % 256:
        raise ValueError(f"{TYPES[t][0]} needs a multiple of 256 values, got {len(x)}")
    return b"".join(quantize_block(t, x[i:i + 256]) for i in range(0, len(x), 256))

"""A small GGUF v3 reader/writer for kvq's Python tools (training export, golden logits).

Independent of kvq's C++ code on purpose: the golden-logits reference must not
share a bug with the thing it checks. numpy is used when present (the GPU
machine has it); the pure-Python paths exist so the format logic can be tested
on machines without numpy (tools/gguf_py/test_kvq_gguf.py).

Conventions (llama.cpp's, which kvq's C++ reader follows):
  little endian; magic "GGUF" | u32 version (3) | u64 n_tensors | u64 n_kv
  n_kv x { string key | u32 value_type | value }
  n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 type | u64 offset }
  pad to general.alignment (32) | tensor data, every tensor offset aligned
  string = u64 length + UTF-8 bytes; array = u32 elem_type + u64 count + elems
  ne[0] is the fastest dimension: a PyTorch weight [out, in] has ne = (in, out)
  and its bytes are written as they are.

Tensor types: F32=0, F16=1, Q4_0=2, Q8_0=8, BF16=30, Q1_0=41.
  Q8_0: blocks of 32: fp16 d (= amax/127) then 32 int8 q; w = d*q.
  Q4_0: blocks of 32: fp16 d (= max-magnitude value / -8) then 16 bytes; byte j
        holds weight j in its low nibble and weight j+16 in its high nibble;
        w = d * (nibble - 8).
  Q1_0: blocks of 128: fp16 d then 128 sign bits LSB-first; w = bit ? +d : -d.
  Q2_K=10, Q3_K=11, Q4_K=12, Q5_K=13, Q6_K=14: 256-weight K-quant super-blocks,
        pure Python in kquants.py (layouts there).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterable

import kquants

try:  # numpy is optional: only the pure-Python paths run without it.
    import numpy as np
except ImportError:  # pragma: no cover - exercised on machines without numpy
    np = None

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32

# Metadata value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR_FMT = {
    UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
    FLOAT32: "<f", BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d",
}

# Tensor types: id -> (name, weights per block, bytes per block).
F32, F16, Q4_0, Q8_0, BF16, Q1_0 = 0, 1, 2, 8, 30, 41
TENSOR_TYPES = {
    F32: ("F32", 1, 4),
    F16: ("F16", 1, 2),
    Q4_0: ("Q4_0", 32, 18),
    Q8_0: ("Q8_0", 32, 34),
    BF16: ("BF16", 1, 2),
    Q1_0: ("Q1_0", 128, 18),
    **kquants.TYPES,
}
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = kquants.Q2_K, kquants.Q3_K, kquants.Q4_K, kquants.Q5_K, kquants.Q6_K
TYPE_BY_NAME = {v[0]: k for k, v in TENSOR_TYPES.items()}


class GGUFError(Exception):
    """A malformed file or an unsupported request; the message says which."""


def tensor_nbytes(ggml_type: int, n_elements: int) -> int:
    if ggml_type not in TENSOR_TYPES:
        raise GGUFError(f"unknown tensor type id {ggml_type}; known: {sorted(TENSOR_TYPES)}")
    _, block, nbytes = TENSOR_TYPES[ggml_type]
    if n_elements % block:
        raise GGUFError(f"{TENSOR_TYPES[ggml_type][0]} needs a multiple of {block} elements, got {n_elements}")
    return n_elements // block * nbytes


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# ---------------------------------------------------------------------------
# Typed metadata values. Plain Python values are typed by default rules
# (int -> UINT32 or INT32/UINT64/INT64 as needed, float -> FLOAT32, bool -> BOOL,
# str -> STRING, list -> ARRAY of the first element's type); wrap a value in
# Typed(...) to choose the type explicitly.
# ---------------------------------------------------------------------------
@dataclass
class Typed:
    vtype: int
    value: Any
    elem_type: int | None = None  # for ARRAY


def _infer(value: Any) -> Typed:
    if isinstance(value, Typed):
        return value
    if isinstance(value, bool):
        return Typed(BOOL, value)
    if isinstance(value, int):
        if 0 <= value < 2**32:
            return Typed(UINT32, value)
        if -(2**31) <= value < 2**31:
            return Typed(INT32, value)
        return Typed(UINT64 if value >= 0 else INT64, value)
    if isinstance(value, float):
        return Typed(FLOAT32, value)
    if isinstance(value, str):
        return Typed(STRING, value)
    if isinstance(value, (list, tuple)):
        if not value:
            raise GGUFError("an empty array needs an explicit Typed(ARRAY, [], elem_type)")
        first = _infer(value[0])
        return Typed(ARRAY, list(value), first.vtype)
    raise GGUFError(f"cannot store a {type(value).__name__} in GGUF metadata")


def _write_string(out: BinaryIO, s: str) -> None:
    b = s.encode("utf-8")
    out.write(struct.pack("<Q", len(b)))
    out.write(b)


def _write_value(out: BinaryIO, t: Typed) -> None:
    if t.vtype == STRING:
        _write_string(out, t.value)
    elif t.vtype == ARRAY:
        et = t.elem_type
        if et is None or et == ARRAY:
            raise GGUFError("arrays need a scalar or string element type")
        out.write(struct.pack("<IQ", et, len(t.value)))
        if et == STRING:
            for s in t.value:
                _write_string(out, s)
        else:
            fmt = "<" + str(len(t.value)) + _SCALAR_FMT[et][1]
            out.write(struct.pack(fmt, *t.value))
    else:
        out.write(struct.pack(_SCALAR_FMT[t.vtype], t.value))


# ---------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------
@dataclass
class _PendingTensor:
    name: str
    ne: tuple[int, ...]
    ggml_type: int
    data: bytes


class GGUFWriter:
    """Collect metadata and tensors, then write(path). Tensors are given as raw
    bytes already in their GGUF type (see quantize()/encode helpers below)."""

    def __init__(self, alignment: int = DEFAULT_ALIGNMENT):
        self.alignment = alignment
        self.kv: dict[str, Typed] = {}
        self.tensors: list[_PendingTensor] = []
        self.add("general.alignment", Typed(UINT32, alignment))

    def add(self, key: str, value: Any) -> None:
        if key in self.kv and key != "general.alignment":
            raise GGUFError(f"duplicate metadata key {key}")
        self.kv[key] = _infer(value)

    def add_tensor(self, name: str, ne: Iterable[int], ggml_type: int, data: bytes) -> None:
        ne = tuple(int(x) for x in ne)
        if any(t.name == name for t in self.tensors):
            raise GGUFError(f"duplicate tensor {name}")
        n = math.prod(ne)
        want = tensor_nbytes(ggml_type, n)
        if len(data) != want:
            raise GGUFError(f"tensor {name}: {len(data)} bytes given, {TENSOR_TYPES[ggml_type][0]} {ne} needs {want}")
        if ne and ne[0] % TENSOR_TYPES[ggml_type][1]:
            raise GGUFError(f"tensor {name}: row length {ne[0]} is not a multiple of the block size")
        self.tensors.append(_PendingTensor(name, ne, ggml_type, bytes(data)))

    def write(self, path: str) -> None:
        with open(path, "wb") as out:
            out.write(GGUF_MAGIC)
            out.write(struct.pack("<IQQ", GGUF_VERSION, len(self.tensors), len(self.kv)))
            for key, t in self.kv.items():
                _write_string(out, key)
                out.write(struct.pack("<I", t.vtype))
                _write_value(out, t)
            offset = 0
            offsets = []
            for t in self.tensors:
                offsets.append(offset)
                _write_string(out, t.name)
                out.write(struct.pack("<I", len(t.ne)))
                out.write(struct.pack("<" + "Q" * len(t.ne), *t.ne))
                out.write(struct.pack("<IQ", t.ggml_type, offset))
                offset = _align(offset + len(t.data), self.alignment)
            pos = out.tell()
            out.write(b"\0" * (_align(pos, self.alignment) - pos))
            data_start = out.tell()
            for t, off in zip(self.tensors, offsets):
                pad = data_start + off - out.tell()
                out.write(b"\0" * pad)
                out.write(t.data)


# ---------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------
@dataclass
class TensorInfo:
    name: str
    ne: tuple[int, ...]
    ggml_type: int
    offset: int          # absolute file offset of the data
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def type_name(self) -> str:
        return TENSOR_TYPES[self.ggml_type][0]


@dataclass
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    metadata_types: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    alignment: int = DEFAULT_ALIGNMENT

    def raw(self, name: str) -> bytes:
        t = self.tensor(name)
        with open(self.path, "rb") as f:
            f.seek(t.offset)
            b = f.read(t.n_bytes)
        if len(b) != t.n_bytes:
            raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file")
        return b

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: no tensor named {name}")
        return self.tensors[name]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: required metadata key {key} is missing")
        return self.metadata[key]

    def to_float32(self, name: str):
        """numpy float32 array shaped like PyTorch: ne reversed (out, in)."""
        t = self.tensor(name)
        flat = dequantize(self.raw(name), t.ggml_type, t.n_elements)
        return flat.reshape(tuple(reversed(t.ne)))


class _Cursor:
    def __init__(self, f: BinaryIO, path: str, size: int):
        self.f, self.path, self.size = f, path, size

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise GGUFError(f"{self.path}: truncated file (wanted {n} bytes at offset {self.f.tell() - len(b)})")
        return b

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        if n > self.size:
            raise GGUFError(f"{self.path}: string length {n} exceeds the file size")
        return self.read(n).decode("utf-8")

    def value(self, vtype: int):
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            et, n = self.unpack("<IQ")
            if n > self.size:
                raise GGUFError(f"{self.path}: array length {n} exceeds the file size")
            if et == STRING:
                return [self.string() for _ in range(n)]
            if et not in _SCALAR_FMT:
                raise GGUFError(f"{self.path}: unsupported array element type {et}")
            c = _SCALAR_FMT[et][1]
            return list(struct.unpack("<" + str(n) + c, self.read(n * struct.calcsize(c))))
        if vtype not in _SCALAR_FMT:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype}")
        return self.unpack(_SCALAR_FMT[vtype])[0]


def read(path: str) -> GGUFFile:
    """Parse header, metadata and tensor table; tensor data is read on demand."""
    import os

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        c = _Cursor(f, path, size)
        if c.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (bad magic)")
        (version,) = c.unpack("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} unsupported (want 2 or 3)")
        n_tensors, n_kv = c.unpack("<QQ")
        g = GGUFFile(path=path, version=version)
        for _ in range(n_kv):
            key = c.string()
            (vtype,) = c.unpack("<I")
            g.metadata[key] = c.value(vtype)
            g.metadata_types[key] = vtype
        g.alignment = int(g.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            (nd,) = c.unpack("<I")
            ne = c.unpack("<" + "Q" * nd)
            ggml_type, off = c.unpack("<IQ")
            infos.append((name, tuple(ne), ggml_type, off))
        data_start = _align(f.tell(), g.alignment)
        for name, ne, ggml_type, off in infos:
            nbytes = tensor_nbytes(ggml_type, math.prod(ne))
            if off % g.alignment:
                raise GGUFError(f"{path}: tensor {name} offset {off} is not aligned to {g.alignment}")
            if data_start + off + nbytes > size:
                raise GGUFError(f"{path}: tensor {name} runs past the end of the file")
            g.tensors[name] = TensorInfo(name, ne, ggml_type, data_start + off, nbytes)
    return g


# ---------------------------------------------------------------------------
# Encoding and decoding of tensor data.
# With numpy: arrays in, arrays out. Without: lists of floats (tests only).
# ---------------------------------------------------------------------------
def _round_half_away(x):
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def quantize(values, ggml_type: int) -> bytes:
    """Encode float values (flattened row-major, i.e. ne[0] fastest) to GGUF bytes."""
    if ggml_type in kquants.TYPES:  # pure Python either way
        return kquants.quantize([float(v) for v in (values.reshape(-1) if hasattr(values, "dtype") else values)],
                                ggml_type)
    if np is None or not hasattr(values, "dtype"):
        return _quantize_py([float(v) for v in values], ggml_type)
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if ggml_type == F32:
        return x.astype("<f4").tobytes()
    if ggml_type == F16:
        return x.astype("<f2").tobytes()
    if ggml_type == BF16:
        u = x.view(np.uint32).astype(np.uint64)
        # round to nearest even; NaN kept quiet
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(x)
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
        return r.astype("<u2").tobytes()
    if ggml_type == Q8_0:
        b = x.reshape(-1, 32)
        amax = np.abs(b).max(axis=1)
        d = amax / 127.0
        inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0).astype(np.float32)
        q = _round_half_away(b * inv[:, None]).astype(np.int8)
        out = np.zeros(b.shape[0], dtype=[("d", "<f2"), ("q", "i1", 32)])
        out["d"] = d.astype(np.float16)
        out["q"] = q
        return out.tobytes()
    if ggml_type == Q4_0:
        b = x.reshape(-1, 32)
        idx = np.abs(b).argmax(axis=1)
        mx = b[np.arange(b.shape[0]), idx]
        d = mx / -8.0
        inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1.0), 0.0).astype(np.float32)
        q = np.minimum(15, np.floor(b * inv[:, None] + 8.5)).astype(np.uint8)
        out = np.zeros(b.shape[0], dtype=[("d", "<f2"), ("q", "u1", 16)])
        out["d"] = d.astype(np.float16)
        out["q"] = q[:, :16] | (q[:, 16:] << 4)
        return out.tobytes()
    if ggml_type == Q1_0:
        b = x.reshape(-1, 128)
        d = np.abs(b).mean(axis=1)
        bits = (b >= 0).astype(np.uint8)
        packed = np.packbits(bits, axis=1, bitorder="little")
        out = np.zeros(b.shape[0], dtype=[("d", "<f2"), ("q", "u1", 16)])
        out["d"] = d.astype(np.float16)
        out["q"] = packed
        return out.tobytes()
    raise GGUFError(f"cannot encode tensor type {ggml_type}")


def dequantize(data: bytes, ggml_type: int, n_elements: int):
    """Decode GGUF tensor bytes to float32 (numpy array, or a list without numpy)."""
    want = tensor_nbytes(ggml_type, n_elements)
    if len(data) != want:
        raise GGUFError(f"{TENSOR_TYPES[ggml_type][0]}: {len(data)} bytes for {n_elements} elements, want {want}")
    if ggml_type in kquants.TYPES:
        vals = kquants.dequantize(data, ggml_type)
        return vals if np is None else np.array(vals, dtype=np.float32)
    if np is None:
        return _dequantize_py(data, ggml_type, n_elements)
    if ggml_type == F32:
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    if ggml_type == F16:
        return np.frombuffer(data, dtype="<f2").astype(np.float32)
    if ggml_type == BF16:
        u = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return u.view(np.float32)
    if ggml_type == Q8_0:
        blk = np.frombuffer(data, dtype=[("d", "<f2"), ("q", "i1", 32)])
        return (blk["d"].astype(np.float32)[:, None] * blk["q"].astype(np.float32)).reshape(-1)
    if ggml_type == Q4_0:
        blk = np.frombuffer(data, dtype=[("d", "<f2"), ("q", "u1", 16)])
        lo = (blk["q"] & 0x0F).astype(np.int32) - 8
        hi = (blk["q"] >> 4).astype(np.int32) - 8
        q = np.concatenate([lo, hi], axis=1).astype(np.float32)
        return (blk["d"].astype(np.float32)[:, None] * q).reshape(-1)
    if ggml_type == Q1_0:
        blk = np.frombuffer(data, dtype=[("d", "<f2"), ("q", "u1", 16)])
        bits = np.unpackbits(blk["q"], axis=1, bitorder="little").astype(np.float32)
        return (blk["d"].astype(np.float32)[:, None] * (2.0 * bits - 1.0)).reshape(-1)
    raise GGUFError(f"cannot decode tensor type {ggml_type}")


# Pure-Python reference paths (slow; for tests and numpy-less machines).
def _f32_to_bf16_bits(v: float) -> int:
    (u,) = struct.unpack("<I", struct.pack("<f", v))
    if v != v:
        return (u >> 16) | 0x40
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _py_round_half_away(v: float) -> int:
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def _quantize_py(x: list[float], ggml_type: int) -> bytes:
    out = bytearray()
    if ggml_type == F32:
        return struct.pack("<" + str(len(x)) + "f", *x)
    if ggml_type == F16:
        return struct.pack("<" + str(len(x)) + "e", *x)
    if ggml_type == BF16:
        return struct.pack("<" + str(len(x)) + "H", *[_f32_to_bf16_bits(v) for v in x])
    if ggml_type == Q8_0:
        for i in range(0, len(x), 32):
            b = [struct.unpack("<f", struct.pack("<f", v))[0] for v in x[i:i + 32]]
            d = max(abs(v) for v in b) / 127.0
            inv = 1.0 / d if d else 0.0
            out += struct.pack("<e", d)
            out += struct.pack("<32b", *[_py_round_half_away(v * inv) for v in b])
        return bytes(out)
    if ggml_type == Q4_0:
        for i in range(0, len(x), 32):
            b = x[i:i + 32]
            mx = max(b, key=abs)
            d = mx / -8.0
            inv = 1.0 / d if d else 0.0
            q = [min(15, int(math.floor(v * inv + 8.5))) for v in b]
            out += struct.pack("<e", d)
            out += bytes(q[j] | (q[j + 16] << 4) for j in range(16))
        return bytes(out)
    if ggml_type == Q1_0:
        for i in range(0, len(x), 128):
            b = x[i:i + 128]
            d = sum(abs(v) for v in b) / 128.0
            out += struct.pack("<e", d)
            for j in range(16):
                byte = 0
                for k in range(8):
                    if b[8 * j + k] >= 0:
                        byte |= 1 << k
                out.append(byte)
        return bytes(out)
    raise GGUFError(f"cannot encode tensor type {ggml_type}")


def _dequantize_py(data: bytes, ggml_type: int, n: int) -> list[float]:
    if ggml_type == F32:
        return list(struct.unpack("<" + str(n) + "f", data))
    if ggml_type == F16:
        return list(struct.unpack("<" + str(n) + "e", data))
    if ggml_type == BF16:
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in struct.unpack("<" + str(n) + "H", data)]
    out: list[float] = []
    if ggml_type == Q8_0:
        for o in range(0, len(data), 34):
            (d,) = struct.unpack_from("<e", data, o)
            out += [d * q for q in struct.unpack_from("<32b", data, o + 2)]
        return out
    if ggml_type == Q4_0:
        for o in range(0, len(data), 18):
            (d,) = struct.unpack_from("<e", data, o)
            qs = data[o + 2:o + 18]
            out += [d * ((q & 0xF) - 8) for q in qs] + [d * ((q >> 4) - 8) for q in qs]
        return out
    if ggml_type == Q1_0:
        for o in range(0, len(data), 18):
            (d,) = struct.unpack_from("<e", data, o)
            qs = data[o + 2:o + 18]
            out += [d if (qs[i // 8] >> (i % 8)) & 1 else -d for i in range(128)]
        return out
    raise GGUFError(f"cannot decode tensor type {ggml_type}")

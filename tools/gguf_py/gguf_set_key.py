#!/usr/bin/env python3
"""Add (or replace) one string metadata key of a GGUF file, copying everything
else byte for byte: the other keys, the tensor table and the tensor data
(only the padding before the data section may change).

    python3 tools/gguf_py/gguf_set_key.py IN.gguf OUT.gguf KEY VALUE

Used to record kvq.tokenizer.normalizer in models/kvq-tiny-code.gguf, whose
tokenizer.json states `"normalizer": null`.
"""

from __future__ import annotations

import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvq_gguf as g  # noqa: E402


def _skip_value(c: g._Cursor, vtype: int) -> None:
    c.value(vtype)


def set_string_key(src: str, dst: str, key: str, value: str) -> None:
    size = os.path.getsize(src)
    with open(src, "rb") as f:
        c = g._Cursor(f, src, size)
        if c.read(4) != g.GGUF_MAGIC:
            raise g.GGUFError(f"{src}: not a GGUF file")
        (version,) = c.unpack("<I")
        n_tensors, n_kv = c.unpack("<QQ")
        records = []  # raw bytes of each kv record, in order
        alignment = g.DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            start = f.tell()
            k = c.string()
            (vtype,) = c.unpack("<I")
            v = c.value(vtype)
            if k == "general.alignment":
                alignment = int(v)
            end = f.tell()
            f.seek(start)
            records.append((k, f.read(end - start)))
        tinfo_start = f.tell()
        for _ in range(n_tensors):
            c.string()
            (nd,) = c.unpack("<I")
            c.unpack("<" + "Q" * nd)
            c.unpack("<IQ")
        tinfo_end = f.tell()
        f.seek(tinfo_start)
        tinfo = f.read(tinfo_end - tinfo_start)
        data_start = g._align(tinfo_end, alignment)
        f.seek(data_start)
        data = f.read()

    kb = key.encode("utf-8")
    vb = value.encode("utf-8")
    new_record = struct.pack("<Q", len(kb)) + kb + struct.pack("<I", g.STRING) + struct.pack("<Q", len(vb)) + vb
    records = [(k, r) for k, r in records if k != key] + [(key, new_record)]
    header = g.GGUF_MAGIC + struct.pack("<IQQ", version, n_tensors, len(records))
    body = header + b"".join(r for _, r in records) + tinfo
    body += b"\0" * (g._align(len(body), alignment) - len(body))
    tmp = dst + ".tmp"
    with open(tmp, "wb") as out:
        out.write(body)
        out.write(data)
    os.replace(tmp, dst)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    set_string_key(*sys.argv[1:5])

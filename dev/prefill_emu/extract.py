# Extracts the device code of attention_prefill.cu for the host emulator
# (emu.cpp): from the first constant to the host launch code, minus the inline
# PTX helpers, which emu.cpp re-implements. Fails loudly if the markers or the
# helpers move, or if any asm is left.
# usage: extract.py attention_prefill.cu out.inc
import re, sys
src = open(sys.argv[1]).read()
start = src.index("constexpr int kThreads = 128;")
end = src.index("int current_device()")
body = src[start:end]
helpers = ["smem_u32", "cp_async_16", "cp_async_commit", "cp_async_wait", "ldmatrix_x4", "ldmatrix_x4_trans",
           "mma_bf16", "pack_bf16", "fast_exp2"]
def remove_fn(text, name):
    # find "... name(" definition preceded by __device__ __forceinline__ (maybe with template line)
    m = re.search(r"(template <int kPending>\n)?__device__ __forceinline__ [^\n(]*\b" + name + r"\(", text)
    assert m, name
    i = text.index("{", m.end())
    depth = 0
    j = i
    while True:
        if text[j] == "{": depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0: break
        j += 1
    return text[:m.start()] + text[j+1:]
for h in helpers:
    body = remove_fn(body, h)
assert "asm" not in body, body[body.index("asm")-200: body.index("asm")+100]
open(sys.argv[2], "w").write(body)

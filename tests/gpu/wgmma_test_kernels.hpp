// Host entry points of the test-only kernels in wgmma_test_kernels.cu: the
// two warpgroup-MMA products of the Hopper prefill attention
// (backend/cuda/wgmma.cuh, attention_prefill.cu) alone, on one 64-row tile,
// with the operands in the 128-byte-swizzle layout written out again here.
#pragma once

#include <cstdint>

namespace kvq::gputest {

// True when this binary's device code was compiled for sm_90a (wgmma) and a
// device that runs it is current; the products below need it.
bool wgmma_device_code();

// c[64][64] = a[64][128] . b[64][128]^T: 8 x m64n64k16, both operands
// K-major in shared memory (the prefill kernel's S = Q K^T). a, b: bf16 bits,
// row-major; c fp32 row-major. Device pointers; synchronous.
void wgmma_qk_product(const uint16_t* a, const uint16_t* b, float* c);

// c[64][128] = p[64][64] . v[64][128]: 4 x m64n128k16, p from registers (the
// m16n8k16 A fragment), v N-major in shared memory (the prefill kernel's
// O += P V). Device pointers; synchronous.
void wgmma_pv_product(const uint16_t* p, const uint16_t* v, float* c);

}  // namespace kvq::gputest

#include "backend/cpu/kernels.hpp"

#include <omp.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "core/half.hpp"

// Hot loops are compiled twice on x86-64: for AVX2/FMA/F16C (x86-64-v3) and
// for the baseline, chosen once at load time. Same arithmetic, so results
// differ between the two only by fp32 rounding (FMA), never in meaning.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVQ_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KVQ_SIMD_CLONES
#endif

namespace kvq::cpu {

using gguf::TensorType;

namespace {

// fp16 -> fp32 for every bit pattern: a table lookup vectorizes (gather),
// the bit-twiddling conversion does not.
const float* f16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; ++h) t[h] = f16_to_f32(uint16_t(h));
    return t;
  }();
  return table.data();
}

// The eight signs (+1 / -1) encoded by one byte of Q1_0 bits, LSB first.
struct SignTable {
  alignas(32) float s[256][8];
  SignTable() {
    for (int b = 0; b < 256; ++b)
      for (int k = 0; k < 8; ++k) s[b][k] = ((b >> k) & 1) ? 1.0f : -1.0f;
  }
};
const SignTable& sign_table() {
  static const SignTable t;
  return t;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx,f16c"))) void f16_to_f32_row_f16c(const uint16_t* h, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) dst[i] = f16_to_f32(h[i]);
}
const bool kHaveF16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#endif

#if defined(__x86_64__) && defined(__GNUC__)
const bool kHaveAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");

__attribute__((target("avx2,fma,f16c"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Q8_0 row . x: per block, 4 x 8 int8 -> fp32 lanes times x, scaled by d.
__attribute__((target("avx2,fma,f16c"))) float dot_q8_0_avx2(const uint8_t* row, const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < n / 32; ++b, row += 34, x += 32) {
    std::swap(acc, acc1);  // alternate accumulators: two FMA chains in flight
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(uint16_t(row[0] | (row[1] << 8))));
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 18));
    __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), _mm256_loadu_ps(x + 16), s);
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), _mm256_loadu_ps(x + 24), s);
    acc = _mm256_fmadd_ps(d, s, acc);
  }
  return hsum256(_mm256_add_ps(acc, acc1));
}

// Q4_0 row . x: low nibbles are weights 0..15, high nibbles 16..31, minus 8.
__attribute__((target("avx2,fma,f16c"))) float dot_q4_0_avx2(const uint8_t* row, const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i eight = _mm_set1_epi8(8);
  for (int64_t b = 0; b < n / 32; ++b, row += 18, x += 32) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(uint16_t(row[0] | (row[1] << 8))));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2));
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, mask), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), mask), eight);
    __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(x + 16), s);
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(x + 24), s);
    acc = _mm256_fmadd_ps(d, s, acc);
  }
  return hsum256(acc);
}

// Q1_0 row . x: each byte's 8 bits select +x or -x (sign flip where the bit is 0).
__attribute__((target("avx2,fma,f16c"))) float dot_q1_0_avx2(const uint8_t* row, const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i sign = _mm256_set1_epi32(int(0x80000000u));
  for (int64_t b = 0; b < n / 128; ++b, row += 18, x += 128) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(uint16_t(row[0] | (row[1] << 8))));
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int j = 0; j < 16; j += 2) {
      const __m256i m0 = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(row[2 + j]), bit), _mm256_setzero_si256());
      const __m256i m1 = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(row[3 + j]), bit), _mm256_setzero_si256());
      s0 = _mm256_add_ps(s0, _mm256_xor_ps(_mm256_loadu_ps(x + 8 * j), _mm256_castsi256_ps(_mm256_and_si256(m0, sign))));
      s1 = _mm256_add_ps(s1, _mm256_xor_ps(_mm256_loadu_ps(x + 8 * j + 8), _mm256_castsi256_ps(_mm256_and_si256(m1, sign))));
    }
    acc = _mm256_fmadd_ps(d, _mm256_add_ps(s0, s1), acc);
  }
  return hsum256(acc);
}
#endif

void f16_to_f32_row(const uint16_t* h, float* dst, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (kHaveF16c) return f16_to_f32_row_f16c(h, dst, n);
#endif
  const float* tab = f16_table();
  for (int64_t i = 0; i < n; ++i) dst[i] = tab[h[i]];
}

}  // namespace

bool supports_weight_type(TensorType t) {
  switch (t) {
    case TensorType::F32:
    case TensorType::F16:
    case TensorType::BF16:
    case TensorType::Q8_0:
    case TensorType::Q4_0:
    case TensorType::Q1_0:
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K:
      return true;
  }
  return false;
}

const char* supported_weight_types() { return "F32, F16, BF16, Q8_0, Q4_0, Q1_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"; }

int block_size(TensorType t) {
  switch (t) {
    case TensorType::F32:
    case TensorType::F16:
    case TensorType::BF16: return 1;
    case TensorType::Q8_0:
    case TensorType::Q4_0: return 32;
    case TensorType::Q1_0: return 128;
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K: return 256;
  }
  fail(Errc::unsupported, "weight type id ", uint32_t(t), " is not supported by the CPU backend (supported: ",
       supported_weight_types(), ")");
}

size_t block_bytes(TensorType t) {
  switch (t) {
    case TensorType::F32: return 4;
    case TensorType::F16:
    case TensorType::BF16: return 2;
    case TensorType::Q8_0: return 34;
    case TensorType::Q4_0: return 18;
    case TensorType::Q1_0: return 18;
    case TensorType::Q2_K: return 84;
    case TensorType::Q3_K: return 110;
    case TensorType::Q4_K: return 144;
    case TensorType::Q5_K: return 176;
    case TensorType::Q6_K: return 210;
  }
  fail(Errc::unsupported, "weight type id ", uint32_t(t), " is not supported by the CPU backend (supported: ",
       supported_weight_types(), ")");
}

size_t row_bytes(TensorType t, int64_t n) {
  const int bs = block_size(t);
  KVQ_CHECK(n % bs == 0, Errc::format, "a row of ", n, " weights is not a whole number of ", bs,
            "-weight blocks");
  return size_t(n / bs) * block_bytes(t);
}

namespace {

inline uint16_t load_u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
inline float load_f16(const uint8_t* p) { return f16_to_f32(load_u16(p)); }

// Dequantizes one block of a quantized type into 32 / 128 floats.
inline void dequant_q8_0(const uint8_t* b, float* dst) {
  const float d = load_f16(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int i = 0; i < 32; ++i) dst[i] = d * float(q[i]);
}
inline void dequant_q4_0(const uint8_t* b, float* dst) {
  const float d = load_f16(b);
  const uint8_t* q = b + 2;
  for (int j = 0; j < 16; ++j) {
    dst[j] = d * float(int(q[j] & 15) - 8);
    dst[j + 16] = d * float(int(q[j] >> 4) - 8);
  }
}

// K-quant super-blocks (256 weights; layouts in gguf/quant.hpp) in two
// vectorizable passes (the unpacking is always inlined, so it is vectorized
// for the caller's target and its byte stores are wide enough for the loads
// of the second pass to forward from them): the codes are unpacked into signed bytes (offsets such
// as Q6_K's -32 applied), then y = s[k] * q - o[k] over each run of 16
// weights k. Each weight is (d * sc) * q - (dmin * m) in fp32, bit for bit
// what the reference computes.
struct KBlock {
  alignas(32) int8_t q[256];
  float s[16], o[16];
};

#if defined(__x86_64__) && defined(__GNUC__)
// s * q is exact in fp32 for every K-quant except Q6_K, whose o is 0, so the
// fused multiply-subtract rounds exactly as s * q - o does.
__attribute__((target("avx2,fma"))) void k_scale_avx2(const KBlock& kb, float* y) {
  for (int k = 0; k < 16; ++k) {
    const __m256 s = _mm256_set1_ps(kb.s[k]), o = _mm256_set1_ps(kb.o[k]);
    const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(kb.q + 16 * k));
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
    _mm256_storeu_ps(y + 16 * k, _mm256_fmsub_ps(s, q0, o));
    _mm256_storeu_ps(y + 16 * k + 8, _mm256_fmsub_ps(s, q1, o));
  }
}
#endif

#if defined(__x86_64__) && defined(__GNUC__)
// Sum over the super-block of (s * q - o) * x, into two accumulators.
__attribute__((target("avx2,fma"))) inline void k_dot_avx2(const KBlock& kb, const float* x, __m256& acc0,
                                                           __m256& acc1) {
  for (int k = 0; k < 16; ++k) {
    const __m256 s = _mm256_set1_ps(kb.s[k]), o = _mm256_set1_ps(kb.o[k]);
    const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(kb.q + 16 * k));
    const __m256 w0 = _mm256_fmsub_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), o);
    const __m256 w1 = _mm256_fmsub_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), o);
    acc0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + 16 * k), acc0);
    acc1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 16 * k + 8), acc1);
  }
}
#endif

void k_scale(const KBlock& kb, float* __restrict y) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (kHaveAvx2) return k_scale_avx2(kb, y);
#endif
  for (int k = 0; k < 16; ++k) {
    const float s = kb.s[k], o = kb.o[k];
    for (int l = 0; l < 16; ++l) y[16 * k + l] = s * float(kb.q[16 * k + l]) - o;
  }
}

// Q4_K/Q5_K: 6-bit scale and min of sub-block s (0..7), as the per-16 runs 2s and 2s+1.
__attribute__((always_inline)) inline void k4_scales(const uint8_t* b, KBlock& kb) {
  const float d = load_f16(b), dmin = load_f16(b + 2);
  const uint8_t* sm = b + 4;
  for (int s = 0; s < 8; ++s) {
    const int sc = s < 4 ? sm[s] & 63 : (sm[s + 4] & 15) | ((sm[s - 4] >> 6) << 4);
    const int m = s < 4 ? sm[s + 4] & 63 : (sm[s + 4] >> 4) | ((sm[s] >> 6) << 4);
    kb.s[2 * s] = kb.s[2 * s + 1] = d * float(sc);
    kb.o[2 * s] = kb.o[2 * s + 1] = dmin * float(m);
  }
}

__attribute__((always_inline)) inline void unpack_q4_k(const uint8_t* __restrict b, KBlock& kb) {
  k4_scales(b, kb);
  const uint8_t* __restrict qs = b + 16;
  for (int p = 0; p < 4; ++p)
    for (int l = 0; l < 32; ++l) {
      kb.q[64 * p + l] = int8_t(qs[32 * p + l] & 15);
      kb.q[64 * p + 32 + l] = int8_t(qs[32 * p + l] >> 4);
    }
}

__attribute__((always_inline)) inline void unpack_q5_k(const uint8_t* __restrict b, KBlock& kb) {
  k4_scales(b, kb);
  const uint8_t* __restrict qh = b + 16;
  const uint8_t* __restrict qs = b + 48;
  for (int p = 0; p < 4; ++p)
    for (int l = 0; l < 32; ++l) {
      kb.q[64 * p + l] = int8_t((qs[32 * p + l] & 15) | (((qh[l] >> (2 * p)) & 1) << 4));
      kb.q[64 * p + 32 + l] = int8_t((qs[32 * p + l] >> 4) | (((qh[l] >> (2 * p + 1)) & 1) << 4));
    }
}

__attribute__((always_inline)) inline void unpack_q6_k(const uint8_t* __restrict b, KBlock& kb) {
  const float d = load_f16(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int k = 0; k < 16; ++k) {
    kb.s[k] = d * float(sc[k]);
    kb.o[k] = 0.0f;
  }
  for (int h = 0; h < 2; ++h) {
    const uint8_t* __restrict ql = b + 64 * h;
    const uint8_t* __restrict qh = b + 128 + 32 * h;
    int8_t* __restrict q = kb.q + 128 * h;
    for (int l = 0; l < 32; ++l) {
      q[l] = int8_t(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
      q[32 + l] = int8_t(((ql[32 + l] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
      q[64 + l] = int8_t(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      q[96 + l] = int8_t(((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
  }
}

__attribute__((always_inline)) inline void unpack_q2_k(const uint8_t* __restrict b, KBlock& kb) {
  const float d = load_f16(b + 80), dmin = load_f16(b + 82);
  for (int k = 0; k < 16; ++k) {
    kb.s[k] = d * float(b[k] & 15);
    kb.o[k] = dmin * float(b[k] >> 4);
  }
  for (int n = 0; n < 2; ++n) {
    const uint8_t* __restrict qs = b + 16 + 32 * n;
    int8_t* __restrict q = kb.q + 128 * n;
    for (int l = 0; l < 32; ++l) {
      q[l] = int8_t(qs[l] & 3);
      q[32 + l] = int8_t((qs[l] >> 2) & 3);
      q[64 + l] = int8_t((qs[l] >> 4) & 3);
      q[96 + l] = int8_t(qs[l] >> 6);
    }
  }
}

__attribute__((always_inline)) inline void unpack_q3_k(const uint8_t* __restrict b, KBlock& kb) {
  const float d = load_f16(b + 108);
  const uint8_t* sc12 = b + 96;
  for (int k = 0; k < 16; ++k) {
    const int low = k < 8 ? sc12[k] & 15 : sc12[k - 8] >> 4;
    kb.s[k] = d * float((low | (((sc12[8 + k % 4] >> (2 * (k / 4))) & 3) << 4)) - 32);
    kb.o[k] = 0.0f;
  }
  const uint8_t* __restrict hm = b;
  for (int n = 0; n < 2; ++n) {
    const uint8_t* __restrict qs = b + 32 + 32 * n;
    int8_t* __restrict q = kb.q + 128 * n;
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l)
        q[32 * j + l] = int8_t((((qs[l] >> (2 * j)) & 3) | (((hm[l] >> (4 * n + j)) & 1) << 2)) - 4);
  }
}

__attribute__((always_inline)) inline void unpack_k(TensorType t, const uint8_t* b, KBlock& kb) {
  switch (t) {
    case TensorType::Q2_K: unpack_q2_k(b, kb); break;
    case TensorType::Q3_K: unpack_q3_k(b, kb); break;
    case TensorType::Q4_K: unpack_q4_k(b, kb); break;
    case TensorType::Q5_K: unpack_q5_k(b, kb); break;
    default: unpack_q6_k(b, kb); break;
  }
}

constexpr size_t k_block_bytes(TensorType t) {
  return t == TensorType::Q2_K   ? 84
         : t == TensorType::Q3_K ? 110
         : t == TensorType::Q4_K ? 144
         : t == TensorType::Q5_K ? 176
                                 : 210;
}

// Dequantizes n / 256 super-blocks of a K-quant.
KVQ_SIMD_CLONES
void dequant_k(TensorType t, const uint8_t* src, float* dst, int64_t n) {
  KBlock kb;
  for (int64_t blk = 0; blk < n / 256; ++blk) {
    unpack_k(t, src + k_block_bytes(t) * blk, kb);
    k_scale(kb, dst + 256 * blk);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma,f16c"))) float dot_k_avx2(TensorType t, const uint8_t* row, const float* x,
                                                          int64_t n) {
  KBlock kb;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < n / 256; ++blk) {
    unpack_k(t, row + k_block_bytes(t) * blk, kb);
    k_dot_avx2(kb, x + 256 * blk, acc0, acc1);
  }
  return hsum256(_mm256_add_ps(acc0, acc1));
}
#endif

// Row . x for a K-quant: on AVX2 the dequantized weights never leave registers.
float dot_k(TensorType t, const uint8_t* row, const float* x, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (kHaveAvx2) return dot_k_avx2(t, row, x, n);
#endif
  KBlock kb;
  alignas(64) float w[256];
  float s = 0.0f;
  for (int64_t blk = 0; blk < n / 256; ++blk) {
    unpack_k(t, row + k_block_bytes(t) * blk, kb);
    k_scale(kb, w);
    s += dot_f32(w, x + 256 * blk, 256);
  }
  return s;
}

}  // namespace

KVQ_SIMD_CLONES
void dequantize_row(TensorType t, const uint8_t* src, float* dst, int64_t n) {
  switch (t) {
    case TensorType::F32:
      std::copy_n(reinterpret_cast<const float*>(src), n, dst);
      return;
    case TensorType::F16:
      f16_to_f32_row(reinterpret_cast<const uint16_t*>(src), dst, n);
      return;
    case TensorType::BF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bits_f32(uint32_t(h[i]) << 16);
      return;
    }
    case TensorType::Q8_0:
      for (int64_t b = 0; b < n / 32; ++b) dequant_q8_0(src + 34 * b, dst + 32 * b);
      return;
    case TensorType::Q4_0:
      for (int64_t b = 0; b < n / 32; ++b) dequant_q4_0(src + 18 * b, dst + 32 * b);
      return;
    case TensorType::Q1_0: {
      const SignTable& st = sign_table();
      for (int64_t b = 0; b < n / 128; ++b) {
        const uint8_t* blk = src + 18 * b;
        const float d = load_f16(blk);
        float* o = dst + 128 * b;
        for (int j = 0; j < 16; ++j)
          for (int k = 0; k < 8; ++k) o[8 * j + k] = d * st.s[blk[2 + j]][k];
      }
      return;
    }
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K:
      dequant_k(t, src, dst, n);
      return;
  }
  block_size(t);  // throws the "unsupported" error
}

KVQ_SIMD_CLONES
float dot_f32(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

namespace {
// Dequantizing a few blocks into an L1-resident buffer and then running the
// fp32 dot keeps both loops vectorizable (a fused int8/nibble/fp16 loop is not,
// for want of cheap conversions inside a reduction).
float dot_via_dequant(TensorType t, const uint8_t* row, const float* x, int64_t n) {
  constexpr int64_t kChunk = 256;  // a multiple of every block size
  alignas(64) float tmp[kChunk];
  const size_t chunk_bytes = row_bytes(t, kChunk);
  float s = 0.0f;
  int64_t off = 0;
  for (; off + kChunk <= n; off += kChunk, row += chunk_bytes) {
    dequantize_row(t, row, tmp, kChunk);
    s += dot_f32(tmp, x + off, kChunk);
  }
  if (off < n) {
    dequantize_row(t, row, tmp, n - off);
    s += dot_f32(tmp, x + off, n - off);
  }
  return s;
}
}  // namespace

KVQ_SIMD_CLONES
float dot_row(TensorType t, const uint8_t* row, const float* x, int64_t n) {
  switch (t) {
    case TensorType::F32:
      return dot_f32(reinterpret_cast<const float*>(row), x, n);
    case TensorType::F16:
      return dot_via_dequant(t, row, x, n);
    case TensorType::BF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < n; ++i) s += bits_f32(uint32_t(h[i]) << 16) * x[i];
      return s;
    }
    case TensorType::Q8_0:
#if defined(__x86_64__) && defined(__GNUC__)
      if (kHaveAvx2) return dot_q8_0_avx2(row, x, n);
#endif
      return dot_via_dequant(t, row, x, n);
    case TensorType::Q4_0:
#if defined(__x86_64__) && defined(__GNUC__)
      if (kHaveAvx2) return dot_q4_0_avx2(row, x, n);
#endif
      return dot_via_dequant(t, row, x, n);
    case TensorType::Q1_0: {
#if defined(__x86_64__) && defined(__GNUC__)
      if (kHaveAvx2) return dot_q1_0_avx2(row, x, n);
#endif
      float s = 0.0f;
      for (int64_t b = 0; b < n / 128; ++b) {
        const uint8_t* blk = row + 18 * b;
        const uint8_t* bits = blk + 2;
        const float* xb = x + 128 * b;
        const SignTable& st = sign_table();
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int j = 0; j < 16; ++j) {
          const float* sg = st.s[bits[j]];
#pragma omp simd
          for (int k = 0; k < 8; ++k) acc[k] += sg[k] * xb[8 * j + k];
        }
        float sb = 0.0f;
        for (int k = 0; k < 8; ++k) sb += acc[k];
        s += load_f16(blk) * sb;
      }
      return s;
    }
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K:
      return dot_k(t, row, x, n);
  }
  block_size(t);  // throws
  return 0.0f;
}

namespace {

// Four rows against one vector: x is loaded once for four outputs.
KVQ_SIMD_CLONES
void dot4_f32(const float* w, int64_t stride, const float* x, int64_t n, float* out) {
  const float* w0 = w;
  const float* w1 = w + stride;
  const float* w2 = w + 2 * stride;
  const float* w3 = w + 3 * stride;
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    s0 += w0[i] * xi;
    s1 += w1[i] * xi;
    s2 += w2[i] * xi;
    s3 += w3[i] * xi;
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

// Below this much work (multiply-adds) a parallel region costs more than it
// saves: thread wake-ups dominate, and on a busy machine a descheduled thread
// stalls the whole barrier. Small models then run single-threaded.
constexpr int64_t kParallelMinWork = int64_t(1) << 18;

// Up to this many tokens every output is dot_row(row, token): its value then
// does not depend on how many tokens share the call, so a decode step of B
// sequences gives each sequence exactly what it gets alone (the step batch's
// oracle property, tests/test_step_batch.cpp). Longer calls (prefill chunks)
// dequantize a tile of rows once for all their tokens, which rounds the sums
// differently.
constexpr int kRowwiseMaxTokens = 64;
constexpr int64_t kTileRows = 16;  // multiple of 4

}  // namespace

void matmul(const Matrix& w, const float* x, int n_tokens, float* y) {
  const int64_t rows = w.rows, cols = w.cols;
  if (n_tokens <= 0 || rows == 0) return;
  const bool parallel = rows * cols * n_tokens >= kParallelMinWork;
  if (n_tokens <= kRowwiseMaxTokens) {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t r = 0; r < rows; ++r)
      for (int t = 0; t < n_tokens; ++t) y[size_t(t) * rows + r] = dot_row(w.type, w.row(r), x + size_t(t) * cols, cols);
    return;
  }
  const int64_t n_tiles = (rows + kTileRows - 1) / kTileRows;
  const bool is_f32 = w.type == TensorType::F32;
#pragma omp parallel if (parallel)
  {
    std::vector<float> tile_store(is_f32 ? 0 : size_t(kTileRows * cols));
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < n_tiles; ++tile) {
      const int64_t r0 = tile * kTileRows;
      const int64_t nr = std::min(kTileRows, rows - r0);
      const float* tw;
      if (is_f32) {
        tw = reinterpret_cast<const float*>(w.row(r0));
      } else {
        for (int64_t r = 0; r < nr; ++r) dequantize_row(w.type, w.row(r0 + r), tile_store.data() + r * cols, cols);
        tw = tile_store.data();
      }
      const int64_t stride = is_f32 ? int64_t(w.row_bytes / 4) : cols;
      for (int t = 0; t < n_tokens; ++t) {
        const float* xt = x + size_t(t) * cols;
        float* yt = y + size_t(t) * rows + r0;
        int64_t r = 0;
        for (; r + 4 <= nr; r += 4) dot4_f32(tw + r * stride, stride, xt, cols, yt + r);
        for (; r < nr; ++r) yt[r] = dot_f32(tw + r * stride, xt, cols);
      }
    }
  }
}

void rms_norm(const float* x, const float* weight, int n_rows, int dim, float eps, float* y) {
#pragma omp parallel for schedule(static) if (int64_t(n_rows) * dim >= kParallelMinWork)
  for (int r = 0; r < n_rows; ++r) {
    const float* xr = x + size_t(r) * dim;
    float* yr = y + size_t(r) * dim;
    double ss = 0.0;
    for (int i = 0; i < dim; ++i) ss += double(xr[i]) * xr[i];
    const float inv = float(1.0 / std::sqrt(ss / dim + double(eps)));
    for (int i = 0; i < dim; ++i) yr[i] = xr[i] * inv * weight[i];
  }
}

void rope(float* x, int n_tokens, int n_heads, int head_dim, int pos, const Rope& rope) {
  const int half = head_dim / 2;
  KVQ_CHECK(int(rope.inv_freq.size()) == half, Errc::internal, "rope: ", rope.inv_freq.size(),
            " frequencies for head_dim ", head_dim);
#pragma omp parallel for schedule(static) if (int64_t(n_tokens) * n_heads * head_dim >= kParallelMinWork)
  for (int t = 0; t < n_tokens; ++t) {
    std::vector<float> c(half), s(half);
    const double p = double(pos + t) * rope.pos_scale;
    for (int i = 0; i < half; ++i) {
      const double a = p * double(rope.inv_freq[i]);
      c[i] = float(std::cos(a));
      s[i] = float(std::sin(a));
    }
    for (int h = 0; h < n_heads; ++h) {
      float* v = x + (size_t(t) * n_heads + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const int i0 = rope.neox ? i : 2 * i;
        const int i1 = rope.neox ? i + half : 2 * i + 1;
        const float x0 = v[i0], x1 = v[i1];
        v[i0] = x0 * c[i] - x1 * s[i];
        v[i1] = x0 * s[i] + x1 * c[i];
      }
    }
  }
}

void swiglu(const float* gate, const float* up, float* out, size_t n) {
#pragma omp parallel for simd schedule(static) if (int64_t(n) >= kParallelMinWork)
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void add(float* x, const float* y, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) x[i] += y[i];
}

void softmax(float* x, int64_t n) {
  if (n <= 0) return;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  if (m == -std::numeric_limits<float>::infinity()) {  // nothing allowed: uniform is the only sane answer
    for (int64_t i = 0; i < n; ++i) x[i] = 1.0f / float(n);
    return;
  }
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  const float inv = float(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

KVQ_SIMD_CLONES
void attention_f32(const float* q, const float* k, const float* v, int pos, int n, int n_heads,
                   int n_kv_heads, int head_dim, float scale, float* out) {
  KVQ_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, Errc::internal, "attention: ", n_heads,
            " query heads are not a multiple of ", n_kv_heads, " KV heads");
  const int group = n_heads / n_kv_heads;
  const size_t kv_stride = size_t(n_kv_heads) * head_dim;
  const int64_t work = int64_t(n) * (pos + n) * n_heads * head_dim * 2;
#pragma omp parallel if (work >= kParallelMinWork)
  {
    std::vector<float> p(size_t(pos + n));
    std::vector<float> acc(head_dim);
#pragma omp for collapse(2) schedule(static)
    for (int t = 0; t < n; ++t) {
      for (int h = 0; h < n_heads; ++h) {
        const int kvh = h / group;
        const int n_ctx = pos + t + 1;
        const float* qh = q + (size_t(t) * n_heads + h) * head_dim;
        for (int j = 0; j < n_ctx; ++j) {
          const float* kj = k + j * kv_stride + size_t(kvh) * head_dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < head_dim; ++d) dot += qh[d] * kj[d];
          p[j] = dot * scale;
        }
        softmax(p.data(), n_ctx);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int j = 0; j < n_ctx; ++j) {
          const float* vj = v + j * kv_stride + size_t(kvh) * head_dim;
          const float pj = p[j];
#pragma omp simd
          for (int d = 0; d < head_dim; ++d) acc[d] += pj * vj[d];
        }
        std::copy(acc.begin(), acc.end(), out + (size_t(t) * n_heads + h) * head_dim);
      }
    }
  }
}

}  // namespace kvq::cpu

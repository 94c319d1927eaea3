// K-quant GEMV kernels; see gemv_kquant.hpp for the work split and
// backend/gpu_layout.hpp / gguf/quant.hpp for the record layouts.
//
// The input is staged as int8 per 32 values with code sums per 16
// (gemv_stage.cuh), as the Q8_0/Q4_0/Q1_0 kernels stage it; each lane turns
// its codes of a run of 16 weights into 16 bytes (masks and shifts, no
// per-weight conversion) and dots them with the staged codes by dp4a. A run
// shares one scale (and one min or offset), so its sum is exact in int32 and
// the record's scales are applied once per run in fp32:
//   sum_i (d sc q_i - dmin m) x_i = s_x (d sc dot(q, u) - dmin m sum(u))
// for x_i = s_x u_i (s_x: the scale of u's group of 32). Offsets (Q6_K's
// q - 32, Q3_K's q - 4) enter as dot(q + o, u) - o sum(u), so the bytes stay
// non-negative.
// Bytes of a 16-byte chunk held in registers are picked with constant
// indices after unrolling (byte_of), or with selects, never through a
// dynamically indexed local array.
#include "backend/cuda/gemv_kquant.hpp"

#include <cuda_fp16.h>

#include <algorithm>
#include <map>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/gemv_args.cuh"
#include "backend/cuda/gemv_stage.cuh"
#include "backend/cuda/occupancy.hpp"
#include "backend/cuda/kquant.cuh"
#include "backend/cuda/lab_trace.cuh"
#include "core/error.hpp"

namespace kvq::cuda {

using gguf::TensorType;

namespace {

using KArgs = gemv_detail::KernelArgs;
using gemv_detail::kMaxOut;
using gemv_detail::kMaxWarps;
using gemv_detail::Staged;
using gemv_detail::load_weights16;

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ int byte_of(const uint4& v, int k) { return int((word_of(v, k >> 2) >> (8 * (k & 3))) & 0xffu); }

__device__ __forceinline__ float half_at(const uint16_t* p) { return __half2float(__ushort_as_half(__ldg(p))); }


constexpr uint32_t kLow4 = 0x0f0f0f0fu, kLow2 = 0x03030303u, kBit0 = 0x01010101u;

// dp4a of a run of 16 weights, given as four words of 4 code bytes each
// (bytes(k) for k = 0..3, the weights 4k..4k+3 of the run), with the 16
// staged codes u of the same columns.
template <class Bytes>
__device__ __forceinline__ int dot_run(const int4& u, Bytes bytes) {
  int acc = __dp4a(int(bytes(0)), u.x, 0);
  acc = __dp4a(int(bytes(1)), u.y, acc);
  acc = __dp4a(int(bytes(2)), u.z, acc);
  return __dp4a(int(bytes(3)), u.w, acc);
}

// Where the staged 16-byte unit i (input columns 16i..16i+15) lives in
// shared memory, per lane mapping: the 8 lanes of a shared-memory phase (a
// quarter warp, 16 bytes each) must read 8 distinct bank groups (unit mod 8).
// Q4_K/Q5_K: a phase is one super-block's 8 lanes, reading units
// {0,1,4,5,8,9,12,13} (low nibbles) or those + 2 (high): bits 0, 2, 3 of the
// unit become the bank group, bit 1 the half.
// in_block(b, c) = at(16 b + c) for unit c (0..15) of super-block b: the
// lanes' c is fixed, so the permutation of c is computed once per kernel.
struct SwizzleK45 {
  static __device__ __forceinline__ int at(int u) {
    return (u & ~15) | ((u & 2) << 2) | ((u & 8) >> 1) | ((u & 4) >> 1) | (u & 1);
  }
  static __device__ __forceinline__ int in_block(int b, int c) { return 16 * b + at(c); }
};
// Q6_K: units {0,1,2,3,8,9,10,11} (or + 4): bit 3 folded into bit 2.
struct SwizzleK6 {
  static __device__ __forceinline__ int at(int u) { return u ^ ((u >> 1) & 4); }
  static __device__ __forceinline__ int in_block(int b, int c) { return 16 * b + at(c); }
};
// Q2_K/Q3_K: a phase is two consecutive super-blocks' 4 lanes, reading units
// 2 jj + {0, 1, 8, 9} of each (jj fixed): bits 3 and 4 of the unit (which
// half of the super-block, which super-block) are XORed into bits 1 and 2.
// (Every swizzle permutes units within an aligned block of 8 or 16, so it
// stays inside the staged row for any multiple of 256 columns.)
struct SwizzleK23 {
  static __device__ __forceinline__ int at(int u) { return u ^ (((u >> 3) & 3) << 1); }
  static __device__ __forceinline__ int in_block(int b, int c) { return (16 * b + at(c)) ^ ((b & 1) << 2); }
};

// --- per-type lanes: load(record, super-scales, j), then dot(data, j, staged input, super-block b)

template <TensorType T>
struct KLane;

// Q4_K / Q5_K: lane j (0..7) holds nibble chunk j: bytes qs[16 j .. 16 j + 16) = qs[32 p + 16 h + t]
// with p = j / 2, h = j % 2: low nibbles are weights 64 p + 16 h + t (sub-block 2 p, unit 4 p + h),
// high nibbles 64 p + 32 + 16 h + t (sub-block 2 p + 1, unit 4 p + 2 + h). Q5_K's fifth bits of
// those weights are bits 2 p and 2 p + 1 of qh[16 h + t].
template <bool kQ5>
struct KLane45 {
  static constexpr int kLanes = 8;
  using Swizzle = SwizzleK45;
  struct Data {
    uint4 head, qs, qh;
  };
  static __device__ __forceinline__ Data load(const uint8_t* rec, const uint16_t*, int j) {
    Data d;
    d.head = load_weights16(rec);
    d.qs = load_weights16(rec + (kQ5 ? 48 : 16) + 16 * j);
    d.qh = kQ5 ? load_weights16(rec + 16 + 16 * (j % 2)) : make_uint4(0, 0, 0, 0);
    return d;
  }
  // The 6-bit scales (sc) and mins (m) of sub-blocks 2p, 2p + 1 from the
  // header's sm[12] (bytes 4..15 = words y, z, w): sub-blocks 0..3 keep
  // theirs in the low 6 bits of bytes 0..3 of y (sc) and z (m); 4..7 take
  // the nibbles of w and the top 2 bits of y (sc) or z (m). All four bytes
  // at once, then the lane's two.
  static __device__ __forceinline__ void scales_mins(const uint4& head, int p, int& sc0, int& m0, int& sc1,
                                                     int& m1) {
    const uint32_t sc = p < 2 ? head.y & 0x3f3f3f3fu : (head.w & kLow4) | ((head.y >> 2) & 0x30303030u);
    const uint32_t m = p < 2 ? head.z & 0x3f3f3f3fu : ((head.w >> 4) & kLow4) | ((head.z >> 2) & 0x30303030u);
    const int shift = 16 * (p & 1);  // sub-block 2p is byte 2 (p % 2) of its word
    sc0 = int((sc >> shift) & 0xffu);
    sc1 = int((sc >> (shift + 8)) & 0xffu);
    m0 = int((m >> shift) & 0xffu);
    m1 = int((m >> (shift + 8)) & 0xffu);
  }
  static __device__ __forceinline__ float dot(const Data& d, int j, const Staged& s, int b) {
    const int p = j / 2;
    const int c0 = 4 * p + (j % 2);  // unit of the low nibbles in the super-block (high: c0 + 2)
    const int u0 = 16 * b + c0, u1 = u0 + 2;
    const int dot0 = dot_run(s.uq[Swizzle::in_block(b, c0)], [&](int k) {
      uint32_t v = word_of(d.qs, k) & kLow4;
      if (kQ5) v |= ((word_of(d.qh, k) >> (2 * p)) & kBit0) << 4;
      return v;
    });
    const int dot1 = dot_run(s.uq[Swizzle::in_block(b, c0 + 2)], [&](int k) {
      uint32_t v = (word_of(d.qs, k) >> 4) & kLow4;
      if (kQ5) v |= ((word_of(d.qh, k) >> (2 * p + 1)) & kBit0) << 4;
      return v;
    });
    const float dd = __half2float(__ushort_as_half(uint16_t(d.head.x & 0xffffu)));
    const float dmin = __half2float(__ushort_as_half(uint16_t(d.head.x >> 16)));
    int sc0, m0, sc1, m1;
    scales_mins(d.head, p, sc0, m0, sc1, m1);
    const float2 x = reinterpret_cast<const float2*>(s.us)[u0 >> 2];  // groups 8 b + 2 p, + 1
    return dd * (float(sc0) * x.x * float(dot0) + float(sc1) * x.y * float(dot1)) -
           dmin * (float(m0) * x.x * float(s.usum[u0]) + float(m1) * x.y * float(s.usum[u1]));
  }
};
template <>
struct KLane<TensorType::Q4_K> : KLane45<false> {};
template <>
struct KLane<TensorType::Q5_K> : KLane45<true> {};

// Q6_K: lane j (0..7) holds ql chunk j = ql[64 h + 32 g2 + l0 + t] with h = j / 4, g2 = (j / 2) % 2,
// l0 = 16 (j % 2): low nibbles are weights 128 h + 32 g2 + l0 + t (run r0 = 8 h + 2 g2 + j % 2 of
// the super-block), high nibbles the run r0 + 4; their high 2 bits are bits 2 g of
// qh[32 h + l0 + t] (g = g2, g2 + 2). Run r has the int8 scale sc[r]; q - 32 is the weight code.
template <>
struct KLane<TensorType::Q6_K> {
  static constexpr int kLanes = 8;
  using Swizzle = SwizzleK6;
  struct Data {
    uint4 ql, qh, sc;
    float d;
  };
  static __device__ __forceinline__ Data load(const uint8_t* rec, const uint16_t* s, int j) {
    Data d;
    const int h = j / 4, l0 = 16 * (j % 2);
    d.ql = load_weights16(rec + 16 * j);
    d.qh = load_weights16(rec + 128 + 32 * h + l0);
    d.sc = load_weights16(rec + 192);
    d.d = half_at(s);
    return d;
  }
  static __device__ __forceinline__ float dot(const Data& d, int j, const Staged& s, int b) {
    const int g2 = (j / 2) % 2;
    const int r0 = 8 * (j / 4) + 2 * g2 + (j % 2);
    const int u0 = 16 * b + r0, u1 = u0 + 4;
    const int dot0 = dot_run(s.uq[Swizzle::in_block(b, r0)], [&](int k) {
      return (word_of(d.ql, k) & kLow4) | (((word_of(d.qh, k) >> (2 * g2)) & kLow2) << 4);
    });
    const int dot1 = dot_run(s.uq[Swizzle::in_block(b, r0 + 4)], [&](int k) {
      return ((word_of(d.ql, k) >> 4) & kLow4) | (((word_of(d.qh, k) >> (2 * g2 + 4)) & kLow2) << 4);
    });
    const float sc0 = float(int8_t(byte_of(d.sc, r0))), sc1 = float(int8_t(byte_of(d.sc, r0 + 4)));
    return d.d * (sc0 * s.us[u0 >> 1] * float(dot0 - 32 * s.usum[u0]) +
                  sc1 * s.us[u1 >> 1] * float(dot1 - 32 * s.usum[u1]));
  }
};

// Q2_K / Q3_K: lane j (0..3) holds code chunk j = qs[32 n + l0 + t] with n = j / 2, l0 = 16 (j % 2):
// bits 2 jj of each byte are weight 128 n + 32 jj + l0 + t, run (sub-block of 16) k = 8 n + 2 jj +
// j % 2 of the super-block. Q3_K's "no -4" bit of that weight is bit 4 n + jj of hm[l0 + t].
template <>
struct KLane<TensorType::Q2_K> {
  static constexpr int kLanes = 4;
  using Swizzle = SwizzleK23;
  struct Data {
    uint4 sm, qs;
    float d, dmin;
  };
  static __device__ __forceinline__ Data load(const uint8_t* rec, const uint16_t* s, int j) {
    Data d;
    d.sm = load_weights16(rec);
    d.qs = load_weights16(rec + 16 + 16 * j);
    d.d = half_at(s);
    d.dmin = half_at(s + 1);
    return d;
  }
  static __device__ __forceinline__ float dot(const Data& d, int j, const Staged& s, int b) {
    float acc_d = 0.0f, acc_m = 0.0f;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int k = 8 * (j / 2) + 2 * jj + (j % 2), u = 16 * b + k;
      const int dot = dot_run(s.uq[Swizzle::in_block(b, k)], [&](int w) { return (word_of(d.qs, w) >> (2 * jj)) & kLow2; });
      const int sm = byte_of(d.sm, k);
      const float x = s.us[u >> 1];
      acc_d += float(sm & 15) * x * float(dot);
      acc_m += float(sm >> 4) * x * float(s.usum[u]);
    }
    return d.d * acc_d - d.dmin * acc_m;
  }
};

template <>
struct KLane<TensorType::Q3_K> {
  static constexpr int kLanes = 4;
  using Swizzle = SwizzleK23;
  struct Data {
    uint4 hm, qs, sc;
    float d;
  };
  static __device__ __forceinline__ Data load(const uint8_t* rec, const uint16_t* s, int j) {
    Data d;
    d.hm = load_weights16(rec + 16 * (j % 2));
    d.qs = load_weights16(rec + 32 + 16 * j);
    d.sc = load_weights16(rec + 96);  // 12 scale bytes and the record's 4 bytes of padding
    d.d = half_at(s);
    return d;
  }
  static __device__ __forceinline__ float dot(const Data& d, int j, const Staged& s, int b) {
    const int n = j / 2;
    float acc = 0.0f;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int k = 8 * n + 2 * jj + (j % 2), u = 16 * b + k;
      // q + 4 = (2-bit code) + 4 (high bit): a byte in 0..7.
      const int dot = dot_run(s.uq[Swizzle::in_block(b, k)], [&](int w) {
        return ((word_of(d.qs, w) >> (2 * jj)) & kLow2) | (((word_of(d.hm, w) >> (4 * n + jj)) & kBit0) << 2);
      });
      const int low = k < 8 ? byte_of(d.sc, k) & 15 : byte_of(d.sc, k - 8) >> 4;
      const int scale = (low | (((byte_of(d.sc, 8 + k % 4) >> (2 * (k / 4))) & 3) << 4)) - 32;
      acc += float(scale) * s.us[u >> 1] * float(dot - 4 * s.usum[u]);
    }
    return d.d * acc;
  }
};

// Super-blocks per lane and pipeline step. The step being computed and the
// next one are both held (kMats x kUnroll records each); within 128
// registers a lane holds 4 Q4_K records (8 words each) per matrix, or 2 of
// the wider ones (10-13 words), and half that for SwiGLU pairs.
template <TensorType T, bool kPair>
constexpr int kUnroll = (T == TensorType::Q4_K ? 4 : 2) / (kPair ? 2 : 1);

template <TensorType T, int U>
struct RecordBatch {
  typename KLane<T>::Data d[U];
};

// A task is one row (for SwiGLU: the same row of gate and of up); a warp
// walks its tasks (strided over the grid) in steps of kSlots x U
// super-blocks, loading step k+1 (of this task or the next) while computing
// step k; the first step is loaded before the wait for the producer of x.
template <TensorType T, bool kPair>
__global__ void __launch_bounds__(kMaxWarps * 32, 1) gemv_kquant_kernel(KArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  using L = KLane<T>;
  constexpr int kRec = kq::code_bytes(T), kSc = kq::scale_count(T);
  constexpr int kSlots = 32 / L::kLanes;  // super-blocks side by side in a warp
  constexpr int U = kUnroll<T, kPair>;
  constexpr int kPerStep = kSlots * U;
  constexpr int kMats = kPair ? 2 : 1;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int slot = lane / L::kLanes, j = lane % L::kLanes;
  const int blocks = a.cols / 256;
  const int steps_per_task = (blocks + kPerStep - 1) / kPerStep;  // warp-uniform
  const int stride = gridDim.x * warps;
  auto segment_of = [&](int task) { return kPair ? 0 : gemv_detail::segment_of(a, task); };
  auto row_of = [&](int task, int seg) { return task - (seg ? a.task_end[seg - 1] : 0); };
  auto block_of = [&](int step, int u) { return step * kPerStep + slot + kSlots * u; };
  auto load = [&](RecordBatch<T, U> (&batch)[kMats], int task, int step) {
    const int seg = segment_of(task);
    const int row = row_of(task, seg);
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
      const int mi = kPair ? m : seg;
      const uint8_t* codes = a.codes[mi] + size_t(row) * blocks * kRec;
      const uint16_t* scales = a.scales[mi] + size_t(row) * blocks * kSc;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int b = block_of(step, u);
        if (b < blocks) batch[m].d[u] = L::load(codes + size_t(b) * kRec, scales + b * kSc, j);
      }
    }
  };
  trace_event(a.trace, 0);
  allow_dependents();
  int task = blockIdx.x * warps + (threadIdx.x >> 5), step = 0;
  RecordBatch<T, U> cur[kMats], next[kMats];
  if (task < a.n_tasks) load(cur, task, 0);
  float4* smem_g = reinterpret_cast<float4*>(smem + gemv_detail::staged_input_bytes(true, 16, a.cols));
  gemv_detail::prefetch_norm(a, smem_g);
  wait_for_predecessor();
  trace_event(a.trace, 1);
  const float inv_rms = gemv_detail::stage_input<true, typename L::Swizzle, 16>(a, smem, smem_g);
  trace_event(a.trace, 2);
  const Staged s = gemv_detail::staged_view(smem, a.cols);

  float acc[kMats] = {};
  while (task < a.n_tasks) {
    const auto [next_task, next_step] = gemv_detail::next_pipeline_step(task, step, steps_per_task, stride);
    if (next_task < a.n_tasks) load(next, next_task, next_step);
#pragma unroll
    for (int m = 0; m < kMats; ++m)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int b = block_of(step, u);
        if (b < blocks) acc[m] += L::dot(cur[m].d[u], j, s, b);
      }
    if (next_step == 0) {
      const int seg = segment_of(task);
      gemv_detail::finish_row<kPair>(a, seg, row_of(task, seg), acc[0], acc[kMats - 1], inv_rms, lane);
#pragma unroll
      for (int m = 0; m < kMats; ++m) acc[m] = 0.0f;
    }
#pragma unroll
    for (int m = 0; m < kMats; ++m) cur[m] = next[m];
    task = next_task;
    step = next_step;
  }
  if (a.trace) {
    __syncthreads();
    trace_event(a.trace, 3);
  }
}

// Shared memory: the staged input, then (with a norm) the norm weight.
size_t kquant_smem_bytes(int cols, bool norm) {
  return gemv_detail::staged_input_bytes(true, 16, cols) + (norm ? size_t(cols) * 4 : 0);
}

template <TensorType T, bool kPair>
void launch(const KArgs& a, cudaStream_t stream, const DeviceContext& ctx) {
  const size_t smem = kquant_smem_bytes(a.cols, a.norm != nullptr);
  const int warps = std::clamp(ctx.settings.gemv_warps, 1, kMaxWarps);
  const int needed = (a.n_tasks + warps - 1) / warps;
  const int per_sm = resident_ctas(ctx, gemv_kquant_kernel<T, kPair>, smem, warps * 32);
  const int grid = std::max(1, std::min(needed, per_sm * ctx.sm_count()));
  launch_dependent(ctx, gemv_kquant_kernel<T, kPair>, dim3(grid), dim3(warps * 32), smem, stream, a);
}

template <bool kPair>
void dispatch(TensorType t, const KArgs& a, cudaStream_t stream, const DeviceContext& ctx) {
  switch (t) {
    case TensorType::Q2_K: return launch<TensorType::Q2_K, kPair>(a, stream, ctx);
    case TensorType::Q3_K: return launch<TensorType::Q3_K, kPair>(a, stream, ctx);
    case TensorType::Q4_K: return launch<TensorType::Q4_K, kPair>(a, stream, ctx);
    case TensorType::Q5_K: return launch<TensorType::Q5_K, kPair>(a, stream, ctx);
    case TensorType::Q6_K: return launch<TensorType::Q6_K, kPair>(a, stream, ctx);
    default: break;
  }
  fail(Errc::internal, "GPU GEMV: ", gguf::tensor_type_name(t), " is not a K-quant");
}

}  // namespace

void gemv_kquant(const GemvRequest& req, cudaStream_t stream, const DeviceContext& ctx) {
  KVQ_CHECK(req.n_out >= 1 && req.n_out <= kMaxOut && req.x, Errc::internal, "GPU GEMV: ", req.n_out,
            " outputs requested (1..3 with an input)");
  KVQ_CHECK(req.epilogue != GemvEpilogue::swiglu || req.n_out == 2, Errc::internal,
            "GPU GEMV: swiglu needs exactly two matrices (gate, up)");
  const GpuMatrix& w0 = *req.out[0].w;
  KVQ_CHECK(gguf::is_k_quant(w0.type) && gpu_gemv_supported(w0.type, w0.cols), Errc::unsupported,
            "GPU K-quant GEMV: unsupported ", gguf::tensor_type_name(w0.type), " matrix with ", w0.cols, " columns");
  KVQ_CHECK(kquant_smem_bytes(int(std::min<int64_t>(w0.cols, 1 << 24)), req.norm_weight) <= 200 * 1024 &&
                w0.rows <= (int64_t(1) << 30),
            Errc::out_of_range,
            "GPU GEMV: matrix of ", w0.rows, " x ", w0.cols, " is too large");
  KArgs a = gemv_detail::kernel_args(req, 1);  // one row per task
  if (req.epilogue == GemvEpilogue::swiglu) dispatch<true>(w0.type, a, stream, ctx);
  else dispatch<false>(w0.type, a, stream, ctx);
}

}  // namespace kvq::cuda

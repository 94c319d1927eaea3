// K-quant GEMV kernels; see gemv_kquant.hpp for the work split and
// backend/gpu_layout.hpp / gguf/quant.hpp for the record layouts.
//
// Shared memory: float u[cols] = x (* norm weight); with a norm the row's
// 1/rms is applied to each finished dot product (as the other GEMVs do).
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
using gemv_detail::warp_sum;
using gemv_detail::load_weights16;

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ int byte_of(const uint4& v, int k) { return int((word_of(v, k >> 2) >> (8 * (k & 3))) & 0xffu); }

__device__ __forceinline__ float half_at(const uint16_t* p) { return __half2float(__ushort_as_half(__ldg(p))); }

// 16 consecutive staged inputs.
struct U16 {
  float v[16];
  __device__ __forceinline__ explicit U16(const float* u) {
    const float4* p = reinterpret_cast<const float4*>(u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 f = p[i];
      v[4 * i] = f.x;
      v[4 * i + 1] = f.y;
      v[4 * i + 2] = f.z;
      v[4 * i + 3] = f.w;
    }
  }
};

// --- per-type lanes: load(record, super-scales, j) then dot(data, j, u of the super-block)

template <TensorType T>
struct KLane;

// Q4_K / Q5_K: lane j (0..7) holds nibble chunk j: bytes qs[16 j .. 16 j + 16) = qs[32 p + 16 h + t]
// with p = j / 2, h = j % 2: low nibbles are weights 64 p + 16 h + t (sub-block 2 p), high
// nibbles 64 p + 32 + 16 h + t (sub-block 2 p + 1). Q5_K's fifth bits of those weights are
// bits 2 p and 2 p + 1 of qh[16 h + t].
template <bool kQ5>
struct KLane45 {
  static constexpr int kLanes = 8;
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
  // 6-bit scale and min of sub-block s from the header's sm[12] (bytes 4..15).
  static __device__ __forceinline__ void scale_min(const uint4& head, int s, int& sc, int& m) {
    if (s < 4) {
      sc = byte_of(head, 4 + s) & 63;
      m = byte_of(head, 8 + s) & 63;
    } else {
      sc = (byte_of(head, 8 + s) & 15) | ((byte_of(head, s) >> 6) << 4);
      m = (byte_of(head, 8 + s) >> 4) | ((byte_of(head, 4 + s) >> 6) << 4);
    }
  }
  static __device__ __forceinline__ float dot(const Data& d, int j, const float* u) {
    const int p = j / 2, h = j % 2;
    const float dd = __half2float(__ushort_as_half(uint16_t(d.head.x & 0xffffu)));
    const float dmin = __half2float(__ushort_as_half(uint16_t(d.head.x >> 16)));
    int sc0, m0, sc1, m1;
    scale_min(d.head, 2 * p, sc0, m0);
    scale_min(d.head, 2 * p + 1, sc1, m1);
    const float s0 = dd * float(sc0), o0 = dmin * float(m0), s1 = dd * float(sc1), o1 = dmin * float(m1);
    const U16 lo(u + 64 * p + 16 * h), hi(u + 64 * p + 32 + 16 * h);
    float acc = 0.0f;
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      const int byte = byte_of(d.qs, t);
      int q0 = byte & 15, q1 = byte >> 4;
      if (kQ5) {
        const int bits = byte_of(d.qh, t);
        q0 |= ((bits >> (2 * p)) & 1) << 4;
        q1 |= ((bits >> (2 * p + 1)) & 1) << 4;
      }
      acc = fmaf(s0 * float(q0) - o0, lo.v[t], acc);
      acc = fmaf(s1 * float(q1) - o1, hi.v[t], acc);
    }
    return acc;
  }
};
template <>
struct KLane<TensorType::Q4_K> : KLane45<false> {};
template <>
struct KLane<TensorType::Q5_K> : KLane45<true> {};

// Q6_K: lane j (0..7) holds ql chunk j = ql[64 h + 32 g2 + l0 + t] with h = j / 4, g2 = (j / 2) % 2,
// l0 = 16 (j % 2): low nibbles are weights 128 h + 32 g2 + l0 + t, high nibbles 128 h + 32 (g2 + 2)
// + l0 + t; their high 2 bits are bits 2 g of qh[32 h + l0 + t] (g = g2, g2 + 2).
template <>
struct KLane<TensorType::Q6_K> {
  static constexpr int kLanes = 8;
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
  static __device__ __forceinline__ float dot(const Data& d, int j, const float* u) {
    const int h = j / 4, g2 = (j / 2) % 2, l0 = 16 * (j % 2);
    const int base0 = 128 * h + 32 * g2 + l0, base1 = base0 + 64;
    const float s0 = d.d * float(int8_t(byte_of(d.sc, base0 / 16)));
    const float s1 = d.d * float(int8_t(byte_of(d.sc, base1 / 16)));
    const U16 lo(u + base0), hi(u + base1);
    float acc = 0.0f;
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      const int byte = byte_of(d.ql, t), bits = byte_of(d.qh, t);
      const int q0 = (byte & 15) | (((bits >> (2 * g2)) & 3) << 4);
      const int q1 = (byte >> 4) | (((bits >> (2 * g2 + 4)) & 3) << 4);
      acc = fmaf(s0 * float(q0 - 32), lo.v[t], acc);
      acc = fmaf(s1 * float(q1 - 32), hi.v[t], acc);
    }
    return acc;
  }
};

// Q2_K / Q3_K: lane j (0..3) holds code chunk j = qs[32 n + l0 + t] with n = j / 2, l0 = 16 (j % 2):
// bits 2 jj of each byte are weight 128 n + 32 jj + l0 + t (sub-block 8 n + 2 jj + l0 / 16).
// Q3_K's "no -4" bit of that weight is bit 4 n + jj of hm[l0 + t].
template <>
struct KLane<TensorType::Q2_K> {
  static constexpr int kLanes = 4;
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
  static __device__ __forceinline__ float dot(const Data& d, int j, const float* u) {
    const int n = j / 2, l0 = 16 * (j % 2);
    float acc = 0.0f;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int k = 8 * n + 2 * jj + l0 / 16;
      const int sm = byte_of(d.sm, k);
      const float s = d.d * float(sm & 15), o = d.dmin * float(sm >> 4);
      const U16 uu(u + 128 * n + 32 * jj + l0);
#pragma unroll
      for (int t = 0; t < 16; ++t) acc = fmaf(s * float((byte_of(d.qs, t) >> (2 * jj)) & 3) - o, uu.v[t], acc);
    }
    return acc;
  }
};

template <>
struct KLane<TensorType::Q3_K> {
  static constexpr int kLanes = 4;
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
  static __device__ __forceinline__ float dot(const Data& d, int j, const float* u) {
    const int n = j / 2, l0 = 16 * (j % 2);
    float acc = 0.0f;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int k = 8 * n + 2 * jj + l0 / 16;
      const int low = k < 8 ? byte_of(d.sc, k) & 15 : byte_of(d.sc, k - 8) >> 4;
      const int scale = (low | (((byte_of(d.sc, 8 + k % 4) >> (2 * (k / 4))) & 3) << 4)) - 32;
      const float s = d.d * float(scale);
      const U16 uu(u + 128 * n + 32 * jj + l0);
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        const int q = ((byte_of(d.qs, t) >> (2 * jj)) & 3) - (((byte_of(d.hm, t) >> (4 * n + jj)) & 1) ? 0 : 4);
        acc = fmaf(s * float(q), uu.v[t], acc);
      }
    }
    return acc;
  }
};

template <TensorType T, bool kPair>
__global__ void __launch_bounds__(kMaxWarps * 32) gemv_kquant_kernel(KArgs a) {
  extern __shared__ __align__(16) float u[];
  using L = KLane<T>;
  constexpr int kRec = kq::code_bytes(T), kSc = kq::scale_count(T);
  constexpr int kSlots = 32 / L::kLanes;  // super-blocks per warp step
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int slot = lane / L::kLanes, j = lane % L::kLanes;
  const int blocks = a.cols / 256;
  trace_event(a.trace, 0);
  allow_dependents();
  wait_for_predecessor();
  trace_event(a.trace, 1);

  // Stage u = x (* norm weight) and, with a norm, 1/rms of x.
  const float4* x4 = reinterpret_cast<const float4*>(a.x);
  const float4* g4 = reinterpret_cast<const float4*>(a.norm);
  float4* u4 = reinterpret_cast<float4*>(u);
  float ss = 0.0f;
  for (int i = threadIdx.x; i < a.cols / 4; i += blockDim.x) {
    float4 v = x4[i];
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    if (a.norm) {
      const float4 g = g4[i];
      v = make_float4(v.x * g.x, v.y * g.y, v.z * g.z, v.w * g.w);
    }
    u4[i] = v;
  }
  const float inv_rms = gemv_detail::cta_inv_rms(ss, a, lane, warp, warps);
  __syncthreads();
  trace_event(a.trace, 2);

  for (int task = blockIdx.x * warps + warp; task < a.n_tasks; task += gridDim.x * warps) {
    int seg = 0;
    if (!kPair) {
      while (task >= a.task_end[seg]) ++seg;
    }
    const int row = task - (seg ? a.task_end[seg - 1] : 0);
    float acc[2] = {0.0f, 0.0f};
#pragma unroll
    for (int m = 0; m < (kPair ? 2 : 1); ++m) {
      const int mi = kPair ? m : seg;
      const uint8_t* codes = a.codes[mi] + size_t(row) * blocks * kRec;
      const uint16_t* scales = a.scales[mi] + size_t(row) * blocks * kSc;
      float s = 0.0f;
      int b = slot;
      // Two records per lane in flight: both loads are issued before either dot.
      for (; b + kSlots < blocks; b += 2 * kSlots) {
        const typename L::Data d0 = L::load(codes + size_t(b) * kRec, scales + b * kSc, j);
        const typename L::Data d1 = L::load(codes + size_t(b + kSlots) * kRec, scales + (b + kSlots) * kSc, j);
        s += L::dot(d0, j, u + 256 * b);
        s += L::dot(d1, j, u + 256 * (b + kSlots));
      }
      if (b < blocks) s += L::dot(L::load(codes + size_t(b) * kRec, scales + b * kSc, j), j, u + 256 * b);
      acc[m] = s;
    }
    const float v0 = warp_sum(acc[0]) * inv_rms;
    if constexpr (kPair) {
      const float v1 = warp_sum(acc[1]) * inv_rms;
      if (lane == 0) a.y[0][row] = v0 / (1.0f + expf(-v0)) * v1;
    } else {
      if (lane == 0) {
        float* y = a.y[seg] + row;
        *y = a.epilogue == GemvEpilogue::add ? *y + v0 : v0;
      }
    }
  }
  if (a.trace) {
    __syncthreads();
    trace_event(a.trace, 3);
  }
}


template <TensorType T, bool kPair>
void launch(const KArgs& a, cudaStream_t stream, const DeviceContext& ctx) {
  const size_t smem = size_t(a.cols) * sizeof(float);
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
  KVQ_CHECK(w0.cols * sizeof(float) <= 200 * 1024 && w0.rows <= (int64_t(1) << 30), Errc::out_of_range,
            "GPU GEMV: matrix of ", w0.rows, " x ", w0.cols, " is too large");
  KArgs a = gemv_detail::kernel_args(req, 1);  // one row per task
  if (req.epilogue == GemvEpilogue::swiglu) dispatch<true>(w0.type, a, stream, ctx);
  else dispatch<false>(w0.type, a, stream, ctx);
}

}  // namespace kvq::cuda

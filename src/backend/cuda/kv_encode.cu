// Encode kernels (bulk prefill chunks and one token at a device position)
// that write the packed GPU KV store directly, and the dequantization of a
// store's prefix into bf16 rows for prefill attention. Formats: the hooks in
// kv_codec_hooks.cuh.
#include <algorithm>

#include "backend/cuda/attention.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/kv_codec_hooks.cuh"
#include "core/error.hpp"

namespace kvq::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

// One warp per (token, KV head) row of one side: rows [pos, pos + n) of the
// store from x [n][n_kv][D] fp32.
template <kv::Family F>
__global__ void encode_rows_kernel(GpuKvSide side, const float* __restrict__ x, int pos, const int* pos_dev, int n,
                                   int n_kv, int D, int max_tokens) {
  const int row = int(blockIdx.x) * kWarpsPerBlock + int(threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= n * n_kv) return;
  if (pos_dev) pos = *pos_dev;
  const int t = row / n_kv, h = row % n_kv;
  uint8_t* code = side.code + side.code_offset(h, pos + t, max_tokens);
  uint8_t* s = side.side_bytes ? side.side + side.side_offset(h, pos + t, max_tokens) : nullptr;
  const float* rot = side.rot_of(h);
  EncodeHooks<F>::encode_row(x + size_t(row) * D, D, code, s, lane, rot);
}

template <kv::Family F>
void launch_encode(const GpuKvSide& side, const float* x, int pos, const int* pos_dev, int n, int n_kv, int D,
                   int max_tokens, cudaStream_t stream) {
  const int rows = n * n_kv;
  encode_rows_kernel<F><<<(rows + kWarpsPerBlock - 1) / kWarpsPerBlock, kThreads, 0, stream>>>(
      side, x, pos, pos_dev, n, n_kv, D, max_tokens);
  KVQ_CUDA_CHECK_LAUNCH();
}

void encode_side(const GpuKvSide& side, const float* x, int pos, const int* pos_dev, int n, int n_kv, int D,
                 int max_tokens, cudaStream_t stream) {
  switch (side.family) {
    case kv::Family::bf16: launch_encode<kv::Family::bf16>(side, x, pos, pos_dev, n, n_kv, D, max_tokens, stream); break;
    case kv::Family::q8: launch_encode<kv::Family::q8>(side, x, pos, pos_dev, n, n_kv, D, max_tokens, stream); break;
    case kv::Family::rq8:
      KVQ_CHECK(side.rot, Errc::internal, "rq8 store without its rotation table");
      launch_encode<kv::Family::rq8>(side, x, pos, pos_dev, n, n_kv, D, max_tokens, stream);
      break;
    default:
      fail(Errc::unsupported, "no GPU encode kernel for KV block family ", kv::family_name(side.family));
  }
}

// dst [n_kv][dst_stride][D] bf16 <- rows [0, n_tokens) of the side.
__global__ void dequantize_kernel(GpuKvSide side, int n_tokens, int n_kv, int D, int max_tokens,
                                  uint16_t* __restrict__ dst, int dst_stride) {
  const size_t total = size_t(n_kv) * n_tokens * D;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const int d = int(i % D);
    const int t = int((i / D) % n_tokens);
    const int h = int(i / (size_t(D) * n_tokens));
    const uint8_t* code = side.code + side.code_offset(h, t, max_tokens);
    const uint8_t* s = side.side_bytes ? side.side + side.side_offset(h, t, max_tokens) : nullptr;
    dst[(size_t(h) * dst_stride + t) * D + d] = ::kvq::f32_to_bf16(decode_value_any(side.family, code, s, d));
  }
}

// Rotated stores: one warp per (head, token) row decodes it, un-rotates it
// (the inverse Walsh-Hadamard with signs) and writes bf16 in the original basis.
template <int kNJ>
__global__ void dequantize_rotated_kernel(GpuKvSide side, int n_tokens, int n_kv, int max_tokens,
                                          uint16_t* __restrict__ dst, int dst_stride) {
  constexpr int D = 32 * kNJ;
  const int row = int(blockIdx.x) * kWarpsPerBlock + int(threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= n_kv * n_tokens) return;
  const int h = row / n_tokens, t = row % n_tokens;
  const uint8_t* code = side.code + side.code_offset(h, t, max_tokens);
  const uint8_t* s = side.side + side.side_offset(h, t, max_tokens);
  float v[kNJ];
#pragma unroll
  for (int j = 0; j < kNJ; ++j) v[j] = decode_value_any(side.family, code, s, lane + 32 * j);
  warp_hadamard<kNJ>(v, side.rot_of(h), lane, true);
#pragma unroll
  for (int j = 0; j < kNJ; ++j) dst[(size_t(h) * dst_stride + t) * D + lane + 32 * j] = ::kvq::f32_to_bf16(v[j]);
}

void dequantize_side(const GpuKvSide& side, int n_tokens, int n_kv, int D, int max_tokens, uint16_t* dst,
                     int dst_stride, cudaStream_t stream) {
  const size_t total = size_t(n_kv) * n_tokens * D;
  if (total == 0) return;
  if (is_rotated(side.family)) {
    const int rows = n_kv * n_tokens, grid = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    switch (D) {
      case 64: dequantize_rotated_kernel<2><<<grid, kThreads, 0, stream>>>(side, n_tokens, n_kv, max_tokens, dst, dst_stride); break;
      case 128: dequantize_rotated_kernel<4><<<grid, kThreads, 0, stream>>>(side, n_tokens, n_kv, max_tokens, dst, dst_stride); break;
      case 256: dequantize_rotated_kernel<8><<<grid, kThreads, 0, stream>>>(side, n_tokens, n_kv, max_tokens, dst, dst_stride); break;
      default: fail(Errc::internal, "dequantize_kv_bf16: a rotated store with head_dim ", D);
    }
  } else {
    const int grid = int(std::min<size_t>((total + 255) / 256, size_t(sm_count()) * 16));
    dequantize_kernel<<<grid, 256, 0, stream>>>(side, n_tokens, n_kv, D, max_tokens, dst, dst_stride);
  }
  KVQ_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool kv_encode_supported(kv::Family k, kv::Family v, int head_dim) {
  const auto ok = [&](kv::Family f) {
    if (!has_encode_hooks(f)) return false;
    if (is_rotated(f)) return head_dim == 64 || head_dim == 128 || head_dim == 256;  // warp Walsh-Hadamard
    return f == kv::Family::bf16 || head_dim % 32 == 0;  // q8: whole 32-value scale groups
  };
  return ok(k) && ok(v);
}

void write_kv(const GpuKvLayer& layer, int pos, int n, const float* k, const float* v, cudaStream_t stream) {
  KVQ_CHECK(pos >= 0 && n >= 0 && int64_t(pos) + n <= layer.max_tokens, Errc::out_of_range, "GPU KV cache: tokens [",
            pos, ", ", int64_t(pos) + n, ") do not fit its capacity of ", layer.max_tokens, " tokens");
  if (n == 0) return;
  encode_side(layer.k, k, pos, nullptr, n, layer.n_kv_heads, layer.head_dim, layer.max_tokens, stream);
  encode_side(layer.v, v, pos, nullptr, n, layer.n_kv_heads, layer.head_dim, layer.max_tokens, stream);
}

void write_kv_at(const GpuKvLayer& layer, const int* pos_dev, const float* k, const float* v, cudaStream_t stream) {
  encode_side(layer.k, k, 0, pos_dev, 1, layer.n_kv_heads, layer.head_dim, layer.max_tokens, stream);
  encode_side(layer.v, v, 0, pos_dev, 1, layer.n_kv_heads, layer.head_dim, layer.max_tokens, stream);
}

void dequantize_kv_bf16(const GpuKvLayer& layer, int n_tokens, const KvLayerView& dst, cudaStream_t stream) {
  KVQ_CHECK(n_tokens >= 0 && n_tokens <= layer.max_tokens && n_tokens <= dst.max_tokens &&
                dst.head_dim == layer.head_dim && dst.n_kv_heads == layer.n_kv_heads,
            Errc::internal, "dequantize_kv_bf16: ", n_tokens, " tokens into a view of ", dst.max_tokens);
  dequantize_side(layer.k, n_tokens, layer.n_kv_heads, layer.head_dim, layer.max_tokens, dst.k, dst.max_tokens, stream);
  dequantize_side(layer.v, n_tokens, layer.n_kv_heads, layer.head_dim, layer.max_tokens, dst.v, dst.max_tokens, stream);
}

}  // namespace kvq::cuda

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

constexpr bool uses_codebook(kv::Family f) {
  return f == kv::Family::turbo || f == kv::Family::tcq || f == kv::Family::iso || f == kv::Family::rotor ||
         f == kv::Family::planar;
}
constexpr bool qjl_encode_supported(int D) { return D % 32 == 0 && D >= 32 && D <= 256; }

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

constexpr int kMaxRowD = 256;  // rows staged in shared memory (windowed stores, rotated dequantization)

// The exact window's part of a write (GpuKvLayer::xk / xv): the side's bf16
// rows, and the first page id that is exact (the store's packed pages).
// exact.code == nullptr: a store without a window.
struct ExactTarget {
  GpuKvSide exact;
  int first_page = 0;
};

// One warp per (token, KV head) row of one side: token t of x [n][n_kv][D]
// fp32 goes to slot slots[t] (device memory) or, without slots, slot0 + t
// (a one-sequence store's identity table: slot = position); its row is
// PageGeometry::slot_row(slot, head). A store with a window writes a slot of
// an exact page as the bf16 row (as the `none` block does) and encodes the
// bf16 values of the others (kv_store.hpp, GpuKvLayer).
template <kv::Family F>
__global__ void encode_rows_kernel(GpuKvSide side, ExactTarget window, const float* __restrict__ x, int slot0,
                                   const int* slots, int n, int n_kv, int D, kv::PageGeometry geo) {
  __shared__ float staged[kWarpsPerBlock][kMaxRowD];
  const int row = int(blockIdx.x) * kWarpsPerBlock + int(threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= n * n_kv) return;
  const int t = row / n_kv, h = row % n_kv;
  const int32_t slot = slots ? slots[t] : slot0 + t;
  const float* src = x + size_t(row) * D;
  if (window.exact.code) {
    const int page = slot / geo.page_tokens;
    if (page >= window.first_page) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(window.exact.code) +
                      geo.row(page - window.first_page, h, slot - page * geo.page_tokens) * size_t(D);
      for (int d = lane; d < D; d += 32) dst[d] = ::kvq::f32_to_bf16(sanitize_kv(src[d]));
      return;
    }
    float* y = staged[threadIdx.x >> 5];
    for (int d = lane; d < D; d += 32) y[d] = ::kvq::bf16_to_f32(::kvq::f32_to_bf16(sanitize_kv(src[d])));
    __syncwarp();
    src = y;
  }
  const size_t r = geo.slot_row(slot, h);
  uint8_t* code = side.code + side.code_offset(r);
  uint8_t* s = side.side_bytes ? side.side + side.side_offset(r) : nullptr;
  encode_row_with<F>(side, h, src, D, code, s, lane);
}

template <kv::Family F>
void launch_encode(const GpuKvSide& side, const ExactTarget& window, const float* x, int slot0, const int* slots,
                   int n, int n_kv, int D, kv::PageGeometry geo, cudaStream_t stream) {
  const int rows = n * n_kv;
  encode_rows_kernel<F><<<(rows + kWarpsPerBlock - 1) / kWarpsPerBlock, kThreads, 0, stream>>>(
      side, window, x, slot0, slots, n, n_kv, D, geo);
  KVQ_CUDA_CHECK_LAUNCH();
}

// The tables an encode of `side` reads are there (Errc::internal otherwise).
void check_encode_tables(const GpuKvSide& side, int D) {
  KVQ_CHECK(!is_rotated(side.family) || side.rot, Errc::internal, kv::family_name(side.family),
            " store without its rotation table");
  KVQ_CHECK(!uses_codebook(side.family) || side.codebook, Errc::internal, kv::family_name(side.family),
            " store without its codebook");
  KVQ_CHECK(!side.has_qjl || (side.qjl && qjl_encode_supported(D)), Errc::internal,
            "+qjl store without its sketch, or head_dim ", D, " (the GPU sketch needs a multiple of 32 up to 256)");
}

void encode_side(const GpuKvSide& side, const ExactTarget& window, const float* x, int slot0, const int* slots, int n,
                 int n_kv, int D, kv::PageGeometry geo, cudaStream_t stream) {
  check_encode_tables(side, D);
  KVQ_CHECK(!window.exact.code || D <= kMaxRowD, Errc::internal, "a windowed GPU KV store of head_dim ", D);
#define KVQ_ENCODE_CASE(fam)                                                                 \
  case kv::Family::fam:                                                                      \
    launch_encode<kv::Family::fam>(side, window, x, slot0, slots, n, n_kv, D, geo, stream); \
    break;
  switch (side.family) {
    KVQ_ENCODE_CASE(bf16)
    KVQ_ENCODE_CASE(q8)
    KVQ_ENCODE_CASE(rq8)
    KVQ_ENCODE_CASE(turbo)
    KVQ_ENCODE_CASE(tcq)
    KVQ_ENCODE_CASE(iso)
    KVQ_ENCODE_CASE(rotor)
    KVQ_ENCODE_CASE(planar)
    KVQ_ENCODE_CASE(fp8)
    default:
      fail(Errc::unsupported, "no GPU encode kernel for KV block family ", kv::family_name(side.family));
  }
#undef KVQ_ENCODE_CASE
}

ExactTarget exact_k(const GpuKvLayer& l) { return {l.has_window() ? l.xk : GpuKvSide{}, l.n_pages}; }
ExactTarget exact_v(const GpuKvLayer& l) { return {l.has_window() ? l.xv : GpuKvSide{}, l.n_pages}; }

// The row of a sequence's token t of KV head h through its table `src`:
// a packed row, or (a store with a window, a page >= window.first_page) a
// row of the exact bf16 side.
__device__ __forceinline__ StoreRow token_row(const SeqRows& src, const ExactTarget& window, int h, int t) {
  const int i = src.index_of(t);
  const int page = src.pages ? src.pages[i] : i, entry = t - i * src.geo.page_tokens;
  if (window.exact.code && page >= window.first_page) return {true, src.geo.row(page - window.first_page, h, entry)};
  return {false, src.geo.row(page, h, entry)};
}

// dst rows (dst.row(h, t): bf16, D values each) <- token t < n_tokens of
// every head of the side, found through `src` (the sequence's block table)
// (unrotated families without a sketch): one thread per 8 consecutive values
// of a row, one 16-byte store, 32-bit index math (a 64-bit division per
// value cost more than its decode). Exact rows (a window's pages) are copied
// as they are. D % 8 == 0; rows * D / 8 < 2^31 (dequantize_side).
__global__ void dequantize_kernel(GpuKvSide side, ExactTarget window, int n_tokens, int n_kv, int D, SeqRows src,
                                  uint16_t* __restrict__ dst, SeqRows dst_rows) {
  const int per_row = D / 8;
  const int i = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x);
  if (i >= n_kv * n_tokens * per_row) return;
  const int row = i / per_row, d0 = (i - row * per_row) * 8;
  const int h = row / n_tokens, t = row - h * n_tokens;
  const StoreRow r = token_row(src, window, h, t);
  uint4* out = reinterpret_cast<uint4*>(dst + dst_rows.row(h, t) * D + d0);
  if (r.exact) {
    *out = *reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(window.exact.code) + r.row * D + d0);
    return;
  }
  const uint8_t* code = side.code + side.code_offset(r.row);
  const uint8_t* s = side.side_bytes ? side.side + side.side_offset(r.row) : nullptr;
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = uint32_t(::kvq::f32_to_bf16(decode_value_any(side, code, s, D, d0 + 2 * k))) |
           (uint32_t(::kvq::f32_to_bf16(decode_value_any(side, code, s, D, d0 + 2 * k + 1))) << 16);
  *out = make_uint4(w[0], w[1], w[2], w[3]);
}

// Rotated stores and +qjl sides: one warp per (head, token) row decodes it
// in the rotated basis into shared memory (the CPU block's decode_rotated,
// +qjl: plus its sketch term), un-rotates it in place with the side's
// inverse rotation (kv_rotation.cuh) and writes bf16 in the original basis:
// bf16 of the CPU block's decode(), exactly. D <= kMaxRowD. Exact rows are
// copied as they are.
__global__ void dequantize_rows_kernel(GpuKvSide side, ExactTarget window, int n_tokens, int n_kv, int D, SeqRows src,
                                       uint16_t* __restrict__ dst, SeqRows dst_rows) {
  __shared__ float rows[kWarpsPerBlock][kMaxRowD];
  const int warp = int(threadIdx.x >> 5), lane = threadIdx.x & 31;
  const int row = int(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= n_kv * n_tokens) return;
  const int h = row / n_tokens, t = row % n_tokens;
  const StoreRow r = token_row(src, window, h, t);
  uint16_t* out = dst + dst_rows.row(h, t) * D;
  if (r.exact) {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(window.exact.code) + r.row * D;
    for (int d = lane; d < D; d += 32) out[d] = x[d];
    return;
  }
  const uint8_t* code = side.code + side.code_offset(r.row);
  const uint8_t* s = side.side_bytes ? side.side + side.side_offset(r.row) : nullptr;
  float* y = rows[warp];
  for (int d = lane; d < D; d += 32)
    y[d] = side.has_qjl ? qjl_decode_value(side, h, code, s, D, d) : decode_value_any(side, code, s, D, d);
  const RotationKind kind = rotation_kind(side.family);
  if (kind != RotationKind::identity) warp_rotate_row(kind, side.rot_of(h), y, y, D, lane, true);
  __syncwarp();
  for (int d = lane; d < D; d += 32) out[d] = ::kvq::f32_to_bf16(y[d]);
}

// +qjl sides with head_dim 64, 128 or 256 (D = 32 kNJ): dequantize_rows_kernel's
// work, one warp per kQjlRows consecutive tokens of one KV head: every row's
// base values, then the sketch terms of all of them together
// (qjl_add_sketch_rows: each j's S values loaded once for the rows, 32
// independent chains of adds a lane), then per row the inverse rotation in
// shared memory and the bf16 write. The same operations per value as
// qjl_decode_value, so the same bits. Exact rows (a window's) are copied.
constexpr int kQjlRows = 8;
template <int kNJ>
__global__ void dequantize_qjl_rows_kernel(GpuKvSide side, ExactTarget window, int n_tokens, int n_kv, SeqRows src,
                                           uint16_t* __restrict__ dst, SeqRows dst_rows) {
  constexpr int D = 32 * kNJ;
  __shared__ float rows[kWarpsPerBlock][kMaxRowD];
  const int warp = int(threadIdx.x >> 5), lane = threadIdx.x & 31;
  const int groups = (n_tokens + kQjlRows - 1) / kQjlRows;  // per KV head
  const int group = int(blockIdx.x) * kWarpsPerBlock + warp;
  if (group >= n_kv * groups) return;
  const int h = group / groups, t0 = (group % groups) * kQjlRows;
  float y[kQjlRows][kNJ], c[kQjlRows];
  uint32_t bits[kQjlRows][kNJ];
  bool packed[kQjlRows];  // warp-uniform
#pragma unroll
  for (int r = 0; r < kQjlRows; ++r) {
    packed[r] = false;
    c[r] = 0.0f;
#pragma unroll
    for (int k = 0; k < kNJ; ++k) y[r][k] = 0.0f, bits[r][k] = 0;
    const int t = t0 + r;
    if (t >= n_tokens) continue;
    const StoreRow sr = token_row(src, window, h, t);
    if (sr.exact) {
      const uint16_t* x = reinterpret_cast<const uint16_t*>(window.exact.code) + sr.row * D;
      uint16_t* out = dst + dst_rows.row(h, t) * D;
      for (int d = lane; d < D; d += 32) out[d] = x[d];
      continue;
    }
    packed[r] = true;
    const uint8_t* code = side.code + side.code_offset(sr.row);
    const uint8_t* s = side.side + side.side_offset(sr.row);  // +qjl keeps its norm in the side bytes
#pragma unroll
    for (int k = 0; k < kNJ; ++k) y[r][k] = decode_value_any(side, code, s, D, lane + 32 * k);
    c[r] = __fmul_rn(float(1.2533141373155002512 / D), enc::load_f16(s + side.qjl_side_offset));
    const uint8_t* plane = code + side.qjl_code_offset;
#pragma unroll
    for (int w = 0; w < kNJ; ++w)
      bits[r][w] = uint32_t(plane[4 * w]) | (uint32_t(plane[4 * w + 1]) << 8) | (uint32_t(plane[4 * w + 2]) << 16) |
                   (uint32_t(plane[4 * w + 3]) << 24);
  }
  qjl_add_sketch_rows<kNJ, kQjlRows>(side.qjl + size_t(h) * D * D, lane, c, bits, y);
  const RotationKind kind = rotation_kind(side.family);
  float* row = rows[warp];
#pragma unroll
  for (int r = 0; r < kQjlRows; ++r) {
    if (!packed[r]) continue;
#pragma unroll
    for (int k = 0; k < kNJ; ++k) row[lane + 32 * k] = y[r][k];
    __syncwarp();
    if (kind != RotationKind::identity) warp_rotate_row(kind, side.rot_of(h), row, row, D, lane, true);
    __syncwarp();
    uint16_t* out = dst + dst_rows.row(h, t0 + r) * D;
    for (int d = lane; d < D; d += 32) out[d] = ::kvq::f32_to_bf16(row[d]);
    __syncwarp();  // the row is read before the next one overwrites it
  }
}

void dequantize_side(const GpuKvSide& side, const ExactTarget& window, int n_tokens, int n_kv, int D, SeqRows src,
                     uint16_t* dst, SeqRows dst_rows, cudaStream_t stream) {
  const size_t total = size_t(n_kv) * n_tokens * D;
  if (total == 0) return;
  if (side.has_qjl && (D == 64 || D == 128 || D == 256)) {
    const int groups = n_kv * ((n_tokens + kQjlRows - 1) / kQjlRows);
    const int grid = (groups + kWarpsPerBlock - 1) / kWarpsPerBlock;
    if (D == 64)
      dequantize_qjl_rows_kernel<2><<<grid, kThreads, 0, stream>>>(side, window, n_tokens, n_kv, src, dst, dst_rows);
    else if (D == 128)
      dequantize_qjl_rows_kernel<4><<<grid, kThreads, 0, stream>>>(side, window, n_tokens, n_kv, src, dst, dst_rows);
    else
      dequantize_qjl_rows_kernel<8><<<grid, kThreads, 0, stream>>>(side, window, n_tokens, n_kv, src, dst, dst_rows);
  } else if (is_rotated(side.family) || side.has_qjl) {
    KVQ_CHECK(D <= kMaxRowD, Errc::internal, "dequantize_kv_bf16: a rotated or +qjl store with head_dim ", D);
    const int rows = n_kv * n_tokens, grid = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    dequantize_rows_kernel<<<grid, kThreads, 0, stream>>>(side, window, n_tokens, n_kv, D, src, dst, dst_rows);
  } else {
    KVQ_CHECK(D % 8 == 0 && total / 8 < (size_t(1) << 31), Errc::internal, "dequantize_kv_bf16: head_dim ", D, ", ",
              total, " values");
    const int grid = int((total / 8 + 255) / 256);
    dequantize_kernel<<<grid, 256, 0, stream>>>(side, window, n_tokens, n_kv, D, src, dst, dst_rows);
  }
  KVQ_CUDA_CHECK_LAUNCH();
}

// One warp per row of the moved pages (pairs[2 i]: an exact page's index in
// the window's store, pairs[2 i + 1]: a packed page), of one side: the bf16
// row, as floats, through the side's encode: what a windowed store's write
// of those values gives (encode_rows_kernel).
template <kv::Family F>
__global__ void pack_rows_kernel(GpuKvSide side, GpuKvSide exact, const int32_t* pairs, int n, int n_kv, int D,
                                 kv::PageGeometry geo) {
  __shared__ float staged[kWarpsPerBlock][kMaxRowD];
  const int row = int(blockIdx.x) * kWarpsPerBlock + int(threadIdx.x >> 5), lane = threadIdx.x & 31;
  const int per_page = n_kv * geo.page_tokens;
  if (row >= n * per_page) return;
  const int i = row / per_page, h = (row % per_page) / geo.page_tokens, e = row % geo.page_tokens;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(exact.code) + geo.row(pairs[2 * i], h, e) * size_t(D);
  float* y = staged[threadIdx.x >> 5];
  for (int d = lane; d < D; d += 32) y[d] = ::kvq::bf16_to_f32(x[d]);
  __syncwarp();
  const size_t r = geo.row(pairs[2 * i + 1], h, e);
  uint8_t* code = side.code + side.code_offset(r);
  uint8_t* s = side.side_bytes ? side.side + side.side_offset(r) : nullptr;
  encode_row_with<F>(side, h, y, D, code, s, lane);
}

void pack_side(const GpuKvSide& side, const GpuKvSide& exact, const int32_t* pairs, int n, int n_kv, int D,
               kv::PageGeometry geo, cudaStream_t stream) {
  check_encode_tables(side, D);
  const int rows = n * n_kv * geo.page_tokens, grid = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
#define KVQ_PACK_CASE(fam)                                                                                       \
  case kv::Family::fam:                                                                                         \
    pack_rows_kernel<kv::Family::fam><<<grid, kThreads, 0, stream>>>(side, exact, pairs, n, n_kv, D, geo); \
    break;
  switch (side.family) {
    KVQ_PACK_CASE(bf16)
    KVQ_PACK_CASE(q8)
    KVQ_PACK_CASE(rq8)
    KVQ_PACK_CASE(turbo)
    KVQ_PACK_CASE(tcq)
    KVQ_PACK_CASE(iso)
    KVQ_PACK_CASE(rotor)
    KVQ_PACK_CASE(planar)
    KVQ_PACK_CASE(fp8)
    default:
      fail(Errc::unsupported, "no GPU encode kernel for KV block family ", kv::family_name(side.family));
  }
#undef KVQ_PACK_CASE
  KVQ_CUDA_CHECK_LAUNCH();
}

// One CTA per (copy, chunk of a page, layer): page src -> page dst of one
// array whose layers are layer_stride bytes apart and whose pages are
// page_bytes long. 16-byte moves when every page start is 16-byte aligned
// (page_bytes % 16 == 0; cudaMalloc bases are 256-aligned), bytes otherwise.
constexpr int kCopyThreads = 256;
__global__ void copy_pages_kernel(uint8_t* base, size_t layer_stride, size_t page_bytes, const int32_t* pairs,
                                  int chunks_per_page, size_t chunk_bytes) {
  const int copy = int(blockIdx.x) / chunks_per_page, chunk = int(blockIdx.x) % chunks_per_page;
  uint8_t* layer = base + size_t(blockIdx.y) * layer_stride;
  const size_t begin = size_t(chunk) * chunk_bytes, end = min(page_bytes, begin + chunk_bytes);
  const uint8_t* from = layer + size_t(pairs[2 * copy]) * page_bytes;
  uint8_t* to = layer + size_t(pairs[2 * copy + 1]) * page_bytes;
  if (page_bytes % 16 == 0) {
    for (size_t i = begin + size_t(threadIdx.x) * 16; i < end; i += size_t(kCopyThreads) * 16)
      *reinterpret_cast<uint4*>(to + i) = *reinterpret_cast<const uint4*>(from + i);
  } else {
    for (size_t i = begin + threadIdx.x; i < end; i += kCopyThreads) to[i] = from[i];
  }
}

}  // namespace

// Head dims served: bf16 and fp8 any D; q8 a multiple of 32; the
// Walsh-Hadamard families (rq8, turbo, tcq) 64, 128, 256; the grouped
// families (iso, rotor, planar) a multiple of 32 up to 256. A +qjl sketch
// (checked per store in encode_side; the family alone does not say) needs a
// multiple of 32 up to 256.
bool kv_encode_supported(kv::Family k, kv::Family v, int head_dim) {
  const auto ok = [&](kv::Family f) {
    if (!has_encode_hooks(f)) return false;
    switch (rotation_kind(f)) {
      case RotationKind::hadamard: return head_dim == 64 || head_dim == 128 || head_dim == 256;
      case RotationKind::identity: return f != kv::Family::q8 || head_dim % 32 == 0;
      default: return head_dim % 32 == 0 && head_dim <= 256;
    }
  };
  return ok(k) && ok(v);
}

void write_kv(const GpuKvLayer& layer, int pos, int n, const float* k, const float* v, cudaStream_t stream) {
  KVQ_CHECK(pos >= 0 && n >= 0 && int64_t(pos) + n <= layer.max_tokens, Errc::out_of_range, "GPU KV cache: tokens [",
            pos, ", ", int64_t(pos) + n, ") do not fit its capacity of ", layer.max_tokens, " tokens");
  if (n == 0) return;
  encode_side(layer.k, exact_k(layer), k, pos, nullptr, n, layer.n_kv_heads, layer.head_dim, layer.geometry(),
              stream);
  encode_side(layer.v, exact_v(layer), v, pos, nullptr, n, layer.n_kv_heads, layer.head_dim, layer.geometry(),
              stream);
}

void write_kv_slots(const GpuKvLayer& layer, const int32_t* slots_dev, int n, const float* k, const float* v,
                    cudaStream_t stream) {
  if (n == 0) return;
  encode_side(layer.k, exact_k(layer), k, 0, slots_dev, n, layer.n_kv_heads, layer.head_dim, layer.geometry(),
              stream);
  encode_side(layer.v, exact_v(layer), v, 0, slots_dev, n, layer.n_kv_heads, layer.head_dim, layer.geometry(),
              stream);
}

void write_kv_at(const GpuKvLayer& layer, const int* pos_dev, const float* k, const float* v, cudaStream_t stream) {
  write_kv_slots(layer, pos_dev, 1, k, v, stream);  // the identity table: slot = position
}

void dequantize_kv_bf16(const GpuKvLayer& layer, int n_tokens, const KvLayerView& dst, cudaStream_t stream,
                        const int32_t* pages) {
  KVQ_CHECK(n_tokens >= 0 && (pages || n_tokens <= layer.max_tokens) && n_tokens <= dst.max_tokens &&
                dst.head_dim == layer.head_dim && dst.n_kv_heads == layer.n_kv_heads,
            Errc::internal, "dequantize_kv_bf16: ", n_tokens, " tokens into a view of ", dst.max_tokens);
  const SeqRows src = layer.rows(pages);
  dequantize_side(layer.k, exact_k(layer), n_tokens, layer.n_kv_heads, layer.head_dim, src, dst.k, dst.rows(), stream);
  dequantize_side(layer.v, exact_v(layer), n_tokens, layer.n_kv_heads, layer.head_dim, src, dst.v, dst.rows(), stream);
}

void pack_kv_pages(const GpuKvLayer& layer, const int32_t* pairs_dev, int n, cudaStream_t stream) {
  KVQ_CHECK(layer.has_window() && layer.head_dim <= kMaxRowD, Errc::internal,
            "pack_kv_pages: a store without an exact window, or head_dim ", layer.head_dim);
  if (n == 0) return;
  pack_side(layer.k, layer.xk, pairs_dev, n, layer.n_kv_heads, layer.head_dim, layer.geometry(), stream);
  pack_side(layer.v, layer.xv, pairs_dev, n, layer.n_kv_heads, layer.head_dim, layer.geometry(), stream);
}

void copy_kv_pages(uint8_t* base, size_t layer_stride, int n_layers, size_t page_bytes, const int32_t* pairs_dev,
                   int n, cudaStream_t stream) {
  if (n == 0 || page_bytes == 0 || n_layers == 0) return;
  // Chunks of up to 16 KiB (four 16-byte moves per thread): enough CTAs to
  // fill the GPU for a few pages, few enough for thousands.
  const size_t chunk_bytes = size_t(kCopyThreads) * 16 * 4;
  const int chunks = int((page_bytes + chunk_bytes - 1) / chunk_bytes);
  KVQ_CHECK(int64_t(n) * chunks < (int64_t(1) << 31) && n_layers <= 65535, Errc::internal, "copy_kv_pages: ", n,
            " pages of ", page_bytes, " bytes in ", n_layers, " layers");
  copy_pages_kernel<<<dim3(unsigned(n * chunks), unsigned(n_layers)), kCopyThreads, 0, stream>>>(
      base, layer_stride, page_bytes, pairs_dev, chunks, chunk_bytes);
  KVQ_CUDA_CHECK_LAUNCH();
}

}  // namespace kvq::cuda

// The attention launches (flash_attention, flash_attention_decode_at: each
// runs the kernel choose_attention() plans) and the CUDA-core split-KV flash
// attention over bf16 rows; see attention.hpp for the work split. Shared memory per CTA (floats):
//   q_s  [R][D]          the CTA's query rows (R = G * Tq)
//   kv_s [64][D + 1]     the current K tile, then the V tile (padded: the
//                        score loop reads one key row per thread)
//   p_s  [R][64]         scores, then probabilities of the tile
//   m_s, l_s, a_s [R]    running max, running sum, rescale factor of the tile
#include "backend/cuda/attention.hpp"

#include <algorithm>
#include <cmath>

#include "backend/cuda/attention_decode.hpp"
#include "backend/cuda/attention_prefill.hpp"
#include "backend/cuda/kv_codec_hooks.cuh"
#include "backend/cuda/softmax_state.cuh"
#include "core/error.hpp"
#include "core/half.hpp"

namespace kvq::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 64;        // keys per shared-memory tile
constexpr int kMaxRowDim = 8192;  // R * D limit: bounds q_s and the accumulators
constexpr int kMaxItems = kMaxRowDim / kThreads;
constexpr int kMaxTq = 16;
constexpr int kDecodeChunkCap = 512;  // keys per chunk at most in flash_attention_decode_at (multiple of kTile)
constexpr size_t kPartialBudgetFloats = size_t(32) << 20;  // 128 MB of partial states at most

struct Params {
  const uint16_t* k;
  const uint16_t* v;
  const float* q;
  const int* pos_dev;  // when set, the position is read from here (recorded decode steps)
  float* part_m;
  float* part_l;
  float* part_o;
  SeqRows rows;  // where the sequence's token t of a KV head is (kv_store.hpp)
  int pos, n, n_heads, n_kv, D, G, Tq, chunk_len, n_chunks;
  float scale;  // scale * log2(e): scores in log2 units (softmax_state.cuh)
};

size_t smem_floats(int R, int D) { return size_t(R) * D + size_t(kTile) * (D + 1) + size_t(R) * kTile + 3 * size_t(R); }

__global__ void __launch_bounds__(kThreads) flash_attn_kernel(Params p) {
  const int pos = p.pos_dev ? *p.pos_dev : p.pos;
  const int kvh = blockIdx.x, t0 = blockIdx.y * p.Tq, chunk = blockIdx.z;
  const int D = p.D, G = p.G;
  const int nt = min(p.Tq, p.n - t0);
  const int R = G * p.Tq;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  extern __shared__ float smem[];
  float* q_s = smem;
  float* kv_s = q_s + R * D;
  float* p_s = kv_s + kTile * (D + 1);
  float* m_s = p_s + R * kTile;
  float* l_s = m_s + R;
  float* a_s = l_s + R;

  for (int e = tid; e < R * D; e += kThreads) {
    const int r = e / D, d = e % D, tq = r / G, g = r % G;
    q_s[e] = tq < nt ? p.q[(size_t(t0 + tq) * p.n_heads + kvh * G + g) * D + d] : 0.0f;
  }
  for (int r = tid; r < R; r += kThreads) {
    m_s[r] = -INFINITY;
    l_s[r] = 0.0f;
  }
  float acc[kMaxItems];
#pragma unroll
  for (int i = 0; i < kMaxItems; ++i) acc[i] = 0.0f;

  const int c0 = chunk * p.chunk_len;
  const int c1 = min(c0 + p.chunk_len, pos + t0 + nt);  // keys past the last query's position are masked anyway
  __syncthreads();

  for (int kt = c0; kt < c1; kt += kTile) {
    const int tl = min(kTile, c1 - kt);
    for (int e = tid; e < tl * D; e += kThreads) {
      const int j = e / D, d = e % D;
      kv_s[j * (D + 1) + d] = bf16_to_f32(p.k[p.rows.row(kvh, kt + j) * D + d]);
    }
    __syncthreads();
    // Scores: one (row, key) pair per thread and step.
    for (int e = tid; e < R * kTile; e += kThreads) {
      const int r = e / kTile, j = e % kTile, tq = r / G;
      float s = -INFINITY;
      if (j < tl && tq < nt && kt + j <= pos + t0 + tq) {
        const float* qr = q_s + r * D;
        const float* kr = kv_s + j * (D + 1);
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot = fmaf(qr[d], kr[d], dot);
        s = dot * p.scale;
      }
      p_s[e] = s;
    }
    __syncthreads();
    // Online softmax: one warp per row, two keys per lane.
    for (int r = warp; r < R; r += kWarps) {
      const float s0 = p_s[r * kTile + lane], s1 = p_s[r * kTile + lane + 32];
      float mt = fmaxf(s0, s1);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, mt);
      float alpha = 1.0f, p0 = 0.0f, p1 = 0.0f;
      if (m_new != -INFINITY) {
        alpha = merge_weight_log2(m_old, m_new);
        p0 = merge_weight_log2(s0, m_new);
        p1 = merge_weight_log2(s1, m_new);
      }
      float sum = p0 + p1;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      p_s[r * kTile + lane] = p0;
      p_s[r * kTile + lane + 32] = p1;
      __syncwarp();
      if (lane == 0) {
        l_s[r] = l_s[r] * alpha + sum;
        m_s[r] = m_new;
        a_s[r] = alpha;
      }
    }
    // V tile replaces the K tile (every score was computed before the sync above).
    for (int e = tid; e < tl * D; e += kThreads) {
      const int j = e / D, d = e % D;
      kv_s[j * (D + 1) + d] = bf16_to_f32(p.v[p.rows.row(kvh, kt + j) * D + d]);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kMaxItems; ++i) {
      const int e = tid + i * kThreads;
      if (e < R * D) {
        const int r = e / D, d = e % D;
        float a = acc[i] * a_s[r];
        const float* pr = p_s + r * kTile;
        for (int j = 0; j < tl; ++j) a = fmaf(pr[j], kv_s[j * (D + 1) + d], a);
        acc[i] = a;
      }
    }
    __syncthreads();
  }

  // Partial state of this chunk (unnormalised o).
#pragma unroll
  for (int i = 0; i < kMaxItems; ++i) {
    const int e = tid + i * kThreads;
    if (e < R * D) {
      const int r = e / D, d = e % D, tq = r / G, g = r % G;
      if (tq < nt) {
        const size_t idx = (size_t(t0 + tq) * p.n_heads + kvh * G + g) * p.n_chunks + chunk;
        p.part_o[idx * D + d] = acc[i];
        if (d == 0) {
          p.part_m[idx] = m_s[r];
          p.part_l[idx] = l_s[r];
        }
      }
    }
  }
}

}  // namespace

bool flash_attention_supported(int n_heads, int n_kv_heads, int head_dim, const char** why) {
  const char* reason = nullptr;
  if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0) reason = "n_heads must be a multiple of n_kv_heads";
  else if (head_dim % 32 != 0 || head_dim > 256) reason = "head_dim must be a multiple of 32 up to 256";
  else if ((n_heads / n_kv_heads) * head_dim > kMaxRowDim) reason = "GQA group * head_dim exceeds 8192";
  if (why) *why = reason;
  return reason == nullptr;
}

namespace {

// Launches attention for n queries at pos (or *pos_dev when set, n == 1) with
// the keys split into chunks as if `len` keys existed, each chunk at most
// max_chunk_len keys (0: no limit).
void launch_attention(const KvLayerView& layer, int pos, const int* pos_dev, int n, int len, int max_chunk_len,
                      const float* q, int n_heads, float scale, float* out, AttentionScratch& scratch,
                      cudaStream_t stream, const DeviceContext& ctx) {
  const int D = layer.head_dim, n_kv = layer.n_kv_heads;
  const char* why = nullptr;
  KVQ_CHECK(flash_attention_supported(n_heads, n_kv, D, &why), Errc::unsupported, "GPU attention: ", why, " (",
            n_heads, " heads, ", n_kv, " KV heads, head_dim ", D, ")");
  KVQ_CHECK(n <= 65535, Errc::out_of_range, "GPU attention: ", n,
            " query tokens in one call; at most 65535 (lower --prefill-chunk)");
  const int G = n_heads / n_kv;
  const int Tq = std::max(1, std::min({n, kMaxTq, kMaxRowDim / (G * D)}));
  const int q_tiles = (n + Tq - 1) / Tq;

  // Enough CTAs to fill the GPU twice over, within the partial-state budget.
  const int base = n_kv * q_tiles;
  int chunks_wanted = std::max(1, (2 * ctx.sm_count() + base - 1) / base);
  const size_t per_chunk = size_t(n) * n_heads * (D + 2);
  chunks_wanted = int(std::max<size_t>(1, std::min<size_t>(chunks_wanted, kPartialBudgetFloats / per_chunk)));
  int chunk_len = (len + chunks_wanted - 1) / chunks_wanted;
  chunk_len = std::max(kTile, (chunk_len + kTile - 1) / kTile * kTile);
  if (max_chunk_len > 0) chunk_len = std::min(chunk_len, max_chunk_len);
  const int n_chunks = (len + chunk_len - 1) / chunk_len;

  const size_t N = size_t(n) * n_heads * n_chunks;
  const size_t need = N * (D + 2);
  if (scratch.part.size() < need) scratch.part.resize(need);

  Params p;
  p.k = layer.k;
  p.v = layer.v;
  p.q = q;
  p.pos_dev = pos_dev;
  p.part_m = scratch.part.data();
  p.part_l = p.part_m + N;
  p.part_o = p.part_l + N;
  p.pos = pos;
  p.n = n;
  p.n_heads = n_heads;
  p.n_kv = n_kv;
  p.D = D;
  p.rows = layer.rows();
  p.G = G;
  p.Tq = Tq;
  p.chunk_len = chunk_len;
  p.n_chunks = n_chunks;
  p.scale = scale * 1.4426950408889634f;

  const size_t smem = smem_floats(G * Tq, D) * sizeof(float);
  if (smem > 48 * 1024)
    ctx.kernels().raise_limit(reinterpret_cast<const void*>(flash_attn_kernel), smem, [](size_t bytes) {
      KVQ_CUDA_CHECK(
          cudaFuncSetAttribute(flash_attn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    });
  const dim3 grid(n_kv, q_tiles, n_chunks);
  flash_attn_kernel<<<grid, kThreads, smem, stream>>>(p);
  KVQ_CUDA_CHECK_LAUNCH();
  merge_partial_states(p.part_m, p.part_l, p.part_o, n * n_heads, n_chunks, D, out, stream);
}

}  // namespace

KvLayerView::operator GpuKvLayer() const {
  GpuKvLayer g;
  g.k.family = g.v.family = kv::Family::bf16;
  g.k.code = reinterpret_cast<uint8_t*>(k);
  g.v.code = reinterpret_cast<uint8_t*>(v);
  g.k.code_bytes = g.v.code_bytes = uint32_t(2 * head_dim);
  g.n_kv_heads = n_kv_heads;
  g.head_dim = head_dim;
  g.max_tokens = max_tokens;
  g.page_tokens = page_tokens ? page_tokens : max_tokens;
  g.n_pages = n_pages;
  return g;
}

KvLayerView bf16_view(const GpuKvLayer& layer, const int32_t* pages) {
  KVQ_CHECK(layer.is_bf16(), Errc::internal, "bf16_view of a ", kv::family_name(layer.k.family), "/",
            kv::family_name(layer.v.family), " store");
  KvLayerView v{reinterpret_cast<uint16_t*>(layer.k.code), reinterpret_cast<uint16_t*>(layer.v.code),
                layer.n_kv_heads, layer.head_dim, layer.max_tokens};
  v.page_tokens = layer.page_tokens;
  v.pages = pages;
  v.n_pages = layer.n_pages;
  // A sequence over a table may hold the whole store.
  if (pages) v.max_tokens = layer.capacity();
  return v;
}

namespace {

// The plan for the store at n_heads; Errc::unsupported when there is none.
AttentionPlan checked_plan(const GpuKvLayer& layer, int n_heads, bool decode) {
  AttentionPlan plan = choose_attention(AttentionCase::of(layer, n_heads, decode));
  KVQ_CHECK(plan.supported(), Errc::unsupported, "GPU attention: ", plan.why);
  return plan;
}

bool runs_decode_instance(const AttentionPlan& plan) {
  return plan.kernel == AttentionKernel::decode_tc || plan.kernel == AttentionKernel::decode_km;
}

// A quantized store's prefix [0, len) of a sequence (its block table
// `pages`, device; null: the identity table) gathered through the table and
// dequantized into the (contiguous) scratch: the bf16 rows prefill attends
// to (AttentionPlan::dequant_prefix).
KvLayerView dequantized_prefix(const GpuKvLayer& layer, int len, AttentionScratch& scratch, cudaStream_t stream,
                               const int32_t* pages) {
  // Capacity rounded up so that growing contexts reallocate rarely.
  const int cap = std::min(pages ? layer.capacity() : layer.max_tokens, std::max(len, (len + 4095) / 4096 * 4096));
  const size_t need = size_t(layer.n_kv_heads) * cap * layer.head_dim;
  if (scratch.prefix_k.size() < need) {
    scratch.prefix_k.resize(need);
    scratch.prefix_v.resize(need);
  }
  KvLayerView view{scratch.prefix_k.data(), scratch.prefix_v.data(), layer.n_kv_heads, layer.head_dim, cap};
  dequantize_kv_bf16(layer, len, view, stream, pages);
  return view;
}

}  // namespace

void flash_attention(const GpuKvLayer& layer, int pos, int n, const float* q, int n_heads, float scale, float* out,
                     AttentionScratch& scratch, cudaStream_t stream, const DeviceContext& ctx,
                     const int32_t* pages) {
  const int cap = pages ? layer.capacity() : layer.max_tokens;
  KVQ_CHECK(pos >= 0 && n > 0 && int64_t(pos) + n <= cap, Errc::out_of_range, "GPU attention: tokens [", pos, ", ",
            int64_t(pos) + n, ") outside the cache capacity of ", cap);
  const AttentionPlan plan = checked_plan(layer, n_heads, n == 1);
  if (runs_decode_instance(plan)) {
    DecodeBatch one;
    one.pos = pos;
    if (pages) {
      one.pages = pages;
      one.table_stride = layer.n_pages;
    }
    flash_decode_batch(plan, layer, one, q, n_heads, scale, out, scratch, stream, nullptr, ctx);
    return;
  }
  // A `none` store is read in place through the table (bf16_view); a store
  // with an exact window is gathered (its window's rows copied as they are).
  const KvLayerView rows = plan.dequant_prefix || layer.has_window()
                               ? dequantized_prefix(layer, pos + n, scratch, stream, pages)
                               : bf16_view(layer, pages);
  if (plan.kernel == AttentionKernel::prefill_tc) {
    flash_attention_prefill(rows, pos, n, q, n_heads, scale, out, scratch, stream, 0, ctx);
    return;
  }
  launch_attention(rows, pos, nullptr, n, pos + n, 0, q, n_heads, scale, out, scratch, stream, ctx);
}

void flash_attention_decode_at(const GpuKvLayer& layer, const int* pos_dev, const float* q, int n_heads, float scale,
                               float* out, AttentionScratch& scratch, cudaStream_t stream, const QPrep* prep,
                               const DeviceContext& ctx) {
  KVQ_CHECK(pos_dev, Errc::internal, "flash_attention_decode_at without a position");
  KVQ_CHECK(!layer.has_window(), Errc::internal,
            "flash_attention_decode_at: a store with an exact window is attended through block tables");
  const AttentionPlan plan = checked_plan(layer, n_heads, true);
  if (runs_decode_instance(plan)) {
    flash_decode(plan, layer, 0, pos_dev, q, n_heads, scale, out, scratch, stream, prep, ctx);
    return;
  }
  KVQ_CHECK(!prep, Errc::internal, "flash_attention_decode_at: a raw q for a kernel that cannot prepare it");
  // Split as for a full cache, but with chunks of at most kDecodeChunkCap keys:
  // with a cache much larger than the current context (a big --ctx) the keys
  // that exist still spread over enough CTAs; chunks past the position exit
  // at once.
  launch_attention(bf16_view(layer), 0, pos_dev, 1, layer.max_tokens, kDecodeChunkCap, q, n_heads, scale, out,
                   scratch, stream, ctx);
}

}  // namespace kvq::cuda

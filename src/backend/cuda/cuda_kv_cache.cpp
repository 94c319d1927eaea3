#include "backend/cuda/cuda_kv_cache.hpp"

#include <algorithm>
#include <vector>

#include "backend/cuda/attention_decode.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "core/error.hpp"
#include "kv/block.hpp"
#include "kv/codebook.hpp"

namespace kvq::cuda {

void CudaLayerCache::write(int pos, int n, const float* k, const float* v) {
  write_kv(store_, pos, n, k, v, nullptr);
}

void CudaLayerCache::attend(int pos, int n, const float* q, int n_heads, float scale, float* out) const {
  flash_attention(store_, pos, n, q, n_heads, scale, out, *scratch_, nullptr);
}

namespace {
// Host int32 values into a device buffer grown on demand (ordered with the
// legacy stream these LayerCache calls run on).
const int32_t* to_device(DeviceBuffer<int32_t>& dst, const std::vector<int32_t>& src) {
  if (src.empty()) return nullptr;
  if (dst.size() < src.size()) dst.resize(src.size());
  KVQ_CUDA_CHECK(cudaMemcpy(dst.data(), src.data(), src.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  return dst.data();
}
}  // namespace

void CudaLayerCache::write_slots(const int32_t* slots, int n, const float* k, const float* v) {
  if (n <= 0) return;
  const int32_t n_slots = (store_.n_pages + store_.n_exact_pages) * store_.page_tokens;
  for (int i = 0; i < n; ++i)
    KVQ_CHECK(slots[i] >= 0 && slots[i] < n_slots, Errc::out_of_range, "GPU KV cache write at slot ", slots[i],
              " outside its ", n_slots, " slots");
  const int32_t* dev = to_device(scratch_->batch_slots, std::vector<int32_t>(slots, slots + n));
  write_kv_slots(store_, dev, n, k, v, nullptr);
}

void CudaLayerCache::attend_runs(const kv::QueryRun* runs, int n_runs, const float* q, int n_heads, float scale,
                                 float* out) const {
  if (n_runs <= 0) return;
  // Block tables [n_runs][stride], padded with page 0 (never read: a
  // sequence's keys stop at its position).
  int stride = 1;
  bool decode_batch = true;  // every run one token, run z at row z: one batched launch
  for (int z = 0; z < n_runs; ++z) {
    const kv::QueryRun& r = runs[z];
    const int all_pages = store_.n_pages + store_.n_exact_pages;
    KVQ_CHECK(r.n >= 1 && r.pos >= 0 && kv::pages_for(r.pos + r.n, store_.page_tokens) <= r.n_pages &&
                  r.n_pages <= all_pages,
              Errc::out_of_range, "GPU attention: a run of ", r.n, " tokens at position ", r.pos, " over ", r.n_pages,
              " pages of ", store_.page_tokens, " tokens (the store has ", all_pages, ")");
    for (int i = 0; i < r.n_pages; ++i)
      KVQ_CHECK(r.pages[i] >= 0 && r.pages[i] < all_pages, Errc::out_of_range, "GPU attention: page ", r.pages[i],
                " of a block table outside the store's ", all_pages);
    if (store_.has_window()) check_window_table(store_, r.pages, kv::pages_for(r.pos + r.n, store_.page_tokens));
    stride = std::max(stride, r.n_pages);
    decode_batch = decode_batch && r.n == 1 && r.first == z;
  }
  std::vector<int32_t> tables(size_t(n_runs) * stride, 0);
  std::vector<int32_t> pos(static_cast<size_t>(n_runs));
  for (int z = 0; z < n_runs; ++z) {
    std::copy(runs[z].pages, runs[z].pages + runs[z].n_pages, tables.begin() + size_t(z) * stride);
    pos[size_t(z)] = runs[z].pos;
  }
  const int32_t* tables_dev = to_device(scratch_->batch_pages, tables);
  const int32_t* pos_dev = to_device(scratch_->batch_pos, pos);
  const int D = store_.head_dim;
  const AttentionPlan plan = choose_attention(AttentionCase::of(store_, n_heads, true));
  const bool tensor_core = plan.kernel == AttentionKernel::decode_tc || plan.kernel == AttentionKernel::decode_km;
  if (decode_batch && tensor_core && flash_decode_supported(n_heads, store_.n_kv_heads, D, q, out)) {
    DecodeBatch b;
    b.n_seq = n_runs;
    b.pos_dev = pos_dev;
    b.pages = tables_dev;
    b.table_stride = stride;
    flash_decode_batch(plan, store_, b, q, n_heads, scale, out, *scratch_, nullptr);
    return;
  }
  for (int z = 0; z < n_runs; ++z) {
    const size_t row0 = size_t(runs[z].first) * n_heads * D;
    flash_attention(store_, runs[z].pos, runs[z].n, q + row0, n_heads, scale, out + row0, *scratch_, nullptr,
                    default_context(), tables_dev + size_t(z) * stride);
  }
}

CudaKvCache::CudaKvCache(const kv::CodecDescriptor& codec, const kv::CacheShape& shape, uint64_t seed,
                         bool require_attention)
    : codec_(codec), shape_(shape) {
  // Pages of shape.page_tokens rows (a multiple of the 16-key decode tile),
  // or one page of max_tokens rows: the contiguous [head][token] layout.
  if (shape_.page_tokens <= 0) shape_.page_tokens = shape.max_tokens;
  KVQ_CHECK(shape_.page_tokens % 16 == 0 || shape_.page_tokens >= shape.max_tokens, Errc::invalid_argument,
            "GPU KV cache: pages of ", shape_.page_tokens,
            " tokens; the GPU kernels need a multiple of 16 (or one page of the whole capacity)");
  if (shape_.page_tokens > shape.max_tokens) shape_.page_tokens = shape.max_tokens;
  const int n_heads = shape.n_heads > 0 ? shape.n_heads : shape.n_kv_heads;
  KVQ_CHECK(shape.n_layers > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0 && shape.max_tokens > 0,
            Errc::invalid_argument, "GPU KV cache: empty shape (", shape.n_layers, " layers, ", shape.n_kv_heads,
            " KV heads, head_dim ", shape.head_dim, ", ", shape.max_tokens, " tokens)");
  KVQ_CHECK(codec.head_dim == shape.head_dim, Errc::internal, "GPU KV cache: codec described for head_dim ",
            codec.head_dim, ", cache head_dim ", shape.head_dim);
  bool decode_tc = false;  // the decode plan is the tensor-core kernel (the exact window needs it)
  for (bool decode : {true, false}) {
    const AttentionPlan plan = choose_attention(
        AttentionCase::of(codec.k.spec, codec.v.spec, shape.head_dim, n_heads, shape.n_kv_heads, decode));
    if (!require_attention) {
      KVQ_CHECK(kv_encode_supported(codec.k.spec.family, codec.v.spec.family, shape.head_dim), Errc::unsupported,
                "KV codec ", codec.name, " has no GPU encode hooks at head_dim ", shape.head_dim);
      (decode ? decode_kernel_ : prefill_kernel_) = plan.name();  // empty when unsupported
      continue;
    }
    KVQ_CHECK(plan.supported(), Errc::unsupported, "KV codec ", codec.name, " has no GPU kernels (", plan.why,
              "); use --device cpu for it, or a codec that `kvq codecs` marks as GPU");
    (decode ? decode_kernel_ : prefill_kernel_) = plan.name();
    if (decode)
      decode_tc = plan.kernel == AttentionKernel::decode_tc || plan.kernel == AttentionKernel::decode_km;
  }
  const int n_pages = shape_.n_pages();
  const size_t rows_per_layer = size_t(n_pages) * shape.n_kv_heads * shape_.page_tokens;
  const size_t rows = rows_per_layer * shape.n_layers;
  // The exact window's store (kv_store.hpp): bf16 rows of exact_pages pages.
  KVQ_CHECK((shape.window_pages > 0) == (shape.exact_pages > 0) && shape.window_pages >= 0 && shape.exact_pages >= 0,
            Errc::invalid_argument, "GPU KV cache: a window of ", shape.window_pages, " pages with a pool of ",
            shape.exact_pages, " exact pages (each needs the other)");
  if (shape.exact_pages > 0) {
    KVQ_CHECK(shape.head_dim <= 256, Errc::unsupported, "GPU KV cache: the exact window at head_dim ",
              shape.head_dim, " (the GPU stages rows of at most 256 values)");
    KVQ_CHECK(!require_attention || decode_tc, Errc::unsupported,
              "GPU KV cache: the exact window needs the tensor-core decode kernel, and ", codec.name,
              " decodes with ", decode_kernel_);
    KVQ_CHECK(shape_.page_tokens % 16 == 0 && shape.page_tokens > 0 && shape.page_tokens <= shape.max_tokens,
              Errc::invalid_argument, "GPU KV cache: the exact window needs pages of a multiple of 16 tokens, not ",
              shape.page_tokens, " over a capacity of ", shape.max_tokens);
  }
  const size_t exact_rows_per_layer = size_t(shape.exact_pages) * shape.n_kv_heads * shape_.page_tokens;
  const size_t exact_row_bytes = size_t(2) * shape.head_dim;
  const uint64_t bytes = uint64_t(rows) * codec.bytes_per_token_per_head() +
                         uint64_t(exact_rows_per_layer) * shape.n_layers * exact_row_bytes * 2;
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
    KVQ_CHECK(bytes < free_b, Errc::out_of_range, "GPU KV cache (", codec.name, ") for ", n_pages * shape_.page_tokens,
              " tokens needs ", bytes >> 20, " MiB but only ", free_b >> 20, " MiB of GPU memory are free; lower --ctx");
  k_code_.resize(rows * codec.k.code_bytes);
  v_code_.resize(rows * codec.v.code_bytes);
  if (codec.k.side_bytes) k_side_.resize(rows * codec.k.side_bytes);
  if (codec.v.side_bytes) v_side_.resize(rows * codec.v.side_bytes);
  if (exact_rows_per_layer) {
    k_exact_.resize(exact_rows_per_layer * shape.n_layers * exact_row_bytes);
    v_exact_.resize(exact_rows_per_layer * shape.n_layers * exact_row_bytes);
  }
  allocated_ = k_code_.bytes() + v_code_.bytes() + k_side_.bytes() + v_side_.bytes() + k_exact_.bytes() +
               v_exact_.bytes();
  // Zeroed once so unwritten rows decode to finite values (they are never
  // read: attention is causal and masks the tail of its last tile).
  for (DeviceBuffer<uint8_t>* b : {&k_code_, &v_code_, &k_side_, &v_side_, &k_exact_, &v_exact_})
    if (b->size()) KVQ_CUDA_CHECK(cudaMemset(b->data(), 0, b->bytes()));
  // Rotation tables, codebooks and QJL sketches of each side, from the CPU
  // blocks themselves (the same seed, layer, head and side: the same maps and
  // levels, exactly).
  auto upload_tables = [&](const kv::SideDescriptor& d, kv::Side which, SideTables& dst) {
    const RotationKind kind = rotation_kind(d.spec.family);
    const bool codebook = d.codebook || d.trellis;
    if (kind == RotationKind::identity && !codebook && !d.spec.qjl) return;
    dst.rot_stride = uint32_t(rotation_table_floats(kind, shape.head_dim));
    std::vector<float> rot, qjl, book;
    for (int l = 0; l < shape.n_layers; ++l)
      for (int h = 0; h < shape.n_kv_heads; ++h) {
        const kv::BlockTables t = kv::make_block(d.spec, shape.head_dim, seed, l, h, which)->tables();
        KVQ_CHECK(t.rotation.size() == dst.rot_stride, Errc::internal, "GPU KV cache: ", d.spec.name(), " has a ",
                  t.rotation_kind, " rotation table of ", t.rotation.size(), " floats, the GPU expects ",
                  dst.rot_stride);
        rot.insert(rot.end(), t.rotation.begin(), t.rotation.end());
        if (d.spec.qjl) {
          KVQ_CHECK(t.qjl_projection.size() == size_t(shape.head_dim) * shape.head_dim, Errc::internal,
                    "GPU KV cache: a QJL sketch that is not D x D");
          qjl.insert(qjl.end(), t.qjl_projection.begin(), t.qjl_projection.end());
        }
        if (l == 0 && h == 0) {  // codebooks are the same for every (layer, head)
          if (d.trellis) {
            book = t.tcq_levels;
            dst.tcq_g0 = t.tcq_g0;
            dst.tcq_g1 = t.tcq_g1;
            KVQ_CHECK(t.tcq_memory == 5, Errc::internal, "GPU KV cache: the GPU decodes 6-bit tcq windows");
          } else if (d.codebook) {
            book = t.codebook;
            const auto& lm = kv::lloyd_max_gaussian(d.spec.bits);
            book.insert(book.end(), lm.thresholds_f.begin(), lm.thresholds_f.end());
          }
        }
      }
    if (!rot.empty()) dst.rot.upload(rot);
    if (!qjl.empty()) dst.qjl.upload(qjl);
    if (!book.empty()) dst.codebook.upload(book);
  };
  upload_tables(codec.k, kv::Side::k, k_tables_);
  upload_tables(codec.v, kv::Side::v, v_tables_);
  layers_.reserve(shape.n_layers);
  auto side_of = [&](const kv::SideDescriptor& d, DeviceBuffer<uint8_t>& code, DeviceBuffer<uint8_t>& side, int l,
                     const SideTables& tb) {
    GpuKvSide s;
    s.family = d.spec.family;
    s.bits = d.spec.bits;
    s.code_bytes = d.code_bytes;
    s.side_bytes = d.side_bytes;
    s.code = code.data() + rows_per_layer * d.code_bytes * l;
    s.side = d.side_bytes ? side.data() + rows_per_layer * d.side_bytes * l : nullptr;
    const size_t heads_before = size_t(l) * shape.n_kv_heads;
    s.rot_stride = tb.rot_stride;
    s.rot = tb.rot.size() ? tb.rot.data() + heads_before * tb.rot_stride : nullptr;
    s.codebook = tb.codebook.size() ? tb.codebook.data() : nullptr;
    s.tcq_g0 = tb.tcq_g0;
    s.tcq_g1 = tb.tcq_g1;
    s.has_qjl = d.spec.qjl;
    s.qjl = tb.qjl.size() ? tb.qjl.data() + heads_before * shape.head_dim * shape.head_dim : nullptr;
    s.qjl_code_offset = d.qjl_code_offset;
    s.qjl_side_offset = d.qjl_side_offset;
    return s;
  };
  for (int l = 0; l < shape.n_layers; ++l) {
    GpuKvLayer store;
    store.k = side_of(codec.k, k_code_, k_side_, l, k_tables_);
    store.v = side_of(codec.v, v_code_, v_side_, l, v_tables_);
    store.n_kv_heads = shape.n_kv_heads;
    store.head_dim = shape.head_dim;
    store.max_tokens = shape.max_tokens;
    store.page_tokens = shape_.page_tokens;
    store.n_pages = n_pages;
    if (exact_rows_per_layer) {
      for (auto [side, buf] : {std::pair{&store.xk, &k_exact_}, std::pair{&store.xv, &v_exact_}}) {
        side->family = kv::Family::bf16;
        side->bits = 16;
        side->code_bytes = uint32_t(exact_row_bytes);
        side->code = buf->data() + exact_rows_per_layer * exact_row_bytes * l;
      }
      store.n_exact_pages = shape.exact_pages;
      store.window_pages = shape.window_pages;
    }
    layers_.emplace_back(store, &scratch_, this, l);
  }
}

kv::LayerCache& CudaKvCache::layer(int i) {
  KVQ_CHECK(i >= 0 && i < shape_.n_layers, Errc::internal, "GPU KV cache: layer ", i, " of ", shape_.n_layers);
  return layers_[i];
}

uint64_t CudaKvCache::bytes_for_tokens(int n_tokens) const {
  return uint64_t(n_tokens) * shape_.n_layers * shape_.n_kv_heads * codec_.bytes_per_token_per_head();
}

const int32_t* CudaKvCache::upload_pairs(const std::vector<int32_t>& pairs) {
  // Synchronous upload: the previous copy's kernels have read the old pairs.
  if (copy_pairs_.size() < pairs.size()) copy_pairs_.resize(pairs.size());
  KVQ_CUDA_CHECK(cudaMemcpy(copy_pairs_.data(), pairs.data(), pairs.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  return copy_pairs_.data();
}

void CudaKvCache::copy_pages(const int32_t* src, const int32_t* dst, int n) {
  const int n_pages = shape_.n_pages();
  kv::check_page_copy(src, dst, n, shape_.total_pages());
  // Pairs within the packed store, then pairs within the window's store
  // (ids less n_pages there).
  std::vector<int32_t> packed, exact;
  for (int i = 0; i < n; ++i) {
    KVQ_CHECK(shape_.is_exact_page(src[i]) == shape_.is_exact_page(dst[i]), Errc::invalid_argument,
              "a copy of KV page ", src[i], " to page ", dst[i],
              " crosses between the packed and the exact store (pack_pages moves rows there)");
    std::vector<int32_t>& to = shape_.is_exact_page(src[i]) ? exact : packed;
    const int32_t base = shape_.is_exact_page(src[i]) ? n_pages : 0;
    to.push_back(src[i] - base);
    to.push_back(dst[i] - base);
  }
  const size_t rows_per_page = size_t(shape_.n_kv_heads) * shape_.page_tokens;
  auto copy = [&](DeviceBuffer<uint8_t>& array, uint32_t row_bytes, int pages, const int32_t* pairs, int count) {
    if (!array.size() || !row_bytes || !count) return;
    copy_kv_pages(array.data(), rows_per_page * size_t(pages) * row_bytes, shape_.n_layers, rows_per_page * row_bytes,
                  pairs, count, nullptr);
  };
  if (!packed.empty()) {
    const int32_t* pairs = upload_pairs(packed);
    const int count = int(packed.size() / 2);
    copy(k_code_, codec_.k.code_bytes, n_pages, pairs, count);
    copy(k_side_, codec_.k.side_bytes, n_pages, pairs, count);
    copy(v_code_, codec_.v.code_bytes, n_pages, pairs, count);
    copy(v_side_, codec_.v.side_bytes, n_pages, pairs, count);
  }
  if (!exact.empty()) {
    const int32_t* pairs = upload_pairs(exact);
    const int count = int(exact.size() / 2);
    const uint32_t row_bytes = uint32_t(2 * shape_.head_dim);
    copy(k_exact_, row_bytes, shape_.exact_pages, pairs, count);
    copy(v_exact_, row_bytes, shape_.exact_pages, pairs, count);
  }
}

void CudaKvCache::pack_pages(const int32_t* exact, const int32_t* packed, int n) {
  KVQ_CHECK(shape_.exact_pages > 0, Errc::unsupported, "this KV store has no exact window to pack pages from");
  kv::check_page_copy(exact, packed, n, shape_.total_pages());
  std::vector<int32_t> pairs;
  for (int i = 0; i < n; ++i) {
    KVQ_CHECK(shape_.is_exact_page(exact[i]) && !shape_.is_exact_page(packed[i]), Errc::invalid_argument,
              "pack_pages from page ", exact[i], " to page ", packed[i], ": the first must be an exact page (>= ",
              shape_.n_pages(), "), the second a packed one");
    pairs.push_back(exact[i] - shape_.n_pages());
    pairs.push_back(packed[i]);
  }
  if (n == 0) return;
  const int32_t* dev = upload_pairs(pairs);
  for (const CudaLayerCache& l : layers_) pack_kv_pages(l.view(), dev, n, nullptr);
}

void check_window_table(const GpuKvLayer& store, const int32_t* pages, int used) {
  int first_exact = used;
  while (first_exact > 0 && pages[first_exact - 1] >= store.n_pages) --first_exact;
  for (int i = 0; i < first_exact; ++i)
    KVQ_CHECK(pages[i] < store.n_pages, Errc::invalid_argument, "GPU attention: exact page ", pages[i],
              " at entry ", i, " of a block table before packed ones (a window is the table's last pages)");
  KVQ_CHECK(used - first_exact <= store.window_pages, Errc::invalid_argument, "GPU attention: a block table with ",
            used - first_exact, " exact pages in a window of ", store.window_pages);
}

std::vector<const void*> CudaKvCache::graph_addresses() const {
  // The cache's id first: a new cache whose buffers land at a freed one's
  // addresses (its shape or codec may differ) never replays its recording.
  return {reinterpret_cast<const void*>(uintptr_t(id())), k_code_.data(), k_side_.data(), v_code_.data(),
          v_side_.data(), k_exact_.data(), v_exact_.data(), k_tables_.rot.data(), v_tables_.rot.data(), k_tables_.qjl.data(), k_tables_.codebook.data(),
          v_tables_.codebook.data(), scratch_.part.data(), scratch_.decode_counters.data()};
}

std::unique_ptr<kv::Cache> make_cuda_kv_cache(const kv::CodecOptions& opts, const kv::CacheShape& shape) {
  const kv::ResolvedCodec codec = kv::resolve_codec(opts);  // unknown names: invalid_argument listing the valid ones
  return std::make_unique<CudaKvCache>(kv::describe_codec(codec, shape.head_dim), shape, opts.seed);
}

std::unique_ptr<kv::Cache> make_cuda_kv_store_for_test(const kv::CodecOptions& opts, const kv::CacheShape& shape) {
  const kv::ResolvedCodec codec = kv::resolve_codec(opts);
  return std::make_unique<CudaKvCache>(kv::describe_codec(codec, shape.head_dim), shape, opts.seed, false);
}

}  // namespace kvq::cuda

#include "engine/runtime.hpp"

#include <algorithm>
#include <cctype>
#include <climits>

#include "backend/cpu/f32_cache.hpp"
#include "core/error.hpp"
#include "core/text.hpp"
#include "model/forward.hpp"
#include "model/model_spec.hpp"

namespace kvq {

CodecRequest CodecRequest::parse(const std::string& text, const std::string& where) {
  const std::string item = ascii_lower(trim_space(text));
  KVQ_CHECK(!item.empty(), Errc::invalid_argument, "empty codec name in ", where);
  CodecRequest c;
  if (item == "f32") return reference_f32();
  if (const size_t slash = item.find('/'); slash != std::string::npos) {  // K/V block pair
    c.codec.ctk = item.substr(0, slash);
    c.codec.ctv = item.substr(slash + 1);
    KVQ_CHECK(!c.codec.ctk.empty() && !c.codec.ctv.empty(), Errc::invalid_argument, "'", text, "' in ", where,
              ": a K/V block pair names both blocks, e.g. turbo3/bf16 (blocks as in `kvq codecs`)");
    kv::resolve_codec(c.codec);  // throws naming the bad block and listing the valid ones
    return c;
  }
  const std::string qjl = "+qjl";
  std::string base = item;
  if (base.size() > qjl.size() && base.compare(base.size() - qjl.size(), qjl.size(), qjl) == 0) {
    base.resize(base.size() - qjl.size());
    c.codec.rotor_qjl = true;
  }
  const kv::CodecInfo* info = kv::find_codec(base);
  KVQ_CHECK(info, Errc::invalid_argument, "unknown codec '", text, "' in ", where, "; give a codec (",
            kv::codec_names_list(), "), a rotor codec with +qjl (e.g. rotor3_sym+qjl), a K/V block pair ",
            "(e.g. turbo3/bf16, q8/turbo2; blocks as in `kvq codecs`), f32 (the exact fp32 cache, CPU only) or all");
  c.codec.kv = info->name;
  const auto r = kv::resolve_codec(c.codec);
  KVQ_CHECK(!c.codec.rotor_qjl || r.k.qjl, Errc::invalid_argument, "'", text,
            "': +qjl here means --rotor-qjl on, which only applies to codecs with a rotor K side; ",
            "for another K block write a pair, e.g. turbo3+qjl/turbo3");
  return c;
}

CodecRequest CodecRequest::from_flags(const kv::CodecOptions& codec, const std::string& rotor_qjl, bool f32_kv) {
  KVQ_CHECK(rotor_qjl == "on" || rotor_qjl == "off", Errc::invalid_argument, "--rotor-qjl is on or off, not '",
            rotor_qjl, "'");
  CodecRequest c;
  c.codec = codec;
  c.codec.rotor_qjl = rotor_qjl == "on";
  if (f32_kv) {
    KVQ_CHECK(codec.kv == "none" && codec.ctk.empty() && codec.ctv.empty() && !c.codec.rotor_qjl,
              Errc::invalid_argument,
              "--f32-kv is the exact fp32 reference cache, no codec: drop --kv, --ctk, --ctv and --rotor-qjl");
    return reference_f32();
  }
  kv::resolve_codec(c.codec);  // an unknown name fails here, listing the valid ones
  return c;
}

std::optional<kv::ResolvedCodec> CodecRequest::resolve() const {
  if (f32) return std::nullopt;
  return kv::resolve_codec(codec);
}

int CodecRequest::window_for(int asked) const {
  KVQ_CHECK(asked >= kWindowAuto, Errc::invalid_argument, "--kv-window ", asked, " pages (0: none; auto: the default)");
  if (asked != kWindowAuto) return asked;
  if (f32) return 0;
  const kv::ResolvedCodec r = kv::resolve_codec(codec);
  return r.k.bits < 8 || r.v.bits <= 3 ? kDefaultWindowPages : 0;
}

std::string CodecRequest::label() const {
  if (f32) return "f32";
  const kv::ResolvedCodec r = kv::resolve_codec(codec);
  const std::string window = kv::exact_window_suffix(std::max(codec.exact_window_pages, window_pages));
  if (!codec.ctk.empty() || !codec.ctv.empty()) return r.k.name() + "/" + r.v.name() + window;
  return r.name + window;
}

kv::CacheShape session_shape(const Model& m, int ctx) {
  kv::CacheShape s = m.cache_shape(ctx);
  if (m.backend().options().session_one_page) s.page_tokens = std::max(ctx, 1);
  return s;
}

kv::CacheShape pool_shape(const Model& m, int pages, int page_tokens) {
  KVQ_CHECK(pages >= 1 && page_tokens >= 1, Errc::invalid_argument, "a KV pool needs at least one page of one token (",
            pages, " pages of ", page_tokens, " tokens asked)");
  KVQ_CHECK(int64_t(pages) * page_tokens <= INT32_MAX, Errc::invalid_argument, "a KV pool of ", pages, " pages of ",
            page_tokens, " tokens is more tokens than kvq can address");
  kv::CacheShape s = m.cache_shape(pages * page_tokens);
  s.page_tokens = page_tokens;
  return s;
}

namespace {

std::unique_ptr<kv::Cache> make_store(Model& m, const CodecRequest& r, kv::CacheShape shape, int max_seqs) {
  Backend& be = m.backend();
  KVQ_CHECK(r.window_pages >= 0, Errc::invalid_argument, "--kv-window ", r.window_pages, " pages (0: none)");
  if (r.window_pages > 0 && !r.f32) {
    KVQ_CHECK(max_seqs > 0, Errc::internal, "a paged pool with an exact window needs its number of sequences");
    KVQ_CHECK(int64_t(max_seqs) * r.window_pages <= INT32_MAX / shape.page_tokens, Errc::invalid_argument,
              "--kv-window ", r.window_pages, " pages for ", max_seqs, " sequences is more than kvq can address");
    shape.window_pages = r.window_pages;
    shape.exact_pages = max_seqs * r.window_pages;
  }
  if (r.f32) {
    // The one place that chooses the fp32 reference cache: the CPU backend's.
    KVQ_CHECK(std::string(be.name()) == "cpu", Errc::unsupported,
              "f32 (--f32-kv; f32 in kvq eval) is the CPU backend's exact fp32 reference cache; the ", be.name(),
              " backend has none: on --device ", be.name(), " drop --f32-kv (kvq eval: use --ref none)");
    return cpu::make_f32_cache(shape);
  }
  return be.make_cache(r.codec, shape);  // the backend's own cache (device memory on CUDA)
}

}  // namespace

int session_window_pages(const Model& m, const CodecRequest& r, int ctx) {
  if (!r.window_auto || r.window_pages == 0) return r.window_pages;
  const kv::CacheShape s = session_shape(m, ctx);
  const bool one_page = m.backend().options().session_one_page;
  return one_page || int64_t(ctx) <= int64_t(r.window_pages) * s.page_tokens ? 0 : r.window_pages;
}

std::unique_ptr<kv::Cache> make_session_cache(Model& m, const CodecRequest& asked, int ctx) {
  CodecRequest r = asked;
  r.window_pages = session_window_pages(m, asked, ctx);
  KVQ_CHECK(r.window_pages == 0 || !m.backend().options().session_one_page, Errc::invalid_argument,
            "--kv-window with --kv-one-page: a window is counted in pages, and that cache is one page");
  return make_store(m, r, session_shape(m, ctx), 1);
}

std::unique_ptr<kv::Cache> make_paged_pool(Model& m, const CodecRequest& r, int pages, int page_tokens, int max_seqs) {
  std::unique_ptr<kv::Cache> store = make_store(m, r, pool_shape(m, pages, page_tokens), max_seqs);
  KVQ_CHECK(store->shape().page_tokens == page_tokens && store->shape().n_pages() == pages, Errc::unsupported, "the ",
            m.backend().name(), " backend has no paged KV store for a pool of ", pages, " pages of ", page_tokens,
            " tokens");
  return store;
}

uint64_t measured_page_bytes(Model& m, const CodecRequest& r, int page_tokens) {
  CodecRequest packed = r;  // the codec's page, without a window
  packed.window_pages = 0;
  return make_paged_pool(m, packed, 1, page_tokens)->bytes_for_tokens(page_tokens);
}

Runtime Runtime::open(const std::string& device, const BackendOptions& options, const std::string& model_spec) {
  return open(make_backend(device, options), model_spec);
}

Runtime Runtime::open(std::unique_ptr<Backend> backend, const std::string& model_spec) {
  KVQ_CHECK(backend, Errc::internal, "Runtime::open: no backend");
  Runtime rt;
  rt.backend = std::move(backend);
  rt.model = open_model(model_spec, *rt.backend);
  return rt;
}

}  // namespace kvq

// The one assembly point: backend + model, and the KV caches made for them.
//
// Every command that runs a model (run, chat, serve, eval, bench) gets its
// backend and model from a Runtime and its KV cache from the functions here,
// asking for the cache with a CodecRequest: what the user asked for, built
// per use (from the CLI flags, an eval list entry, a bench cell) and never
// changed afterwards. The fp32 reference cache (f32, `--f32-kv`) is one case
// of it, chosen here and nowhere above the backend.
//
// Two cache forms:
//   - a Session cache: one sequence of `ctx` tokens (Session, run, chat,
//     eval, the bench's one-sequence cells);
//   - a paged pool: a store of `pages` pages of `page_tokens` rows shared by
//     many sequences through block tables (BatchDecoder, Scheduler: the
//     bench's --batch cells and `kvq serve`).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "backend/backend.hpp"
#include "kv/cache.hpp"
#include "kv/codec_table.hpp"
#include "kv/page.hpp"

namespace kvq {

class Model;

// What a user asks for as a KV cache: a codec (a named codec, optionally with
// per-side K/V blocks and the QJL sketch on a rotor K side), or f32, the CPU
// backend's exact fp32 reference cache (no codec at all).
struct CodecRequest {
  kv::CodecOptions codec;  // --kv, --ctk, --ctv, --rotor-qjl (unused for f32)
  bool f32 = false;        // --f32-kv, or `f32` in a list
  // --kv-window: the exact recent window of each sequence, in pages
  // (kv::CacheShape::window_pages; the stores made below take it). 0: none.
  // The CLI's default (kWindowAuto) becomes window_for(kWindowAuto).
  int window_pages = 0;

  // What --kv-window's default means: the codec's default window, resolved
  // per codec by window_for().
  static constexpr int kWindowAuto = -1;
  // The default window: one 64-token page, for the codecs whose error it
  // cuts most. Measured (docs/quality.md, docs/perf.md, session 18): on
  // held-out text at 4k it takes every codec's mean KL to 0.25-0.51x; the
  // codecs with a K side under 8 bits or a V side of 3 bits or fewer have a
  // mean KL of 0.004-0.065 alone (tsym3 0.032 -> 0.014, k8vturbo2 0.030 ->
  // 0.009), the others (8-bit K with a V of 4 bits or more, fp8) 0.0016-0.0022,
  // where the window would only cost its decode time (5-20 % on the H200
  // today).
  static constexpr int kDefaultWindowPages = 1;
  // The window for this request given --kv-window's value `asked`: asked
  // itself when >= 0; for kWindowAuto, kDefaultWindowPages for a codec with
  // a K side under 8 bits or a V side of 3 bits or fewer, else 0 (`none`,
  // f32, k8v8, k8v4, fp8, ...).
  int window_for(int asked) const;
  // Sets window_pages from --kv-window's value (window_for) and notes
  // whether it was the default.
  void set_window(int asked) {
    window_pages = window_for(asked);
    window_auto = asked == kWindowAuto;
  }
  // Whether window_pages came from the default (set_window(kWindowAuto)):
  // then a one-sequence cache that the window would fill whole, or one of a
  // single page (--kv-one-page), takes none (session_window_pages).
  bool window_auto = false;

  // One text entry, case-insensitive: a codec name or alias ("k8v4"), a rotor
  // codec with the QJL sketch ("rotor3_sym+qjl"), a K/V block pair
  // ("turbo3/bf16", "turbo3+qjl/turbo3") or "f32". `where` names the option
  // in errors ("--codecs"). Throws Errc::invalid_argument naming the bad part
  // and listing the valid forms.
  static CodecRequest parse(const std::string& text, const std::string& where = "--codecs");
  // The CLI's flags: --kv/--ctk/--ctv, --rotor-qjl on|off, --f32-kv. Throws
  // for an unknown codec or block, a --rotor-qjl other than on/off, and
  // --f32-kv with a codec flag.
  static CodecRequest from_flags(const kv::CodecOptions& codec, const std::string& rotor_qjl, bool f32_kv);
  static CodecRequest reference_f32() { return CodecRequest{{}, true}; }

  // The codec's blocks; nullopt for f32. Throws for an unknown codec or block.
  std::optional<kv::ResolvedCodec> resolve() const;
  // Canonical: "k8v4", "rotor3_sym+qjl", "turbo3/bf16" (a request with
  // per-side blocks), "f32"; "+winW" after it with an exact window of W
  // pages (kv::CodecOptions::exact_window_pages).
  std::string label() const;
  bool operator==(const CodecRequest& o) const { return label() == o.label(); }
};

// Cache shapes, the same in every place that asks: a Session cache of ctx
// tokens, and a pool of `pages` pages of `page_tokens` rows.
kv::CacheShape session_shape(const Model& m, int ctx);
kv::CacheShape pool_shape(const Model& m, int pages, int page_tokens = kv::kDefaultPageTokens);

// A one-sequence cache of ctx tokens on the model's backend (device memory on
// CUDA). f32 on a backend without it, or a codec the backend has no kernels
// for: Errc::unsupported.
std::unique_ptr<kv::Cache> make_session_cache(Model& m, const CodecRequest& r, int ctx);
// The window pages such a cache gets: r.window_pages, but none for a default
// window (CodecRequest::window_auto) where the window would hold the whole
// context (ctx <= its tokens: no row would ever be encoded) or the cache is
// one page (--kv-one-page).
int session_window_pages(const Model& m, const CodecRequest& r, int ctx);
// A paged pool of `pages` pages of `page_tokens` rows; a backend that would
// not page it so: Errc::unsupported. With an exact window, `max_seqs`
// sequences' windows in a second pool (exact pages), which must be given.
std::unique_ptr<kv::Cache> make_paged_pool(Model& m, const CodecRequest& r, int pages,
                                           int page_tokens = kv::kDefaultPageTokens, int max_seqs = 0);
// Bytes of one page of the request's store, measured on a one-page pool.
uint64_t measured_page_bytes(Model& m, const CodecRequest& r, int page_tokens = kv::kDefaultPageTokens);

// Backend and model, owned together (the model is destroyed first).
struct Runtime {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;

  // A backend for `device` (cpu, cuda), then the model (a GGUF path or
  // synthetic:SHAPE) on it. The backend comes first: --device cuda fails
  // before the model is read.
  static Runtime open(const std::string& device, const BackendOptions& options, const std::string& model_spec);
  // The model on a backend made elsewhere (tests pass their own).
  static Runtime open(std::unique_ptr<Backend> backend, const std::string& model_spec);

  std::unique_ptr<kv::Cache> session_cache(const CodecRequest& r, int ctx) const {
    return make_session_cache(*model, r, ctx);
  }
  std::unique_ptr<kv::Cache> paged_pool(const CodecRequest& r, int pages,
                                        int page_tokens = kv::kDefaultPageTokens) const {
    return make_paged_pool(*model, r, pages, page_tokens, 0);
  }
};

}  // namespace kvq

// engine/runtime: the one assembly point. CodecRequest parsing and its
// errors, Session caches and paged pools for several codecs, f32 chosen
// there (and refused by a backend without it), and the same request giving
// the same store in every form it is written in.
#include <gtest/gtest.h>

#include <string>

#include "backend/cpu/cpu_backend.hpp"
#include "backend_test_util.hpp"
#include "core/error.hpp"
#include "engine/runtime.hpp"
#include "eval/codecs.hpp"
#include "forward_test_util.hpp"
#include "kv/cache.hpp"
#include "model/forward.hpp"

using namespace kvq;

namespace {

// The message of the kvq::Error that f() throws, with its code checked.
template <class F>
std::string error_of(F f, Errc code = Errc::invalid_argument) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return {};
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

struct Tiny {
  std::unique_ptr<Backend> backend = cpu::make_cpu_backend();
  std::unique_ptr<testutil::TinyModel> tiny = testutil::make_tiny(Arch::qwen3, gguf::TensorType::F32, 5);
  std::unique_ptr<Model> model =
      std::make_unique<Model>(tiny->cfg, load_weights(tiny->cfg, tiny->t.lookup()), *backend);
};

void expect_same_shape(const kv::CacheShape& a, const kv::CacheShape& b) {
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.n_kv_heads, b.n_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.max_tokens, b.max_tokens);
  EXPECT_EQ(a.page_tokens, b.page_tokens);
  EXPECT_EQ(a.n_pages(), b.n_pages());
}

}  // namespace

TEST(CodecRequest, ParsesEveryForm) {
  EXPECT_EQ(CodecRequest::parse("K8V4").label(), "k8v4");
  EXPECT_FALSE(CodecRequest::parse("k8v4").f32);
  EXPECT_EQ(CodecRequest::parse(" rotor3_sym+qjl ").label(), "rotor3_sym+qjl");
  EXPECT_TRUE(CodecRequest::parse("rotor3_sym+qjl").codec.rotor_qjl);
  const CodecRequest pair = CodecRequest::parse("turbo3/BF16");
  EXPECT_EQ(pair.label(), "turbo3/bf16");
  EXPECT_EQ(pair.resolve()->k.name(), "turbo3");
  EXPECT_EQ(pair.resolve()->v.name(), "bf16");
  const CodecRequest f32 = CodecRequest::parse("f32");
  EXPECT_TRUE(f32.f32);
  EXPECT_EQ(f32.label(), "f32");
  EXPECT_FALSE(f32.resolve().has_value());
  EXPECT_EQ(CodecRequest{}.label(), "none");  // the default request: codec none
  EXPECT_EQ(CodecRequest::parse("f32"), CodecRequest::reference_f32());
}

TEST(CodecRequest, ErrorsNameTheBadPart) {
  EXPECT_TRUE(has(error_of([] { CodecRequest::parse("turbo5", "--codecs"); }), "'turbo5' in --codecs"));
  EXPECT_TRUE(has(error_of([] { CodecRequest::parse("turbo5"); }), "k8v4"));  // lists the valid names
  EXPECT_TRUE(has(error_of([] { CodecRequest::parse(""); }), "empty codec name"));
  EXPECT_TRUE(has(error_of([] { CodecRequest::parse("k8v4+qjl"); }), "rotor K side"));
  EXPECT_TRUE(has(error_of([] { CodecRequest::parse("turbo3/"); }), "both blocks"));
  EXPECT_TRUE(has(error_of([] { CodecRequest::parse("turbo3/nope"); }), "nope"));
  EXPECT_TRUE(has(error_of([] { CodecRequest::parse("nope/turbo3"); }), "nope"));

  kv::CodecOptions c;
  c.kv = "k8v4";
  EXPECT_TRUE(has(error_of([&] { CodecRequest::from_flags(c, "off", true); }), "--f32-kv"));
  EXPECT_TRUE(has(error_of([&] { CodecRequest::from_flags(c, "maybe", false); }), "'maybe'"));
  c.kv = "nope";
  EXPECT_TRUE(has(error_of([&] { CodecRequest::from_flags(c, "off", false); }), "nope"));
}

TEST(CodecRequest, FlagsBuildAFreshValue) {
  kv::CodecOptions c;
  c.kv = "rotor3_sym";
  const CodecRequest on = CodecRequest::from_flags(c, "on", false);
  EXPECT_EQ(on.label(), "rotor3_sym+qjl");
  EXPECT_FALSE(c.rotor_qjl);  // the flags are not changed
  const CodecRequest off = CodecRequest::from_flags(c, "off", false);
  EXPECT_EQ(off.label(), "rotor3_sym");
  EXPECT_TRUE(CodecRequest::from_flags({}, "off", true).f32);
  c = {};
  c.ctk = "q8";
  c.ctv = "turbo2";
  EXPECT_EQ(CodecRequest::from_flags(c, "off", false).label(), "q8/turbo2");
}

// --kv-window's default (auto): one exact page for a K side under 8 bits or
// a V side of 3 bits or fewer, none for the others and f32; an explicit
// value as given; a one-sequence cache that the default
// window would fill whole takes none, an explicit one keeps it.
TEST(CodecRequest, DefaultWindowPerCodec) {
  Tiny t;
  const int A = CodecRequest::kWindowAuto;
  for (const char* name : {"none", "f32", "k8v8", "fp8", "k8v4", "iso4", "rot_k_tq4v", "bf16/q8"})
    EXPECT_EQ(CodecRequest::parse(name).window_for(A), 0) << name;
  for (const char* name : {"tsym3", "tsym4", "k8vturbo3", "k8vturbo2tcq", "iso3", "k_rotor4", "rotor3_sym+qjl",
                           "turbo3/bf16", "q8/turbo2"}) {
    EXPECT_EQ(CodecRequest::parse(name).window_for(A), CodecRequest::kDefaultWindowPages) << name;
    EXPECT_EQ(CodecRequest::parse(name).window_for(0), 0) << name;
    EXPECT_EQ(CodecRequest::parse(name).window_for(3), 3) << name;
  }
  EXPECT_TRUE(has(error_of([] { CodecRequest::parse("tsym3").window_for(-2); }), "--kv-window -2"));
  CodecRequest r = CodecRequest::parse("tsym3");
  r.set_window(A);
  EXPECT_TRUE(r.window_auto);
  EXPECT_EQ(r.label(), "tsym3+win1");
  EXPECT_EQ(session_window_pages(*t.model, r, 64), 0);  // the window would hold all 64 tokens
  EXPECT_EQ(session_window_pages(*t.model, r, 65), 1);
  EXPECT_EQ(make_session_cache(*t.model, r, 40)->shape().window_pages, 0);
  EXPECT_EQ(make_session_cache(*t.model, r, 200)->shape().window_pages, 1);
  EXPECT_EQ(make_session_cache(*t.model, r, 200)->codec_name(), "tsym3+win1");
  r.set_window(1);
  EXPECT_FALSE(r.window_auto);
  EXPECT_EQ(session_window_pages(*t.model, r, 40), 1);
}

TEST(Runtime, SessionCachesAndPagedPoolsForSeveralCodecs) {
  Tiny t;
  for (const char* name : {"none", "k8v4", "tsym3", "rotor3_sym+qjl", "turbo3/bf16", "f32"}) {
    SCOPED_TRACE(name);
    const CodecRequest r = CodecRequest::parse(name);
    auto session = make_session_cache(*t.model, r, 100);
    expect_same_shape(session->shape(), session_shape(*t.model, 100));
    EXPECT_EQ(session->shape().max_tokens, 100);
    auto pool = make_paged_pool(*t.model, r, 5, 16);
    expect_same_shape(pool->shape(), pool_shape(*t.model, 5, 16));
    EXPECT_EQ(pool->shape().page_tokens, 16);
    EXPECT_EQ(pool->shape().n_pages(), 5);
    EXPECT_EQ(pool->codec_name(), session->codec_name());
    EXPECT_EQ(measured_page_bytes(*t.model, r, 16), pool->bytes_for_tokens(16));
    if (!r.f32) EXPECT_EQ(session->codec_name(), kv::resolve_codec(r.codec).name);
  }
  EXPECT_TRUE(has(error_of([&] { pool_shape(*t.model, 0, 64); }), "at least one page"));
}

// One request, written as CLI flags, as an eval list entry or parsed, gives
// the same store: codec, shape and bytes.
TEST(Runtime, SameRequestSameStoreEverywhere) {
  Tiny t;
  kv::CodecOptions flags;
  flags.kv = "rotor3_sym";
  const CodecRequest from_flags = CodecRequest::from_flags(flags, "on", false);
  const CodecRequest parsed = CodecRequest::parse("rotor3_sym+qjl");
  const eval::EvalCodec listed = eval::parse_eval_codecs("none,rotor3_sym+qjl")[1];
  EXPECT_EQ(from_flags, parsed);
  EXPECT_EQ(listed, parsed);
  for (const CodecRequest* r : {&from_flags, &parsed, &listed}) {
    auto s = make_session_cache(*t.model, *r, 77);
    auto p = make_paged_pool(*t.model, *r, 3);
    EXPECT_EQ(s->codec_name(), "rotor3_sym+qjl");
    EXPECT_EQ(p->codec_name(), "rotor3_sym+qjl");
    expect_same_shape(s->shape(), session_shape(*t.model, 77));
    expect_same_shape(p->shape(), pool_shape(*t.model, 3));
    EXPECT_EQ(p->shape().page_tokens, kv::kDefaultPageTokens);
    EXPECT_EQ(p->bytes_for_tokens(p->shape().max_tokens),
              make_paged_pool(*t.model, parsed, 3)->bytes_for_tokens(p->shape().max_tokens));
  }
}

namespace {

class NotCpuBackend final : public testutil::ForwardingBackend {
 public:
  const char* name() const override { return "other"; }
};

}  // namespace

// f32 is chosen in the runtime: a backend other than the CPU one has none.
TEST(Runtime, F32OnlyWhereTheBackendHasIt) {
  NotCpuBackend b;
  auto tiny = testutil::make_tiny(Arch::qwen3, gguf::TensorType::F32, 5);
  Model m(tiny->cfg, load_weights(tiny->cfg, tiny->t.lookup()), b);
  const std::string e = error_of([&] { make_session_cache(m, CodecRequest::reference_f32(), 32); }, Errc::unsupported);
  EXPECT_TRUE(has(e, "f32")) << e;
  EXPECT_TRUE(has(e, "the other backend has none")) << e;
  EXPECT_NO_THROW(make_session_cache(m, CodecRequest{}, 32));
}

TEST(Runtime, OpensBackendAndModel) {
  Runtime rt = Runtime::open(cpu::make_cpu_backend(), "synthetic:tiny");
  ASSERT_TRUE(rt.backend && rt.model);
  EXPECT_EQ(&rt.model->backend(), rt.backend.get());
  auto cache = rt.session_cache(CodecRequest::parse("k8v4"), 64);
  EXPECT_EQ(cache->codec_name(), "k8v4");
  auto pool = rt.paged_pool(CodecRequest::parse("none"), 2);
  EXPECT_EQ(pool->shape().n_pages(), 2);
  EXPECT_THROW(Runtime::open(cpu::make_cpu_backend(), "synthetic:nope"), Error);
}

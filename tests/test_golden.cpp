// kvq's CPU logits against golden logits from an independent implementation
// (tools/golden/golden_logits.py: its own GGUF reader -> transformers
// Qwen3/Llama in float32). Each tests/data/golden/<set>/ holds golden.json
// {"gguf": "path/in/repo.gguf" or "synth": {"shape", "seed", "weights"},
//  "cases": [{"ids", "logits": "caseN.npy"}]} and caseN.npy (float32 [T, vocab]).
// "gguf" names a model file in the repository (the default model, or a small
// model stored beside its logits); a "synth" object is a recipe the test
// regenerates the model from.
//
// Bounds, per case, over every position and vocabulary entry:
//  * exact fp32 K/V cache (both sides compute in fp32 over the same
//    dequantized weights): max |kvq - ref| <= 1e-4 * max|ref| + 1e-4, and kvq's
//    top-1 token equals the reference's wherever the reference's top-1/top-2
//    margin exceeds 1e-3;
//  * codec `none` (bf16 K/V, the default of `kvq run`): max |kvq - ref| <=
//    1e-2 * max|ref| + 1e-3, top-1 equal where the margin exceeds 5% of max|ref|.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/f32_cache.hpp"
#include "core/npy.hpp"
#include "gguf/types.hpp"
#include "kv/cache.hpp"
#include "model/forward.hpp"
#include "model/synth.hpp"

using namespace kvq;
namespace fs = std::filesystem;

namespace {

const fs::path kGoldenDir = fs::path(KVQ_TEST_DATA) / "golden";

std::vector<fs::path> golden_sets() {
  std::vector<fs::path> out;
  if (fs::is_directory(kGoldenDir))
    for (const auto& e : fs::directory_iterator(kGoldenDir))
      if (e.is_directory() && fs::exists(e.path() / "golden.json")) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

struct CaseResult {
  double max_err = 0, ref_max = 0;
  int top1_checked = 0, top1_mismatch = 0;
};

}  // namespace

// The comparison below passes vacuously without data; this makes sure it cannot.
TEST(Golden, ExpectedReferenceSetsExist) {
  for (const char* set : {"tiny", "tiny-llama"})
    EXPECT_TRUE(fs::exists(kGoldenDir / set / "golden.json"))
        << "missing " << (kGoldenDir / set / "golden.json")
        << ": generate it with tools/golden/golden_logits.py (see docs/forward.md)";
}

TEST(Golden, CpuLogitsMatchIndependentReference) {
  const auto sets = golden_sets();
  ASSERT_FALSE(sets.empty()) << "no golden sets under " << kGoldenDir;
  const fs::path tmp = fs::temp_directory_path() / ("kvq_golden_" + std::to_string(::getpid()));
  fs::create_directories(tmp);
  auto backend = cpu::make_cpu_backend();
  for (const fs::path& dir : sets) {
    SCOPED_TRACE(dir.filename().string());
    nlohmann::json doc;
    std::ifstream(dir / "golden.json") >> doc;
    fs::path gguf_path;
    if (doc.contains("gguf") && fs::exists(fs::path(KVQ_SOURCE_DIR) / doc["gguf"].get<std::string>())) {
      // a model file in the repository, path relative to its root
      gguf_path = fs::path(KVQ_SOURCE_DIR) / doc["gguf"].get<std::string>();
    } else if (doc.contains("synth") && doc["synth"].is_object()) {  // rebuild from the recipe
      const auto& sj = doc["synth"];
      SynthOptions so;
      so.shape = sj.at("shape").get<std::string>();
      so.seed = sj.value("seed", uint64_t(0));
      if (sj.contains("weights") && !sj["weights"].is_null()) {
        auto t = gguf::tensor_type_from_name(sj["weights"].get<std::string>());
        ASSERT_TRUE(t.has_value()) << "unknown weight type " << sj["weights"];
        so.weights = *t;
      }
      gguf_path = tmp / (dir.filename().string() + ".gguf");
      write_synthetic(so, gguf_path.string());
    } else {
      FAIL() << "golden.json needs a \"gguf\" path to an existing model file or a \"synth\" recipe object";
    }
    auto model = Model::open(gguf_path.string(), *backend);
    const int V = model->config().vocab_size;

    ASSERT_FALSE(doc.at("cases").empty());
    for (size_t ci = 0; ci < doc["cases"].size(); ++ci) {
      const auto& c = doc["cases"][ci];
      const std::vector<int32_t> ids = c.at("ids").get<std::vector<int32_t>>();
      const npy::Array ref = npy::read((dir / c.at("logits").get<std::string>()).string());
      ASSERT_EQ(ref.shape, (std::vector<uint64_t>{ids.size(), uint64_t(V)})) << "case " << ci;

      // fp32 KV: the arithmetic reference, held to the tight bound; codec
      // `none` (bf16 K/V, what `kvq run` uses by default): rounding K and V to
      // bf16 is a real perturbation, so its bound is looser.
      for (const bool exact : {true, false}) {
        auto cache = exact ? cpu::make_f32_cache(model->cache_shape(int(ids.size())))
                           : kv::make_cpu_cache(kv::CodecOptions{}, model->cache_shape(int(ids.size())));
        std::vector<float> got(ids.size() * V);
        model->forward(ids.data(), int(ids.size()), 0, *cache, got.data(), true);

        CaseResult r;
        for (float v : ref.f32) r.ref_max = std::max(r.ref_max, double(std::fabs(v)));
        for (size_t i = 0; i < got.size(); ++i) r.max_err = std::max(r.max_err, double(std::fabs(got[i] - ref.f32[i])));
        const double margin_min = exact ? 1e-3 : 0.05 * r.ref_max;
        for (size_t t = 0; t < ids.size(); ++t) {
          const float* rr = ref.f32.data() + t * V;
          const float* gr = got.data() + t * V;
          int a1 = 0, a2 = -1, g1 = 0;
          for (int i = 1; i < V; ++i) {
            if (rr[i] > rr[a1]) { a2 = a1; a1 = i; }
            else if (a2 < 0 || rr[i] > rr[a2]) a2 = i;
            if (gr[i] > gr[g1]) g1 = i;
          }
          if (a2 >= 0 && rr[a1] - rr[a2] > margin_min) {
            ++r.top1_checked;
            if (g1 != a1) ++r.top1_mismatch;
          }
        }
        const double bound = exact ? 1e-4 * r.ref_max + 1e-4 : 1e-2 * r.ref_max + 1e-3;
        std::printf("golden %s case %zu (%s KV): %zu tokens, max|ref| %.4g, max|err| %.3g (bound %.3g), top-1 %d/%d\n",
                    dir.filename().c_str(), ci, exact ? "fp32" : "bf16", ids.size(), r.ref_max, r.max_err, bound,
                    r.top1_checked - r.top1_mismatch, r.top1_checked);
        EXPECT_GT(r.ref_max, 0.0) << "reference logits are all zero";
        EXPECT_LE(r.max_err, bound) << "case " << ci << (exact ? " fp32" : " bf16") << " KV";
        EXPECT_EQ(r.top1_mismatch, 0) << "case " << ci << (exact ? " fp32" : " bf16") << " KV";
      }
    }
  }
  fs::remove_all(tmp);
}

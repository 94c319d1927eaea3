// Greedy decoding through the backend's argmax (Session::generate with
// temperature 0: Model::forward_argmax, no logits download) and the host
// default of Backend::argmax, on the CPU backend and a synthetic tiny model.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <limits>

#include <unistd.h>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/f32_cache.hpp"
#include "engine/sampler.hpp"
#include "engine/session.hpp"
#include "model/forward.hpp"
#include "model/synth.hpp"
#include "tokenizer/tokenizer.hpp"

using namespace kvq;
namespace fs = std::filesystem;

namespace {

GenerateOptions greedy(int n) {
  GenerateOptions g;
  g.n_predict = n;
  g.sampling.temperature = 0;
  g.stop_at_eog = false;  // random weights: do not let an early EOG shorten the test
  return g;
}

// Greedy generation takes the backend-argmax path (Model::forward_argmax, no
// logits download); it must pick what the Sampler picks from the downloaded
// logits of a plain forward loop over a fresh cache.
TEST(GreedyDecode, BackendArgmaxMatchesSamplerOverDownloadedLogits) {
  auto backend = cpu::make_cpu_backend();
  const fs::path p = fs::temp_directory_path() / ("kvq_greedy_" + std::to_string(::getpid()) + ".gguf");
  SynthOptions so;
  so.shape = "tiny";
  so.seed = 1;
  write_synthetic(so, p.string());
  auto model = Model::open(p.string(), *backend);
  fs::remove(p);  // the mapping stays valid after unlink
  const Tokenizer tok = Tokenizer::from_gguf(*model->file());
  const int ctx = 96, n = 40;
  SessionOptions sopts;
  sopts.ctx = ctx;
  Session s(*model, cpu::make_f32_cache(model->cache_shape(ctx)), &tok, sopts);
  const std::vector<TokenId> prompt = s.tokenize("def greedy(x):", true, false);
  const GenerateResult r = s.generate(prompt, greedy(n));
  ASSERT_EQ(int(r.tokens.size()), n);

  auto cache = cpu::make_f32_cache(model->cache_shape(ctx));
  const int vocab = std::min(tok.vocab_size(), model->config().vocab_size);
  std::vector<float> logits(model->config().vocab_size);
  model->forward(prompt.data(), int(prompt.size()), 0, *cache, logits.data(), false);
  Sampler sampler(greedy(n).sampling);
  int pos = int(prompt.size());
  for (int i = 0; i < n; ++i) {
    const TokenId id = sampler.sample(logits.data(), vocab);
    ASSERT_EQ(r.tokens[i], id) << "token " << i;
    if (i + 1 < n) model->forward(&id, 1, pos++, *cache, logits.data(), false);
  }
  // And the backend argmax itself, on the last step's logits.
  auto buf = backend->alloc(logits.size());
  backend->upload(logits.data(), buf->data(), logits.size());
  EXPECT_EQ(backend->argmax(buf->data(), size_t(vocab)), sampler.sample(logits.data(), vocab));
}

TEST(GreedyDecode, HostArgmaxFollowsTheGreedyRule) {
  auto be = cpu::make_cpu_backend();
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<std::pair<std::vector<float>, int>> cases = {
      {{1, 3, 3, 2}, 1}, {{nan, 1, nan}, 1}, {{nan, nan}, 0}, {{-inf, -inf, -inf}, 0}, {{-inf, nan, -5}, 2}, {{4}, 0}};
  for (const auto& [v, want] : cases) {
    auto buf = be->alloc(v.size());
    be->upload(v.data(), buf->data(), v.size());
    EXPECT_EQ(be->argmax(buf->data(), v.size()), want);
  }
  EXPECT_FALSE(be->supports_step_graphs());
}

}  // namespace

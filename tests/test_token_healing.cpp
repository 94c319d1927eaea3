// Token healing on the embedded default model's real vocabulary: a prompt
// ending in a lone space token is healed, the first generated token is forced
// to start with that space, and the space is not printed twice.
#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/f32_cache.hpp"
#include "engine/session.hpp"
#include "engine/token_healing.hpp"
#include "gguf/gguf.hpp"
#include "model/forward.hpp"
#include "tokenizer/tokenizer.hpp"

using namespace kvq;

namespace {

const std::string kModel = std::string(KVQ_SOURCE_DIR) + "/models/kvq-tiny-code.gguf";

struct Default {
  std::unique_ptr<Backend> backend = cpu::make_cpu_backend();
  std::unique_ptr<Model> model = Model::open(kModel, *backend);
  Tokenizer tok = Tokenizer::from_gguf(*model->file());
};

Default& def() {
  static Default d;
  return d;
}

}  // namespace

TEST(TokenHealing, TrailingSpaceIsHealedAndConstrainsTheFirstToken) {
  const Tokenizer& tok = def().tok;
  auto ids = tok.encode("def ");
  ASSERT_EQ(ids.size(), 2u);
  const TokenId space = ids.back();
  const TokenHealing h = heal_prompt_end(tok, ids);
  ASSERT_TRUE(h.active());
  EXPECT_EQ(h.prefix, " ");
  EXPECT_EQ(ids, tok.encode("def"));
  bool has_removed = false;
  for (TokenId id : h.first_allowed) {
    EXPECT_EQ(tok.bytes_of(id).rfind(" ", 0), 0u) << "token " << id;
    has_removed |= id == space;
  }
  EXPECT_TRUE(has_removed);
  EXPECT_GT(h.first_allowed.size(), 100u);  // " def", " self", " return", ... all start with a space
}

TEST(TokenHealing, LeavesPromptsAloneWhenNothingExtendsTheLastToken) {
  const Tokenizer& tok = def().tok;
  // A control token is never healed.
  auto ids = tok.encode("hello<|im_end|>", /*parse_special=*/true);
  const auto before = ids;
  EXPECT_FALSE(heal_prompt_end(tok, ids).active());
  EXPECT_EQ(ids, before);
  // A one-token prompt is never emptied.
  auto one = tok.encode(" ");
  ASSERT_EQ(one.size(), 1u);
  EXPECT_FALSE(heal_prompt_end(tok, one).active());
  EXPECT_EQ(one.size(), 1u);
}

TEST(TokenHealing, SessionForcesThePrefixAndDoesNotPrintItTwice) {
  Default& d = def();
  auto ids = d.tok.encode("def ");
  GenerateOptions g;
  g.n_predict = 8;
  g.sampling.temperature = 0;
  g.healing = heal_prompt_end(d.tok, ids);
  ASSERT_TRUE(g.healing.active());
  Session s(*d.model, cpu::make_f32_cache(d.model->cache_shape(64)), &d.tok, {64});
  const GenerateResult r = s.generate(ids, g);
  ASSERT_FALSE(r.tokens.empty());
  const std::string first = d.tok.bytes_of(r.tokens[0]);
  ASSERT_EQ(first.rfind(" ", 0), 0u) << "first token '" << first << "' does not start with the healed space";
  // The streamed text is the generated text minus the healed space.
  EXPECT_EQ(" " + r.text, d.tok.decode(r.tokens));
  // Without healing the model sees the lone space token; the first token is unconstrained.
  auto raw = d.tok.encode("def ");
  GenerateOptions g2 = g;
  g2.healing = {};
  Session s2(*d.model, cpu::make_f32_cache(d.model->cache_shape(64)), &d.tok, {64});
  const GenerateResult r2 = s2.generate(raw, g2);
  EXPECT_EQ(r2.text, d.tok.decode(r2.tokens));
}

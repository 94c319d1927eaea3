// Token healing for raw-text prompts.
//
// Byte-level BPE with the qwen2/llama-bpe pre-tokenizers attaches a word's
// leading space to the word, so a prompt that ends in "def " ends in a lone
// " " token, a token that in the training text was almost always followed by
// a digit or more whitespace, never by a word. Healing removes such a last
// token from the prompt and makes the first generated token start with its
// text instead, so the model chooses " foo" itself. The removed text is
// already on the user's screen, so the session does not print it again.
#pragma once

#include <string>
#include <vector>

#include "tokenizer/tokenizer.hpp"

namespace kvq {

struct TokenHealing {
  std::string prefix;                // bytes of the removed token ("" = nothing healed)
  std::vector<TokenId> first_allowed;  // tokens whose text starts with prefix (the removed one included)
  bool active() const { return !prefix.empty(); }
};

// Removes the last token of `prompt` when it is a proper prefix of some other
// ordinary token and returns what the first sampled token must start with.
// Leaves the prompt alone (and returns an inactive healing) when it has fewer
// than two tokens, when the last token is special, or when no other token
// extends it.
TokenHealing heal_prompt_end(const Tokenizer& tok, std::vector<TokenId>& prompt);

}  // namespace kvq

#include "engine/token_healing.hpp"

namespace kvq {

TokenHealing heal_prompt_end(const Tokenizer& tok, std::vector<TokenId>& prompt) {
  TokenHealing h;
  if (prompt.size() < 2) return h;
  const TokenId last = prompt.back();
  if (!tok.is_displayed(last)) return h;
  const std::string& piece = tok.bytes_of(last);
  if (piece.empty()) return h;
  std::vector<TokenId> allowed;
  bool extended = false;
  for (TokenId id = 0; id < tok.vocab_size(); ++id) {
    if (!tok.is_displayed(id)) continue;
    const std::string& p = tok.bytes_of(id);
    if (p.size() >= piece.size() && p.compare(0, piece.size(), piece) == 0) {
      allowed.push_back(id);
      extended |= id != last;
    }
  }
  if (!extended) return h;
  h.prefix = piece;
  prompt.pop_back();
  h.first_allowed = std::move(allowed);
  return h;
}

}  // namespace kvq

// TEMPORARY: families not implemented yet throw `unsupported`. Removed as each
// family lands.
#include "core/error.hpp"
#include "kv/blocks/families.hpp"

namespace kvq::kv {
static std::unique_ptr<Block> pending(const BlockSpec& s) {
  fail(Errc::unsupported, "KV block '", s.name(), "' is not implemented yet");
}
std::unique_ptr<Block> make_fp8_block(const BlockSpec& s, int, RowLayout) { return pending(s); }
std::unique_ptr<Block> make_q8_block(const BlockSpec& s, int, RowLayout, uint64_t) { return pending(s); }
std::unique_ptr<Block> make_turbo_block(const BlockSpec& s, int, RowLayout, uint64_t) { return pending(s); }
std::unique_ptr<Block> make_tcq_block(const BlockSpec& s, int, RowLayout, uint64_t) { return pending(s); }
std::unique_ptr<Block> make_grouped_block(const BlockSpec& s, int, RowLayout, uint64_t) { return pending(s); }
std::unique_ptr<Block> make_qjl_block(const BlockSpec& s, RowLayout, std::unique_ptr<Block>, uint64_t, int, int) {
  return pending(s);
}
}  // namespace kvq::kv

// Factories of the block families (one .cpp per family under kv/blocks/).
// Internal to kv/: callers use make_block() from kv/block.hpp.
#pragma once

#include <memory>

#include "kv/block.hpp"

namespace kvq::kv {

constexpr int kScaleGroup = 32;    // values per fp16 scale (q8, rq8, iso, rotor, planar)
constexpr int kMaxHeadDim = 1024;  // scratch buffers are sized for this

std::unique_ptr<Block> make_bf16_block(const BlockSpec& s, int d, RowLayout l);
std::unique_ptr<Block> make_fp8_block(const BlockSpec& s, int d, RowLayout l);
std::unique_ptr<Block> make_q8_block(const BlockSpec& s, int d, RowLayout l, uint64_t seed);
std::unique_ptr<Block> make_turbo_block(const BlockSpec& s, int d, RowLayout l, uint64_t seed);
std::unique_ptr<Block> make_tcq_block(const BlockSpec& s, int d, RowLayout l, uint64_t seed);
std::unique_ptr<Block> make_grouped_block(const BlockSpec& s, int d, RowLayout l, uint64_t seed);
std::unique_ptr<Block> make_qjl_block(const BlockSpec& s, RowLayout l, std::unique_ptr<Block> base,
                                      uint64_t seed, int layer, int kv_head);

}  // namespace kvq::kv

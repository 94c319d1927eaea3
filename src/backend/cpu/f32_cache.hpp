// An exact fp32 KV cache: no compression at all. It is not a codec (codecs
// live in the kv codec table); it is the arithmetic reference the forward-pass
// tests and golden-logit comparisons run on, so that kvq's logits can be
// compared with an fp32 implementation without KV rounding in between.
#pragma once

#include <memory>

#include "kv/cache.hpp"

namespace kvq::cpu {

std::unique_ptr<kv::Cache> make_f32_cache(const kv::CacheShape& shape);

}  // namespace kvq::cpu

// The dispatch proof a benchmark records: which attention kernel ran for each
// layer of a KV cache (and how often, split into prefill and decode calls),
// and how many KV bytes crossed between host and device. Counted by the
// backend itself (never scraped from logs), see Backend::dispatch_stats.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvq {

struct DispatchStats {
  // False: this backend keeps no counters; nothing below means anything.
  bool counted = false;

  struct KernelCalls {
    int layer = 0;        // index into the cache's layers
    std::string kernel;   // e.g. "cpu-packed", "cuda-split-kv-decode<bf16,bf16,128>"
    bool decode = false;  // single-token (decode) calls; false: multi-token (prefill) calls
    uint64_t calls = 0;
  };
  // One entry per (layer, kernel, phase) that ran, ordered by layer.
  std::vector<KernelCalls> attention;

  // KV bytes copied between host and device memory (a device-resident cache
  // keeps both at 0 during decode; the CPU backend has no device: always 0).
  uint64_t kv_host_to_device_bytes = 0;
  uint64_t kv_device_to_host_bytes = 0;

  // Calls summed over layers, for one phase.
  uint64_t total_calls(bool decode_phase) const {
    uint64_t n = 0;
    for (const auto& k : attention)
      if (k.decode == decode_phase) n += k.calls;
    return n;
  }
};

}  // namespace kvq

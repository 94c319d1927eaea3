// kvq bench --batch: B sequences per decode step (bench/measure.hpp).
#include <algorithm>
#include <cmath>

#include "backend/backend.hpp"
#include "bench/measure.hpp"
#include "bench/stats.hpp"
#include "core/error.hpp"
#include "core/timer.hpp"
#include "engine/batch_decoder.hpp"
#include "engine/runtime.hpp"
#include "kv/page.hpp"
#include "model/forward.hpp"

namespace kvq::bench {

CellResult measure_batch_cell(Model& model, const CodecRequest& codec,
                              const std::vector<std::vector<int32_t>>& prompts, const MeasureOptions& o) {
  const int B = int(prompts.size());
  KVQ_CHECK(B >= 1, Errc::invalid_argument, "a batch cell needs at least one sequence");
  KVQ_CHECK(o.gen >= 2, Errc::invalid_argument, "generate at least 2 tokens (decode speed counts tokens 2..G)");
  KVQ_CHECK(o.reps >= 1 && o.warmup >= 0, Errc::invalid_argument, "bench: ", o.reps, " reps, ", o.warmup,
            " warm-up runs");
  const int L = int(prompts[0].size());
  for (const auto& p : prompts)
    KVQ_CHECK(int(p.size()) == L && L > 0, Errc::invalid_argument, "every prompt of a batch cell has L tokens");
  Backend& be = model.backend();
  const int chunk = o.prefill_chunk > 0 ? o.prefill_chunk : be.default_prefill_chunk();

  // One pool: every sequence's L + G tokens (the last generated one is never
  // fed) in whole pages; with an exact window its last pages are the
  // window's (a second pool of B windows), the rest packed.
  const int page = kv::kDefaultPageTokens;
  const int pages_per_seq = kv::pages_for(L + o.gen, page);
  const int packed_per_seq = pages_per_seq - std::min(pages_per_seq, codec.f32 ? 0 : codec.window_pages);
  const int64_t mem_before = be.device_memory_used();
  std::unique_ptr<kv::Cache> store = make_paged_pool(model, codec, B * std::max(packed_per_seq, 1), page, B);
  const int64_t mem_after = be.device_memory_used();
  kv::Cache& cache = *store;
  BatchDecoder dec(model, std::move(store), chunk);
  dec.set_keep_logits(false);  // greedy: the backend chooses, the logits stay where they are

  CellResult c;
  c.codec = cache.codec_name();
  c.ctx = L;
  c.gen = o.gen;
  c.reps = o.reps;
  c.batch = B;
  SamplingParams greedy = o.sampling;

  // Prefill: each sequence on its own, timed up to its first token (or only
  // sequence 0, the others its copies).
  std::vector<int> seqs;
  const int prefilled = o.copy_batch_kv ? 1 : B;
  c.prefill_n = prefilled;
  for (int b = 0; b < prefilled; ++b) {
    if (o.on_prefill_rep) o.on_prefill_rep(b, B);
    Timer t;
    seqs.push_back(dec.add(prompts[size_t(b)], greedy));
    PrefillResult p;
    p.ttft_s = p.prefill_s = t.seconds();
    p.prefill_tps = p.prefill_s > 0 ? L / p.prefill_s : 0;
    p.first_token = dec.tokens(seqs.back())[size_t(L)];
    c.prefill_results.push_back(p);
  }
  while (int(seqs.size()) < B) seqs.push_back(dec.add_copy(seqs.front(), greedy));

  std::vector<std::string> digests;
  const int total = o.warmup + o.reps;
  for (int i = 0; i < total; ++i) {
    if (o.on_rep) o.on_rep(i, total);
    if (i == o.warmup) be.reset_dispatch_stats(cache);
    for (int s : seqs) dec.rewind(s, L);
    std::vector<double> step_ms;
    Timer t_run;
    for (int g = 1; g < o.gen; ++g) {
      Timer t;
      dec.step();
      step_ms.push_back(t.seconds() * 1e3);
    }
    const double run_s = t_run.seconds();
    std::vector<int32_t> all;
    for (int s : seqs) {
      const auto& toks = dec.tokens(s);
      all.insert(all.end(), toks.begin() + L, toks.end());
    }
    RepResult x;
    x.decode_tps = run_s > 0 ? double(B) * (o.gen - 1) / run_s : 0;
    x.itl_p50_ms = percentile(step_ms, 50);
    x.itl_p99_ms = percentile(step_ms, 99);
    x.n_generated = o.gen;
    x.digest = token_digest(all);
    digests.push_back(x.digest);
    if (i >= o.warmup) c.rep_results.push_back(x);
  }

  c.decode_tps = spread_of(c.rep_results, &RepResult::decode_tps);
  c.ttft_s = spread_of(c.prefill_results, &PrefillResult::ttft_s);
  c.prefill_tps = spread_of(c.prefill_results, &PrefillResult::prefill_tps);
  c.itl_p50_ms = spread_of(c.rep_results, &RepResult::itl_p50_ms);
  c.itl_p99_ms = spread_of(c.rep_results, &RepResult::itl_p99_ms);

  const kv::CacheShape& sh = cache.shape();
  const int filled = B * (L + o.gen - 1);
  c.kv_seq = L + o.gen / 2.0;
  c.kv_bytes = uint64_t(B) * cache.bytes_for_sequence(L + o.gen - 1);  // exact window pages included
  c.kv_pages = dec.pool().used_pages();
  c.bits_per_value = double(c.kv_bytes) * 8.0 / (double(filled) * sh.n_layers * sh.n_kv_heads * sh.head_dim * 2.0);
  c.kv_capacity_bytes = cache.capacity_bytes();
  c.device_mem_delta = mem_before >= 0 && mem_after >= 0 ? mem_after - mem_before : -1;
  // A step reads the weights once and every sequence's KV rows.
  c.weight_bytes = model.step_weight_bytes();
  c.step_bytes = double(c.weight_bytes) + double(B) * double(cache.bytes_for_sequence(int(std::lround(c.kv_seq))));
  const double steps_per_s = c.decode_tps.median / B;
  c.achieved_gbs = c.step_bytes * steps_per_s / 1e9;
  c.pct_copy_bw = o.copy_bw > 0 ? 100.0 * c.achieved_gbs * 1e9 / o.copy_bw : 0;

  c.digest = digests.front();
  c.digests_agree = std::all_of(digests.begin(), digests.end(), [&](const auto& d) { return d == digests[0]; });
  if (!c.digests_agree) {
    c.flags.push_back("digest");
    c.error = "the repetitions generated different tokens";
  }
  c.dispatch = be.dispatch_stats(cache);
  if (c.dispatch.counted) {
    // Every measured step is one decode attention call per layer.
    const uint64_t want = uint64_t(o.reps) * uint64_t(o.gen - 1);
    std::vector<uint64_t> per_layer(size_t(sh.n_layers), 0);
    for (const auto& k : c.dispatch.attention)
      if (k.decode && k.layer >= 0 && k.layer < sh.n_layers) per_layer[size_t(k.layer)] += k.calls;
    for (int l = 0; l < sh.n_layers; ++l)
      if (per_layer[size_t(l)] != want) {
        c.flags.push_back("dispatch");
        c.error += str(c.error.empty() ? "" : "; ", "layer ", l, " ran ", per_layer[size_t(l)],
                       " decode attention calls, expected ", want);
        break;
      }
  }
  c.status = c.flags.empty() ? "ok" : "flagged";
  return c;
}

}  // namespace kvq::bench

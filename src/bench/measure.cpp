#include "bench/measure.hpp"

#include <algorithm>
#include <cmath>
#include <memory>

#include "backend/backend.hpp"
#include "bench/stats.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "engine/runtime.hpp"
#include "engine/session.hpp"
#include "model/forward.hpp"

namespace kvq::bench {

std::vector<int32_t> random_prompt(int n, int vocab, uint64_t seed) {
  KVQ_CHECK(n >= 0 && vocab > 0, Errc::invalid_argument, "random prompt of ", n, " tokens over a vocabulary of ",
            vocab);
  Rng rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = int32_t(rng.next_u64() % uint64_t(vocab));
  return ids;
}

namespace {

RepResult rep_result(const GenerateResult& r) {
  RepResult x;
  const size_t g = r.tokens.size();
  KVQ_CHECK(g >= 2 && r.token_s.size() == g, Errc::internal, "bench: ", g, " tokens generated with ",
            r.token_s.size(), " timestamps");
  const double span = r.token_s[g - 1] - r.token_s[0];
  x.decode_tps = span > 0 ? double(g - 1) / span : 0;
  x.ttft_s = r.prefill_s + r.token_s[0];
  x.prefill_tps = r.prefill_tps();
  std::vector<double> itl;
  for (size_t i = 1; i < g; ++i) itl.push_back((r.token_s[i] - r.token_s[i - 1]) * 1e3);
  x.itl_p50_ms = percentile(itl, 50);
  x.itl_p99_ms = percentile(itl, 99);
  x.n_generated = int(g);
  x.digest = token_digest(r.tokens);
  return x;
}

// Single-token attention calls per layer that `reps` measured runs must
// show: the G-1 decode steps, plus, prefill-every-run, a prefill chunk of
// one token (L mod chunk == 1), or, prefill-once, the single-token chunks
// of the runs' re-feeds (`single_refeeds`: the last prompt token, or with
// an exact window the window's packed pages, whose chunks may end in one).
uint64_t expected_decode_calls(int prompt, int gen, int chunk, int reps, bool prefill_every_run,
                               int single_refeeds) {
  if (!prefill_every_run) return uint64_t(reps) * uint64_t(gen - 1) + uint64_t(single_refeeds);
  const int ones = chunk == 1 ? prompt : (prompt % chunk == 1 ? 1 : 0);
  return uint64_t(reps) * uint64_t(gen - 1 + ones);
}

void add_flag(CellResult& c, const std::string& flag, const std::string& why) {
  c.flags.push_back(flag);
  c.error += (c.error.empty() ? "" : "; ") + why;
}

}  // namespace

CellResult measure_cell(Model& model, const CodecRequest& codec, const std::vector<int32_t>& prompt,
                        const MeasureOptions& o) {
  KVQ_CHECK(o.gen >= 2, Errc::invalid_argument, "generate at least 2 tokens (decode speed counts tokens 2..G)");
  KVQ_CHECK(o.reps >= 1, Errc::invalid_argument, "measure at least 1 repetition");
  KVQ_CHECK(o.warmup >= 0, Errc::invalid_argument, "the warm-up count cannot be negative");
  KVQ_CHECK(o.prefill_reps >= 1, Errc::invalid_argument, "--prefill-reps must be at least 1 (got ", o.prefill_reps,
            "): a cell needs one prefill to decode from");
  KVQ_CHECK(!prompt.empty(), Errc::invalid_argument, "the benchmark prompt is empty");
  Backend& be = model.backend();
  const int L = int(prompt.size());
  const int ctx = L + o.gen;  // the last generated token is never fed back
  const int chunk = o.prefill_chunk > 0 ? o.prefill_chunk : be.default_session_prefill_chunk();

  // The cache is the only allocation between the two readings, so their
  // difference is what it takes on the device.
  const int64_t mem_before = be.device_memory_used();
  std::unique_ptr<kv::Cache> owned = make_session_cache(model, codec, ctx);
  const int64_t mem_after = be.device_memory_used();
  kv::Cache& cache = *owned;

  SessionOptions so;
  so.ctx = ctx;
  so.prefill_chunk = chunk;
  so.on_prefill_progress = o.on_prefill;
  Session session(model, std::move(owned), nullptr, so);
  GenerateOptions g;
  g.n_predict = o.gen;
  g.stop_at_eog = false;  // exactly G tokens, whatever the model says
  g.sampling = o.sampling;

  CellResult c;
  c.codec = cache.codec_name();
  c.ctx = L;
  c.gen = o.gen;
  c.reps = o.reps;
  std::vector<std::string> digests;
  const int total = o.warmup + o.reps;
  int single_refeeds = 0;  // single-token chunks of the measured decode runs' re-feeds (prefill-once)
  if (o.prefill_every_run) {
    c.prefill_n = o.reps;
    for (int i = 0; i < total; ++i) {
      if (o.on_rep) o.on_rep(i, total);
      if (i == o.warmup) be.reset_dispatch_stats(cache);  // count the measured repetitions only
      session.truncate(0);  // the same cache, emptied: a full prefill every time
      const GenerateResult r = session.generate(prompt, g);
      KVQ_CHECK(int(r.tokens.size()) == o.gen, Errc::internal, "bench: asked for ", o.gen, " tokens, got ",
                r.tokens.size(), " (", to_string(r.stop_reason), ")");
      const RepResult x = rep_result(r);
      digests.push_back(x.digest);
      if (i >= o.warmup) c.rep_results.push_back(x);
    }
  } else {
    // The cell's prefills: each into the emptied cache, timed up to the
    // choice of the first token (the TTFT a user sees).
    c.prefill_n = o.prefill_reps;
    GenerateOptions g1 = g;
    g1.n_predict = 1;
    for (int j = 0; j < o.prefill_reps; ++j) {
      if (o.on_prefill_rep) o.on_prefill_rep(j, o.prefill_reps);
      session.truncate(0);
      const GenerateResult r = session.generate(prompt, g1);
      KVQ_CHECK(r.n_prompt == L && r.tokens.size() == 1 && r.token_s.size() == 1, Errc::internal,
                "bench: a prefill fed ", r.n_prompt, " of ", L, " prompt tokens and chose ", r.tokens.size(),
                " tokens");
      PrefillResult p;
      p.prefill_s = r.prefill_s;
      p.prefill_tps = r.prefill_tps();
      p.ttft_s = r.prefill_s + r.token_s[0];
      p.first_token = r.tokens[0];
      c.prefill_results.push_back(p);
    }
    // The decode runs, each from the cache holding the prompt: drop the last
    // prompt token (and whatever the previous run generated), so generate()
    // reuses rows 0..L-2 and feeds only prompt[L-1] at position L-1. With an
    // exact window, every run feeds the prompt's window pages again (at most
    // W pages): a previous run packed them, and a run that re-fed them and
    // one that did not would start from rows computed in other chunks
    // (other rounding, other tokens).
    const kv::CacheShape& shape = cache.shape();
    const int window_tokens = shape.window_pages * shape.page_tokens;
    const int keep = window_tokens ? std::min(L - 1, kv::window_first_page(L, shape.page_tokens, shape.window_pages) *
                                                         shape.page_tokens)
                                   : L - 1;
    for (int i = 0; i < total; ++i) {
      if (o.on_rep) o.on_rep(i, total);
      if (i == o.warmup) be.reset_dispatch_stats(cache);  // count the measured runs only
      session.truncate(keep);
      const GenerateResult r = session.generate(prompt, g);
      KVQ_CHECK(r.n_prompt == 1 || (r.n_prompt >= 1 && r.n_prompt <= window_tokens), Errc::internal,
                "bench: a decode run re-fed ", r.n_prompt, " prompt tokens instead of the last one",
                window_tokens ? " or its window's" : "");
      // The re-fed tokens' single-token chunks: all of them in chunks of 1,
      // else a last chunk of one token.
      if (i >= o.warmup) single_refeeds += chunk == 1 ? r.n_prompt : (r.n_prompt % chunk == 1 ? 1 : 0);
      KVQ_CHECK(int(r.tokens.size()) == o.gen, Errc::internal, "bench: asked for ", o.gen, " tokens, got ",
                r.tokens.size(), " (", to_string(r.stop_reason), ")");
      RepResult x = rep_result(r);
      x.ttft_s = 0;  // no prefill in this run: the cell's prefills carry TTFT
      x.prefill_tps = 0;
      x.refeed_s = r.prefill_s + r.token_s[0];
      digests.push_back(x.digest);
      if (i >= o.warmup) c.rep_results.push_back(x);
    }
  }

  c.decode_tps = spread_of(c.rep_results, &RepResult::decode_tps);
  if (o.prefill_every_run) {
    c.ttft_s = spread_of(c.rep_results, &RepResult::ttft_s);
    c.prefill_tps = spread_of(c.rep_results, &RepResult::prefill_tps);
  } else {
    c.ttft_s = spread_of(c.prefill_results, &PrefillResult::ttft_s);
    c.prefill_tps = spread_of(c.prefill_results, &PrefillResult::prefill_tps);
  }
  c.itl_p50_ms = spread_of(c.rep_results, &RepResult::itl_p50_ms);
  c.itl_p99_ms = spread_of(c.rep_results, &RepResult::itl_p99_ms);

  // KV footprint as the cache counts it.
  const kv::CacheShape& sh = cache.shape();
  const int filled = int(session.tokens().size());
  c.kv_seq = L + o.gen / 2.0;  // decode step i (1..G-1) attends over L + i tokens
  c.kv_bytes = cache.bytes_for_sequence(filled);  // an exact window's pages included
  c.bits_per_value = double(c.kv_bytes) * 8.0 / (double(filled) * sh.n_layers * sh.n_kv_heads * sh.head_dim * 2.0);
  c.kv_capacity_bytes = cache.bytes_for_sequence(ctx);
  c.device_mem_delta = mem_before >= 0 && mem_after >= 0 ? mem_after - mem_before : -1;

  c.weight_bytes = model.step_weight_bytes();
  c.step_bytes = double(c.weight_bytes) + double(cache.bytes_for_sequence(int(std::lround(c.kv_seq))));
  c.achieved_gbs = c.step_bytes * c.decode_tps.median / 1e9;
  c.pct_copy_bw = o.copy_bw > 0 ? 100.0 * c.achieved_gbs * 1e9 / o.copy_bw : 0;

  // Checks: the same tokens every time, the expected kernel calls on every
  // layer with no KV traffic between host and device, the memory the cache
  // claims is the memory it took.
  c.digest = digests.front();
  c.digests_agree = std::all_of(digests.begin(), digests.end(), [&](const auto& d) { return d == digests[0]; });
  if (!c.digests_agree) add_flag(c, "digest", "the repetitions generated different tokens");
  for (const auto& p : c.prefill_results)
    if (p.first_token != c.prefill_results.front().first_token) {
      add_flag(c, "digest", "the prefills chose different first tokens");
      break;
    }

  c.dispatch = be.dispatch_stats(cache);
  if (c.dispatch.counted) {
    const uint64_t want = expected_decode_calls(L, o.gen, chunk, o.reps, o.prefill_every_run, single_refeeds);
    std::vector<uint64_t> per_layer(size_t(sh.n_layers), 0);
    for (const auto& k : c.dispatch.attention)
      if (k.decode && k.layer >= 0 && k.layer < sh.n_layers) per_layer[size_t(k.layer)] += k.calls;
    for (int l = 0; l < sh.n_layers; ++l)
      if (per_layer[size_t(l)] != want) {
        add_flag(c, "dispatch", str("layer ", l, " ran ", per_layer[size_t(l)], " single-token attention calls, ",
                                    "expected ", want));
        break;
      }
    const uint64_t copied = c.dispatch.kv_host_to_device_bytes + c.dispatch.kv_device_to_host_bytes;
    if (copied) add_flag(c, "dispatch", str(copied, " KV bytes crossed between host and device"));
  }
  if (c.device_mem_delta >= 0) {
    const double cap = double(c.kv_capacity_bytes), got = double(c.device_mem_delta);
    const double slack = std::max(0.1 * cap, 64.0 * (1 << 20));  // allocation granularity, small scratch
    if (std::abs(got - cap) > slack)
      add_flag(c, "kv_memory", str("the cache counts ", c.kv_capacity_bytes, " bytes for ", ctx,
                                   " tokens but device memory grew by ", c.device_mem_delta));
  }
  // "dispatch" may be added twice (calls and bytes): keep each flag once.
  std::sort(c.flags.begin(), c.flags.end());
  c.flags.erase(std::unique(c.flags.begin(), c.flags.end()), c.flags.end());
  c.status = c.flags.empty() ? "ok" : "flagged";
  return c;
}

}  // namespace kvq::bench

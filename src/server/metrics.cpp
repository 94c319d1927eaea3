#include "server/metrics.hpp"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>

#include "core/error.hpp"

namespace kvq::server {
namespace {

// Prometheus floats: the shortest text that reads back as the same double.
std::string num(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

const char* const kRoutes[] = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{id}",
                               "/tokenize", "/detokenize", "/health", "/metrics"};

}  // namespace

uint64_t process_resident_bytes() {
  // statm: size resident shared text lib data dt, in pages.
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  unsigned long long size = 0, resident = 0;
  const int got = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (got != 2 || page <= 0) return 0;
  return uint64_t(resident) * uint64_t(page);
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
  KVQ_ASSERT(std::is_sorted(bounds_.begin(), bounds_.end()));
}

void Histogram::observe(double v) {
  const size_t b = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();  // first bound >= v
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[b];
  sum_ += v;
  ++n_;
}

uint64_t Histogram::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return n_;
}

void Histogram::write(std::string& out, const std::string& name, const std::string& help) const {
  std::lock_guard<std::mutex> lock(mu_);
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cum = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cum += counts_[i];
    const std::string le = i < bounds_.size() ? num(bounds_[i]) : "+Inf";
    out += name + "_bucket{le=\"" + le + "\"} " + std::to_string(cum) + "\n";
  }
  out += name + "_sum " + num(sum_) + "\n";
  out += name + "_count " + std::to_string(n_) + "\n";
}

Metrics::Metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      itl_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}),
      e2e_({0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}) {}

void Metrics::request(const std::string& route, int status) {
  const bool known = std::find(std::begin(kRoutes), std::end(kRoutes), route) != std::end(kRoutes);
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_[{known ? route : "other", status}];
}

void Metrics::tokens(int prompt, int generated) {
  prompt_tokens_ += uint64_t(prompt);
  generated_tokens_ += uint64_t(generated);
}

std::string Metrics::render(const Gauges& g) const {
  std::string out;
  out += "# HELP kvq_requests_total HTTP requests answered, by route and status.\n";
  out += "# TYPE kvq_requests_total counter\n";
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, n] : requests_)
      out += "kvq_requests_total{route=\"" + key.first + "\",status=\"" + std::to_string(key.second) + "\"} " +
             std::to_string(n) + "\n";
  }
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " counter\n" + name + " " +
           std::to_string(v) + "\n";
  };
  auto gauge = [&](const char* name, const char* help, uint64_t v) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " gauge\n" + name + " " +
           std::to_string(v) + "\n";
  };
  counter("kvq_prompt_tokens_total", "Prompt tokens prefilled.", prompt_tokens_);
  counter("kvq_generation_tokens_total", "Tokens generated.", generated_tokens_);
  counter("kvq_requests_cancelled_total", "Generations stopped because the client disconnected.", cancelled_);
  ttft_.write(out, "kvq_time_to_first_token_seconds", "Time from request arrival to the first generated token.");
  itl_.write(out, "kvq_inter_token_latency_seconds", "Time between consecutive generated tokens of a request.");
  e2e_.write(out, "kvq_request_duration_seconds",
             "Time from request arrival to its last token, for requests answered in full.");
  gauge("kvq_queue_depth", "Sequences waiting to be admitted (preempted ones included).", uint64_t(g.queue_depth));
  gauge("kvq_requests_running", "Sequences admitted: prefilling or decoding (one per prompt of a request).",
        uint64_t(g.running));
  gauge("kvq_kv_cache_bytes", "KV bytes of the pool's pages that sequences hold.", g.kv_bytes);
  const SchedulerMetrics& m = g.sched;
  gauge("kvq_kv_pool_bytes", "KV bytes of the whole page pool (allocated at start).", g.kv_pool_bytes);
  gauge("kvq_sequences_running", "Sequences admitted by the scheduler (holding pages).", uint64_t(m.running));
  gauge("kvq_sequences_waiting", "Sequences waiting for admission, preempted ones included.", uint64_t(m.waiting));
  gauge("kvq_sequences_preempted", "Waiting sequences that were preempted (to be recomputed).",
        uint64_t(m.preempted));
  gauge("kvq_kv_pages_total", "Pages in the KV pool.", uint64_t(m.pages_total));
  gauge("kvq_kv_pages_used", "KV pages held by sequences.", uint64_t(m.pages_used));
  gauge("kvq_kv_pages_cached", "KV pages only the prefix cache holds (idle, reclaimed when needed).",
        uint64_t(m.pages_cached));
  gauge("kvq_kv_pages_free", "KV pages free.", uint64_t(m.pages_free));
  counter("kvq_prefix_cache_lookup_tokens_total",
          "Prompt tokens looked up in the prefix cache at admission (whole pages before the last token).",
          m.prefix_lookup_tokens);
  counter("kvq_prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache (not prefilled).",
          m.prefix_hit_tokens);
  counter("kvq_prefix_cache_evicted_pages_total", "Idle cached pages taken back for other sequences.",
          m.prefix_evicted_pages);
  gauge("kvq_step_sequences", "Sequences in the last step's batch.", uint64_t(m.step_sequences));
  gauge("kvq_step_prefill_tokens", "Prefill tokens in the last step.", uint64_t(m.step_prefill_tokens));
  gauge("kvq_step_decode_tokens", "Decode tokens in the last step.", uint64_t(m.step_decode_tokens));
  counter("kvq_steps_total", "Scheduler steps that ran a forward pass.", m.steps);
  counter("kvq_step_prefill_tokens_total", "Prefill tokens run by the scheduler (recomputed ones included).",
          m.prefill_tokens);
  counter("kvq_step_decode_tokens_total", "Decode tokens run by the scheduler.", m.decode_tokens);
  counter("kvq_preemptions_total", "Sequences preempted (their pages taken back, to be recomputed).", m.preemptions);
  {
    const char* name = "kvq_step_batch_sequences";
    out += std::string("# HELP ") + name + " Sequences in each scheduler step's batch.\n# TYPE " + name +
           " histogram\n";
    uint64_t cum = 0, n = 0;
    for (size_t i = 0; i < m.step_sequences_hist.size(); ++i) {
      cum += m.step_sequences_hist[i];
      const std::string le =
          i < SchedulerMetrics::kBatchBounds.size() ? std::to_string(SchedulerMetrics::kBatchBounds[i]) : "+Inf";
      out += std::string(name) + "_bucket{le=\"" + le + "\"} " + std::to_string(cum) + "\n";
    }
    n = cum;
    out += std::string(name) + "_sum " + std::to_string(m.step_sequences_sum) + "\n";
    out += std::string(name) + "_count " + std::to_string(n) + "\n";
  }
  // The standard name (Prometheus client libraries' process collector), so
  // dashboards and `kvq bench serve`'s memory check find it; left out where
  // it cannot be read rather than reported as 0.
  if (const uint64_t rss = process_resident_bytes(); rss > 0)
    gauge("process_resident_memory_bytes", "Resident memory size in bytes.", rss);
  return out;
}

}  // namespace kvq::server

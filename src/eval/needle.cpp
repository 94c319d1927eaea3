#include "eval/needle.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "engine/session.hpp"
#include "eval/metrics.hpp"
#include "model/forward.hpp"
#include "tokenizer/tokenizer.hpp"

namespace kvq::eval {

namespace {

// The needle and the query restate one assignment, so retrieving the value is
// copying it from where it was planted (what induction heads do).
constexpr const char* kKey = "secret_value";

std::string needle_line(const std::string& value) { return str("\n", kKey, " = ", value, "\n"); }
std::string query_text() { return str("\n\n", kKey, " = "); }

}  // namespace

std::string builtin_haystack(size_t min_bytes) {
  static const char* verbs[] = {"load", "parse", "merge", "scale", "check", "write", "build", "split", "apply", "reset"};
  static const char* nouns[] = {"buffer", "header", "record", "window", "matrix", "config", "stream", "packet", "index", "cache"};
  static const char* args[] = {"path", "size", "items", "limit", "mode", "offset", "count", "name", "data", "flags"};
  Rng rng(0x686179737461636bull);  // fixed: the haystack is part of the test, not of the seed
  std::string s;
  for (int f = 0; s.size() < min_bytes; ++f) {
    auto pick = [&](const char* const* w) { return std::string(w[rng.below(10)]); };
    const std::string fn = pick(verbs) + "_" + pick(nouns), a = pick(args), b = pick(args), n = pick(nouns);
    s += "def " + fn + "(" + a + ", " + b + "):\n";
    s += "    \"\"\"" + pick(verbs) + " the " + n + " from " + a + ".\"\"\"\n";
    s += "    " + n + " = " + pick(verbs) + "_" + pick(nouns) + "(" + a + ")\n";
    s += "    if " + b + " is None:\n        return " + n + "\n";
    s += "    return " + n + "." + pick(verbs) + "(" + b + ")\n\n\n";
  }
  return s;
}

std::vector<NeedleCase> build_needle_cases(const Tokenizer& tok, const NeedleOptions& o) {
  KVQ_CHECK(!o.depths.empty() && o.trials > 0, Errc::invalid_argument, "needle: give at least one depth and trial");
  const std::vector<int32_t> query = tok.encode(query_text());
  std::vector<int32_t> hay;
  const size_t want_tokens = size_t(o.ctx) + 64;
  std::string text = o.haystack.empty() ? builtin_haystack(size_t(o.ctx) * 4) : o.haystack;
  KVQ_CHECK(!text.empty(), Errc::invalid_argument, "the needle haystack is empty");
  for (std::string rep = text;;) {  // repeat a short haystack until it fills the context
    hay = tok.encode(rep);
    if (hay.size() >= want_tokens) break;
    rep += text;
  }
  Rng rng(o.seed);
  std::vector<NeedleCase> cases;
  for (double depth : o.depths)
    for (int t = 0; t < o.trials; ++t) {
      NeedleCase c;
      c.depth = depth;
      c.trial = t;
      c.value = std::to_string(10000 + rng.below(90000));
      // The answer: the value's tokens as they follow the query.
      const auto full = tok.encode(query_text() + c.value);
      KVQ_CHECK(full.size() > query.size() && std::equal(query.begin(), query.end(), full.begin()), Errc::internal,
                "needle: the query does not tokenize as a prefix of query + value");
      c.answer.assign(full.begin() + ptrdiff_t(query.size()), full.end());
      const auto needle = tok.encode(needle_line(c.value));
      const int fill = o.ctx - int(needle.size() + query.size() + c.answer.size());
      KVQ_CHECK(fill >= 16, Errc::invalid_argument, "--ctx ", o.ctx, " is too short for a needle test");
      // Plant the needle after a haystack token that ends a line, nearest to the depth.
      int at = int(std::lround(depth * fill));
      for (int d = 0; d < fill; ++d) {
        const int lo = at - d, hi = at + d;
        auto ends_line = [&](int i) {
          if (i <= 0 || i > fill) return i == 0;
          const std::string& p = tok.bytes_of(hay[size_t(i - 1)]);
          return !p.empty() && p.back() == '\n';
        };
        if (lo >= 0 && ends_line(lo)) { at = lo; break; }
        if (hi <= fill && ends_line(hi)) { at = hi; break; }
      }
      c.needle_at = at;
      c.prompt.assign(hay.begin(), hay.begin() + at);
      c.prompt.insert(c.prompt.end(), needle.begin(), needle.end());
      c.prompt.insert(c.prompt.end(), hay.begin() + at, hay.begin() + fill);
      c.prompt.insert(c.prompt.end(), query.begin(), query.end());
      cases.push_back(std::move(c));
    }
  return cases;
}

NeedleReport run_needle(Model& m, const Tokenizer& tok, const std::vector<EvalCodec>& codecs, const NeedleOptions& o) {
  NeedleReport rep;
  rep.cases = build_needle_cases(tok, o);
  const int V = m.config().vocab_size;
  const int n = int(rep.cases.size());
  for (const auto& codec : codecs) {
    NeedleResult r;
    r.codec = codec;
    r.found_at.assign(o.depths.size(), 0);
    for (int i = 0; i < n && r.error.empty(); ++i) {
      const NeedleCase& c = rep.cases[size_t(i)];
      if (o.on_pass) o.on_pass(codec.label(), i, n);
      std::vector<int32_t> feed = c.prompt;
      feed.insert(feed.end(), c.answer.begin(), c.answer.end() - 1);
      const int first = int(c.prompt.size()) - 1;  // row predicting answer[0]
      bool found = true;
      double lp = 0;
      try {
        SessionOptions so;
        so.ctx = int(feed.size());
        so.prefill_chunk = o.prefill_chunk;
        Session s(m, make_session_cache(m, codec, so.ctx), nullptr, so);
        int row = 0;
        s.set_logits_sink([&](TokenId, const float* logits, int) {
          const int k = row++ - first;
          if (k < 0) return;
          const int32_t want = c.answer[size_t(k)];
          found = found && argmax(logits, V) == want;
          lp -= neg_log_likelihood(logits, V, want);
        });
        s.feed(feed);
      } catch (const Error& e) {
        if (e.code() != Errc::unsupported) throw;
        r.error = e.what();
        r.unsupported = true;
        break;
      }
      ++r.cases;
      r.found += found;
      r.logprob_sum += lp;
      r.found_at[size_t(i / o.trials)] += found;
    }
    rep.rows.push_back(std::move(r));
  }
  return rep;
}

}  // namespace kvq::eval

// The continuous-batching scheduler (engine/scheduler.hpp) on the tiny
// synthetic model and the CPU backend: admission by free pages, the
// per-step token budget, preemption by recompute, cancellation, fairness,
// and random schedules, each sequence held to its solo run.
//
// Exactness: the CPU backend computes every token of a call of up to 64
// tokens on its own (backend/cpu/kernels.cpp, kRowwiseMaxTokens) and reads
// each sequence's KV rows alone, so with steps of at most 64 tokens a
// sequence's logits do not depend on what shares its steps, how its prompt
// was chunked or whether it was recomputed: its tokens equal the solo run's
// bit for bit, sampled ones included.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "backend/cpu/cpu_backend.hpp"
#include "backend_test_util.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "engine/batch_decoder.hpp"
#include "engine/scheduler.hpp"
#include "forward_test_util.hpp"
#include "kv/codec_table.hpp"
#include "model/forward.hpp"

using namespace kvq;

namespace {

// Records the token count of every forward pass (embed runs once per pass
// over all of its tokens) and lets a test set the default step budget.
class CountingBackend : public testutil::ForwardingBackend {
 public:
  void embed(const Matrix& t, const int32_t* ids, int n, float* out) override {
    if (fail_next) {
      fail_next = false;
      throw Error(Errc::internal, "injected failure");
    }
    calls.push_back(n);
    inner().embed(t, ids, n, out);
  }
  int default_prefill_chunk() const override { return default_chunk; }
  std::vector<int> calls;
  int default_chunk = 48;
  bool fail_next = false;
};

class FakeClock : public Clock {
 public:
  double now() const override { return t; }
  double t = 0;
};

struct Record {
  std::vector<TokenId> tokens;
  bool finished = false;
  StopReason reason = StopReason::max_tokens;
  int outputs = 0;
  int preemptions = 0;
  std::vector<SeqOutput> all;
};

struct Fixture {
  std::unique_ptr<testutil::TinyModel> tiny = testutil::make_tiny(Arch::qwen3, gguf::TensorType::Q8_0, 21);
  std::unique_ptr<CountingBackend> backend = std::make_unique<CountingBackend>();
  std::unique_ptr<Model> model;
  kv::CodecOptions codec;
  int window = 0;  // exact window pages per sequence (CacheShape::window_pages)
  std::mutex mu;  // records are written by the stepping thread, read by the test
  std::map<SeqId, Record> rec;

  Fixture() {
    model = std::make_unique<Model>(tiny->cfg, load_weights(tiny->cfg, tiny->t.lookup()), *backend);
    codec.kv = "k8v8";
  }

  std::vector<TokenId> prompt(int n, uint64_t seed) const {
    Rng rng(seed);
    std::vector<TokenId> p(static_cast<size_t>(n));
    for (auto& t : p) t = TokenId(rng.next_u64() % uint64_t(tiny->cfg.vocab_size));
    return p;
  }

  // A scheduler over `pages` pages of `page_tokens` tokens.
  std::unique_ptr<Scheduler> make(int pages, int page_tokens, SchedulerOptions o, const Clock* clock = nullptr) {
    kv::CacheShape shape = model->cache_shape(pages * page_tokens);
    shape.page_tokens = page_tokens;
    if (window > 0) {
      shape.window_pages = window;
      shape.exact_pages = (o.max_running ? o.max_running : std::min(256, o.max_step_tokens)) * window;
    }
    return std::make_unique<Scheduler>(*model, backend->make_cache(codec, shape), o, clock);
  }

  SeqRequest request(const std::vector<TokenId>& p, int max_tokens, SamplingParams sp = greedy()) {
    SeqRequest r;
    r.prompt = p;
    r.sampling = sp;
    r.max_tokens = max_tokens;
    r.on_output = [this](const SeqOutput& o) {
      std::lock_guard<std::mutex> lock(mu);
      Record& x = rec[o.id];
      EXPECT_FALSE(x.finished) << "output after the finish of sequence " << o.id;
      x.tokens.insert(x.tokens.end(), o.tokens.begin(), o.tokens.end());
      x.finished = o.finished;
      x.reason = o.reason;
      x.preemptions = o.preemptions;
      ++x.outputs;
      x.all.push_back(o);
    };
    return r;
  }

  static SamplingParams greedy() {
    SamplingParams s;
    s.temperature = 0;
    return s;
  }

  // The sequence alone: BatchDecoder (itself held to the plain forward
  // pass in test_step_batch) with prefill chunks of 16; n tokens.
  // With a window, pages of window_page_tokens (the window is counted in pages).
  std::vector<TokenId> solo(const std::vector<TokenId>& p, int n, SamplingParams sp = greedy(),
                            int window_page_tokens = 8) {
    const int P = window > 0 ? window_page_tokens : 16;
    kv::CacheShape shape = model->cache_shape((int(p.size()) + n + P) / P * P);
    shape.page_tokens = P;
    shape.window_pages = window;
    shape.exact_pages = window;
    BatchDecoder dec(*model, backend->make_cache(codec, shape), 16);
    const int h = dec.add(p, sp);
    for (int i = 1; i < n; ++i) dec.step();
    const std::vector<TokenId>& t = dec.tokens(h);
    return std::vector<TokenId>(t.begin() + ptrdiff_t(p.size()), t.end());
  }

  // Steps until nothing is left (bounded); returns the steps taken.
  int drain(Scheduler& s, int max_steps = 2000) {
    int n = 0;
    while (s.has_work()) {
      s.step();
      if (++n > max_steps) {
        ADD_FAILURE() << "the scheduler did not drain in " << max_steps << " steps";
        break;
      }
    }
    return n;
  }
};

SchedulerOptions budget(int tokens) {
  SchedulerOptions o;
  o.max_step_tokens = tokens;
  return o;
}

// A finished sequence's tokens: its solo run's, or a prefix of them when it
// was cancelled (and only then).
void expect_solo(const Record& r, bool was_cancelled, const std::vector<TokenId>& want, SeqId id) {
  if (r.reason == StopReason::cancelled) {
    EXPECT_TRUE(was_cancelled) << "sequence " << id;
    ASSERT_LE(r.tokens.size(), want.size()) << "sequence " << id;
    EXPECT_TRUE(std::equal(r.tokens.begin(), r.tokens.end(), want.begin())) << "sequence " << id;
  } else {
    EXPECT_EQ(r.tokens, want) << "sequence " << id;
  }
}

// The same with automatic prefix caching.
SchedulerOptions cached_budget(int tokens) {
  SchedulerOptions o = budget(tokens);
  o.prefix_cache = true;
  return o;
}

// Plain sampling at temperature 0.9 with its own seed.
SamplingParams sampled(uint64_t seed) {
  SamplingParams s;
  s.temperature = 0.9f;
  s.top_k = 0;
  s.top_p = 1;
  s.min_p = 0;
  s.seed = seed;
  return s;
}

}  // namespace

TEST(Scheduler, OptionsAndBadRequests) {
  Fixture f;
  auto s = f.make(8, 8, {});
  EXPECT_EQ(s->options().max_step_tokens, 48);  // the backend's default_prefill_chunk
  EXPECT_EQ(s->options().max_running, 48);
  EXPECT_EQ(s->options().max_seq_tokens, 64);  // the pool
  EXPECT_EQ(s->options().vocab, f.tiny->cfg.vocab_size);
  SchedulerOptions bad = budget(4);
  bad.max_running = 5;  // decodes would not fit a step
  EXPECT_THROW(f.make(8, 8, bad), Error);
  bad = budget(16);
  bad.max_seq_tokens = 65;  // more than the pool
  EXPECT_THROW(f.make(8, 8, bad), Error);

  EXPECT_THROW(s->submit(f.request({}, 4)), Error);
  EXPECT_THROW(s->submit(f.request(f.prompt(3, 1), 0)), Error);
  EXPECT_THROW(s->submit(f.request({1, 2, 9999}, 4)), Error);
  try {
    s->submit(f.request(f.prompt(65, 1), 4));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::out_of_range);
  }
  SamplingParams neg;
  neg.temperature = -1;
  EXPECT_THROW(s->submit(f.request(f.prompt(3, 1), 4, neg)), Error);
  EXPECT_FALSE(s->has_work());
  EXPECT_EQ(s->step(), 0);

  SchedulerOptions q = budget(16);
  q.max_waiting = 2;
  auto t = f.make(8, 8, q);
  EXPECT_TRUE(t->submit(f.request(f.prompt(3, 1), 2)));
  EXPECT_TRUE(t->submit(f.request(f.prompt(3, 2), 2)));
  EXPECT_FALSE(t->submit(f.request(f.prompt(3, 3), 2)));  // the 429
  EXPECT_EQ(t->metrics().refused, 1u);
  EXPECT_EQ(t->metrics().waiting, 2);
  t->step();  // both admitted: room to wait again
  EXPECT_TRUE(t->submit(f.request(f.prompt(3, 4), 2)));
  f.drain(*t);
  EXPECT_EQ(t->metrics().finished, 3u);
}

// A waiting sequence is admitted only when the pool holds all of its
// prompt, and nobody overtakes the oldest waiting one, even one that would
// fit.
TEST(Scheduler, AdmissionIsLimitedByFreePagesInArrivalOrder) {
  Fixture f;
  FakeClock clock;
  auto s = f.make(10, 8, budget(64), &clock);  // 80 tokens
  const auto pa = f.prompt(30, 1), pb = f.prompt(27, 2), pc = f.prompt(20, 3), pd = f.prompt(5, 4);
  clock.t = 1;
  const SeqId a = *s->submit(f.request(pa, 2));  // 4 pages
  const SeqId b = *s->submit(f.request(pb, 6));  // 4 pages
  const SeqId c = *s->submit(f.request(pc, 3));  // 3 pages: waits
  const SeqId d = *s->submit(f.request(pd, 3));  // 1 page: would fit, waits behind c
  EXPECT_EQ(s->state(c), SeqState::waiting);     // in the inbox
  clock.t = 2;
  EXPECT_EQ(s->step(), 57);  // both prompts in one step
  EXPECT_EQ(s->state(a), SeqState::running);
  EXPECT_EQ(s->state(b), SeqState::running);
  EXPECT_EQ(s->state(c), SeqState::waiting);
  EXPECT_EQ(s->state(d), SeqState::waiting);
  SchedulerMetrics m = s->metrics();
  EXPECT_EQ(m.running, 2);
  EXPECT_EQ(m.waiting, 2);
  EXPECT_EQ(m.pages_used, 8);
  EXPECT_EQ(m.pages_free, 2);
  EXPECT_EQ(m.step_prefill_tokens, 57);
  EXPECT_EQ(m.step_decode_tokens, 0);
  EXPECT_EQ(m.step_sequences, 2);
  EXPECT_EQ(m.step_sequences_hist[1], 1u);  // the batch-size histogram: one step of 2 (bucket le=2)
  EXPECT_EQ(m.step_sequences_sum, 2u);
  EXPECT_EQ(f.rec[a].all.at(0).time, 2);  // the first token, at the step's clock
  EXPECT_EQ(f.rec[a].all.at(0).arrival, 1);
  s->step();  // a decodes its second token and finishes: its 4 pages are free
  EXPECT_EQ(s->state(a), SeqState::finished);
  EXPECT_TRUE(f.rec[a].finished);
  EXPECT_EQ(f.rec[a].reason, StopReason::max_tokens);
  EXPECT_EQ(s->metrics().pages_used, 4);
  s->step();  // c (3 pages) then d (1 page) are admitted, in that order
  EXPECT_EQ(s->state(c), SeqState::running);
  EXPECT_EQ(s->state(d), SeqState::running);
  m = s->metrics();
  EXPECT_EQ(m.step_decode_tokens, 1);
  EXPECT_EQ(m.step_prefill_tokens, 25);
  EXPECT_EQ(m.admitted, 4u);
  f.drain(*s);
  for (auto [id, p, n] : {std::tuple{a, pa, 2}, {b, pb, 6}, {c, pc, 3}, {d, pd, 3}}) {
    EXPECT_TRUE(f.rec[id].finished);
    EXPECT_EQ(f.rec[id].tokens, f.solo(p, n)) << "sequence " << id;
  }
  EXPECT_EQ(s->pool().used_pages(), 0);
  EXPECT_EQ(s->metrics().pages_used, 0);
  EXPECT_EQ(s->metrics().running, 0);
  EXPECT_EQ(s->metrics().waiting, 0);
}

// Oldest waiting first: with room for two at a time, sequences start in
// arrival order whatever their sizes.
TEST(Scheduler, OldestWaitingIsAdmittedFirst) {
  Fixture f;
  SchedulerOptions o = budget(32);
  o.max_running = 2;
  auto s = f.make(16, 8, o);
  const std::vector<int> lengths = {40, 3, 25, 2, 9, 30, 1};
  std::vector<SeqId> ids;
  for (size_t i = 0; i < lengths.size(); ++i)
    ids.push_back(*s->submit(f.request(f.prompt(lengths[i], 10 + i), 1 + int(i % 3))));
  std::map<SeqId, int> admitted_at;
  for (int step = 0; s->has_work() && step < 200; ++step) {
    s->step();
    for (SeqId id : ids)
      if (!admitted_at.count(id) && s->state(id) != SeqState::waiting) admitted_at[id] = step;
  }
  ASSERT_EQ(admitted_at.size(), ids.size());
  for (size_t i = 1; i < ids.size(); ++i)
    EXPECT_LE(admitted_at[ids[i - 1]], admitted_at[ids[i]]) << "sequence " << ids[i] << " overtook " << ids[i - 1];
  for (size_t i = 0; i < ids.size(); ++i)
    EXPECT_EQ(f.rec[ids[i]].tokens, f.solo(f.prompt(lengths[i], 10 + i), 1 + int(i % 3)));
}

// A long prompt arriving among decoding sequences is prefilled in chunks
// that fill what the decodes leave of each step: no forward pass exceeds the
// budget and every decoding sequence gets its token in every step.
TEST(Scheduler, StepBudgetHoldsAndDecodesAreNotStarved) {
  Fixture f;
  auto s = f.make(64, 8, budget(16));
  std::vector<std::vector<TokenId>> prompts = {f.prompt(5, 1), f.prompt(9, 2), f.prompt(12, 3)};
  std::vector<SeqId> dec;
  for (const auto& p : prompts) dec.push_back(*s->submit(f.request(p, 40)));
  s->step();
  s->step();
  const auto long_prompt = f.prompt(150, 4);
  const SeqId lp = *s->submit(f.request(long_prompt, 5));
  int prefill_steps = 0;
  while (s->state(lp) != SeqState::finished && f.rec[lp].tokens.empty()) {
    std::map<SeqId, int> before;
    for (SeqId id : dec) before[id] = int(f.rec[id].tokens.size());
    s->step();
    ++prefill_steps;
    const SchedulerMetrics m = s->metrics();
    EXPECT_EQ(m.step_decode_tokens, 3);
    EXPECT_LE(m.step_prefill_tokens, 13);
    for (SeqId id : dec) EXPECT_EQ(int(f.rec[id].tokens.size()), before[id] + 1) << "sequence " << id << " starved";
    ASSERT_LT(prefill_steps, 40);
  }
  EXPECT_EQ(prefill_steps, (150 + 12) / 13);  // 13 prompt tokens a step
  f.drain(*s);
  for (int n : f.backend->calls) EXPECT_LE(n, 16);
  EXPECT_EQ(f.rec[lp].tokens, f.solo(long_prompt, 5));
  for (size_t i = 0; i < dec.size(); ++i) EXPECT_EQ(f.rec[dec[i]].tokens, f.solo(prompts[i], 40));
  const SchedulerMetrics m = s->metrics();
  EXPECT_EQ(m.prefill_tokens, 5u + 9 + 12 + 150);
  EXPECT_EQ(m.decode_tokens, 3u * 39 + 4);
  EXPECT_EQ(s->pool().used_pages(), 0);
}

// A prompt alone is prefilled in budget-sized chunks; the steps before its
// last chunk want no logits and output nothing.
TEST(Scheduler, ALonePromptIsPrefilledInChunks) {
  Fixture f;
  auto s = f.make(16, 8, budget(16));
  const auto p = f.prompt(50, 9);
  const SeqId id = *s->submit(f.request(p, 4));
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(s->step(), 16);
    EXPECT_EQ(f.rec[id].outputs, 0);
    EXPECT_EQ(s->metrics().step_prefill_tokens, 16);
  }
  EXPECT_EQ(s->step(), 2);
  EXPECT_EQ(f.rec[id].tokens.size(), 1u);
  f.drain(*s);
  EXPECT_EQ(f.backend->calls, std::vector<int>({16, 16, 16, 2, 1, 1, 1}));
  EXPECT_EQ(f.rec[id].tokens, f.solo(p, 4));
}

// When a decode needs a page and none is free, the youngest running
// sequence gives its pages back and waits ahead of every later request;
// resumed, it prefills its prompt and generated tokens again and goes on
// with exactly the tokens of an uninterrupted run, sampled ones included.
TEST(Scheduler, PreemptionByRecomputeGivesSoloTokens) {
  for (const bool sampled : {false, true}) {
    SCOPED_TRACE(sampled ? "temperature 0.9" : "greedy");
    Fixture f;
    SamplingParams sp = Fixture::greedy();
    if (sampled) {
      sp.temperature = 0.9f;
      sp.top_k = 0;
      sp.top_p = 1;
      sp.min_p = 0;
      sp.repeat_penalty = 1.1f;
    }
    auto s = f.make(6, 8, budget(32));  // 48 tokens
    const auto pa = f.prompt(10, 1), pb = f.prompt(10, 2), pc = f.prompt(17, 3);
    SamplingParams sa = sp, sb = sp, sc = sp;
    sa.seed = 11, sb.seed = 12, sc.seed = 13;
    const SeqId a = *s->submit(f.request(pa, 26, sa));
    const SeqId b = *s->submit(f.request(pb, 20, sb));
    s->step();
    const SeqId c = *s->submit(f.request(pc, 10, sc));  // waits: c needs 3 pages, 2 are free
    std::vector<SeqId> order;                             // admissions of b (resumed) and c
    bool b_preempted = false;
    for (int step = 0; s->has_work() && step < 300; ++step) {
      const SeqState was_b = s->state(b), was_c = s->state(c);
      s->step();
      if (s->state(b) == SeqState::preempted) {
        if (was_b == SeqState::running) EXPECT_EQ(s->state(a), SeqState::running);  // the older one keeps going
        b_preempted = true;
        EXPECT_EQ(s->metrics().preempted, 1);
      }
      if (was_b == SeqState::preempted && s->state(b) != SeqState::preempted) order.push_back(b);
      if (was_c == SeqState::waiting && s->state(c) != SeqState::waiting) order.push_back(c);
    }
    EXPECT_TRUE(b_preempted);
    EXPECT_EQ(order.size(), 2u);
    if (order.size() == 2) EXPECT_EQ(order[0], b);  // b arrived before c: resumed before c starts
    EXPECT_GE(f.rec[b].preemptions, 1);
    EXPECT_EQ(f.rec[a].preemptions, 0);
    EXPECT_GE(s->metrics().preemptions, 1u);
    EXPECT_EQ(f.rec[a].tokens, f.solo(pa, 26, sa));
    EXPECT_EQ(f.rec[b].tokens, f.solo(pb, 20, sb));
    EXPECT_EQ(f.rec[c].tokens, f.solo(pc, 10, sc));
    EXPECT_EQ(s->pool().used_pages(), 0);
  }
}

// A cancel (from another thread) is read at the next step: the sequence
// ends with StopReason::cancelled and its pages are free in that step.
TEST(Scheduler, CancellationFreesPagesAtTheNextStep) {
  Fixture f;
  auto s = f.make(12, 8, budget(32));
  const auto pa = f.prompt(20, 1), pb = f.prompt(30, 2), pc = f.prompt(60, 3);
  const SeqId a = *s->submit(f.request(pa, 12));
  const SeqId b = *s->submit(f.request(pb, 50));
  const SeqId c = *s->submit(f.request(pc, 5));  // 8 pages: waits
  s->step();
  s->step();
  EXPECT_EQ(s->state(b), SeqState::running);
  EXPECT_EQ(s->state(c), SeqState::waiting);
  const int b_tokens = int(f.rec[b].tokens.size());
  std::thread([&] {
    s->cancel(b);
    s->cancel(c);
    s->cancel(12345);  // unknown: ignored
  }).join();
  EXPECT_EQ(s->metrics().pages_used, 3 + 4);  // nothing happens before the step
  s->step();
  EXPECT_EQ(s->state(b), SeqState::finished);
  EXPECT_EQ(s->state(c), SeqState::finished);
  EXPECT_TRUE(f.rec[b].finished);
  EXPECT_EQ(f.rec[b].reason, StopReason::cancelled);
  EXPECT_EQ(int(f.rec[b].tokens.size()), b_tokens);  // no token after the cancel
  EXPECT_EQ(f.rec[c].reason, StopReason::cancelled);
  EXPECT_TRUE(f.rec[c].tokens.empty());
  EXPECT_EQ(s->metrics().pages_used, 3);  // a's alone (21..23 tokens)
  EXPECT_EQ(s->metrics().cancelled, 2u);
  s->cancel(b);  // finished: ignored
  f.drain(*s);
  EXPECT_EQ(f.rec[a].tokens, f.solo(pa, 12));
  EXPECT_EQ(f.rec[b].outputs, b_tokens + 1);
  EXPECT_EQ(s->pool().used_pages(), 0);
}

// A forward pass that throws feeds nothing: the error reaches the caller,
// what ended before the pass is delivered, and the next step goes on as if
// the failed one had not happened.
TEST(Scheduler, AFailedForwardPassFeedsNothing) {
  Fixture f;
  auto s = f.make(16, 8, budget(32));
  const auto pa = f.prompt(20, 1), pb = f.prompt(9, 2);
  const SeqId a = *s->submit(f.request(pa, 8));
  const SeqId b = *s->submit(f.request(pb, 8));
  s->step();
  s->step();
  s->cancel(b);
  f.backend->fail_next = true;
  EXPECT_THROW(s->step(), Error);
  EXPECT_EQ(f.rec[b].reason, StopReason::cancelled);  // delivered before the error
  EXPECT_TRUE(f.rec[b].finished);
  EXPECT_EQ(s->state(a), SeqState::running);
  EXPECT_EQ(f.rec[a].tokens.size(), 2u);
  EXPECT_EQ(s->metrics().pages_used, 3);
  f.drain(*s);
  EXPECT_EQ(f.rec[a].tokens, f.solo(pa, 8));
  EXPECT_EQ(s->pool().used_pages(), 0);
}

// Stop tokens end a sequence with StopReason::eog (the token is output);
// the pool's end, with StopReason::context_full.
TEST(Scheduler, StopTokensAndContextEnd) {
  Fixture f;
  SchedulerOptions o = budget(32);
  o.max_seq_tokens = 20;
  auto s = f.make(8, 8, o);
  const auto p = f.prompt(15, 5);
  const std::vector<TokenId> solo = f.solo(p, 10);
  SeqRequest r = f.request(p, 10);
  r.stop_tokens = {solo[2]};
  const SeqId stopped = *s->submit(std::move(r));
  const SeqId full = *s->submit(f.request(p, 100));
  f.drain(*s);
  const auto first = std::find(solo.begin(), solo.end(), solo[2]);
  EXPECT_EQ(f.rec[stopped].tokens, std::vector<TokenId>(solo.begin(), first + 1));
  EXPECT_EQ(f.rec[stopped].reason, StopReason::eog);
  EXPECT_EQ(f.rec[full].reason, StopReason::context_full);
  EXPECT_EQ(f.rec[full].tokens.size(), 6u);  // 20 in the store, the 21st sampled
  EXPECT_EQ(f.rec[full].tokens, f.solo(p, 6));
}

// Requests arrive and are cancelled at random while the pool is small
// enough to force preemptions; every sequence's tokens are its solo run's
// (a prefix of them when cancelled), no step exceeds the budget, and every
// page comes back.
TEST(Scheduler, RandomScheduleMatchesSoloRuns) {
  Fixture f;
  f.codec.kv = "tsym3";
  auto s = f.make(20, 8, budget(24));  // 160 tokens
  Rng rng(2024);
  struct Req {
    std::vector<TokenId> prompt;
    int max_tokens;
    std::vector<TokenId> stop;
    bool cancelled = false;
  };
  std::map<SeqId, Req> reqs;
  std::vector<SeqId> ids;
  for (int tick = 0; tick < 120; ++tick) {
    if (tick < 90 && rng.next_u64() % 3 == 0) {
      Req q{f.prompt(1 + int(rng.next_u64() % 60), 500 + uint64_t(tick)), 1 + int(rng.next_u64() % 24), {}};
      if (rng.next_u64() % 4 == 0) q.stop = {TokenId(rng.next_u64() % 96)};
      SeqRequest r = f.request(q.prompt, q.max_tokens);
      r.stop_tokens = q.stop;
      const SeqId id = *s->submit(std::move(r));
      reqs[id] = q;
      ids.push_back(id);
    }
    if (!ids.empty() && rng.next_u64() % 10 == 0) {
      const SeqId id = ids[rng.next_u64() % ids.size()];
      reqs[id].cancelled = true;  // may already be finished: then a no-op
      s->cancel(id);
    }
    s->step();
    EXPECT_LE(s->pool().used_pages(), 20);
  }
  f.drain(*s);
  const SchedulerMetrics m = s->metrics();
  EXPECT_GT(ids.size(), 20u);
  EXPECT_GT(m.preemptions, 0u);
  EXPECT_GT(m.cancelled, 0u);
  EXPECT_EQ(m.finished, ids.size());
  EXPECT_EQ(s->pool().used_pages(), 0);
  for (int n : f.backend->calls) EXPECT_LE(n, 24);
  for (SeqId id : ids) {
    const Req& q = reqs[id];
    const Record& r = f.rec[id];
    ASSERT_TRUE(r.finished) << "sequence " << id;
    std::vector<TokenId> want = f.solo(q.prompt, q.max_tokens);
    for (size_t i = 0; i < want.size(); ++i)
      if (std::find(q.stop.begin(), q.stop.end(), want[i]) != q.stop.end()) {
        want.resize(i + 1);
        break;
      }
    expect_solo(r, q.cancelled, want, id);
    if (r.reason != StopReason::cancelled)
      EXPECT_EQ(r.reason, want.size() < size_t(q.max_tokens) ? StopReason::eog : StopReason::max_tokens);
  }
}

// submit() from several threads while one thread steps (the server's
// shape: HTTP threads submit, the engine thread steps).
TEST(Scheduler, SubmitFromOtherThreads) {
  Fixture f;
  auto s = f.make(32, 8, budget(32));
  std::atomic<int> left{4};
  std::mutex pm;
  std::map<SeqId, std::vector<TokenId>> prompts;
  std::vector<std::thread> th;
  for (int t = 0; t < 4; ++t)
    th.emplace_back([&, t] {
      for (int i = 0; i < 3; ++i) {
        const auto p = f.prompt(3 + 7 * i + t, uint64_t(100 * t + i));
        const SeqId id = *s->submit(f.request(p, 6));
        std::lock_guard<std::mutex> lock(pm);
        prompts[id] = p;
      }
      --left;
    });
  while (left > 0 || s->has_work()) {
    if (!s->has_work()) s->wait_for_work(std::chrono::milliseconds(5));
    s->step();
  }
  for (auto& t : th) t.join();
  ASSERT_EQ(prompts.size(), 12u);
  for (auto& [id, p] : prompts) EXPECT_EQ(f.rec[id].tokens, f.solo(p, 6)) << "sequence " << id;
  EXPECT_EQ(s->pool().used_pages(), 0);
}

// want_logits: each output carries the row its token was sampled from (the
// server's logprobs); greedy tokens are that row's argmax and equal those of
// the same request without rows, which the backend chose itself; a
// neighbour without want_logits gets no rows.
TEST(Scheduler, LogitsRowsForRequestsThatAskForThem) {
  Fixture f;
  auto s = f.make(16, 16, budget(64));
  const auto p = f.prompt(9, 77);
  SeqRequest with = f.request(p, 6);
  with.want_logits = true;
  const SeqId a = *s->submit(std::move(with));
  const SeqId b = *s->submit(f.request(p, 6));
  f.drain(*s);
  const auto want = f.solo(p, 6);
  std::lock_guard<std::mutex> lock(f.mu);
  EXPECT_EQ(f.rec[a].tokens, want);
  EXPECT_EQ(f.rec[b].tokens, want);
  int rows = 0;
  for (const SeqOutput& o : f.rec[a].all) {
    if (o.tokens.empty()) continue;
    ASSERT_EQ(o.logits.size(), size_t(f.tiny->cfg.vocab_size));
    EXPECT_EQ(TokenId(std::max_element(o.logits.begin(), o.logits.end()) - o.logits.begin()), o.tokens[0]);
    ++rows;
  }
  EXPECT_EQ(rows, 6);
  for (const SeqOutput& o : f.rec[b].all) EXPECT_TRUE(o.logits.empty());
}

// Prefix caching: a later request whose prompt starts like an earlier one
// adopts the earlier one's full pages and prefills only the rest; its tokens
// are still its solo run's, and a request that opts out neither reads nor
// feeds the cache.
TEST(Scheduler, PrefixCacheSkipsTheSharedPrefillAndKeepsSoloTokens) {
  Fixture f;
  auto s = f.make(24, 8, cached_budget(32));
  const auto shared = f.prompt(27, 40);
  auto with_tail = [&](uint64_t seed, int n) {
    std::vector<TokenId> p = shared;
    const auto tail = f.prompt(n, seed);
    p.insert(p.end(), tail.begin(), tail.end());
    return p;
  };
  const auto pa = with_tail(1, 5), pb = with_tail(2, 9);
  const SeqId a = *s->submit(f.request(pa, 12));
  f.drain(*s);
  SchedulerMetrics m = s->metrics();
  EXPECT_EQ(m.prefix_hit_tokens, 0u);
  EXPECT_EQ(m.prefix_lookup_tokens, 24u);  // (32 - 1) / 8 = 3 whole pages before the last token
  EXPECT_EQ(m.pages_used, 0);
  EXPECT_EQ(m.pages_cached, (32 + 11) / 8);  // every page a filled (the last token sampled is not in the store)
  EXPECT_EQ(m.pages_used + m.pages_cached + m.pages_free, m.pages_total);
  const uint64_t prefill_a = m.prefill_tokens;
  EXPECT_EQ(prefill_a, 32u);

  const SeqId b = *s->submit(f.request(pb, 10));
  f.drain(*s);
  m = s->metrics();
  EXPECT_EQ(m.prefix_hit_tokens, 24u);  // the shared 27 tokens hold three whole pages
  EXPECT_EQ(m.prefill_tokens - prefill_a, uint64_t(pb.size()) - 24u);

  // The same prompt again: every whole page but the one holding its last token.
  const SeqId a2 = *s->submit(f.request(pa, 12));
  f.drain(*s);
  EXPECT_EQ(s->metrics().prefix_hit_tokens, 24u + 24u);
  // A continuation of a's whole output (a chat's next turn) finds a's generated pages too.
  std::vector<TokenId> turn = pa;
  turn.insert(turn.end(), f.rec[a].tokens.begin(), f.rec[a].tokens.end());
  const uint64_t hits = s->metrics().prefix_hit_tokens;
  const SeqId t2 = *s->submit(f.request(turn, 4));
  f.drain(*s);
  EXPECT_EQ(s->metrics().prefix_hit_tokens - hits, 40u);  // 44 tokens: five whole pages before the last
  // Opting out.
  SeqRequest r = f.request(pb, 10);
  r.cache_prefix = false;
  const uint64_t before = s->metrics().prefill_tokens;
  const SeqId b2 = *s->submit(std::move(r));
  f.drain(*s);
  EXPECT_EQ(s->metrics().prefill_tokens - before, uint64_t(pb.size()));

  EXPECT_EQ(f.rec[a].tokens, f.solo(pa, 12));
  EXPECT_EQ(f.rec[a2].tokens, f.rec[a].tokens);
  EXPECT_EQ(f.rec[b].tokens, f.solo(pb, 10));
  EXPECT_EQ(f.rec[b2].tokens, f.rec[b].tokens);
  EXPECT_EQ(f.rec[t2].tokens, f.solo(turn, 4));
  EXPECT_EQ(s->metrics().pages_used, 0);
  EXPECT_EQ(s->pool().used_pages(), s->metrics().pages_cached);
}

// Idle cached pages are reclaimed (least recently used first) before a
// running sequence is preempted or a waiting one is kept out.
TEST(Scheduler, IdleCachedPagesAreEvictedBeforeAnyPreemption) {
  Fixture f;
  auto s = f.make(6, 8, cached_budget(32));  // 48 tokens
  const auto pa = f.prompt(30, 1), pb = f.prompt(33, 2);
  const SeqId a = *s->submit(f.request(pa, 11));
  f.drain(*s);
  EXPECT_EQ(s->metrics().pages_cached, 5);
  const SeqId b = *s->submit(f.request(pb, 14));  // 47 tokens: all 6 pages
  f.drain(*s);
  const SchedulerMetrics m = s->metrics();
  EXPECT_EQ(m.preemptions, 0u);
  EXPECT_GE(m.prefix_evicted_pages, 5u);
  EXPECT_EQ(f.rec[a].tokens, f.solo(pa, 11));
  EXPECT_EQ(f.rec[b].tokens, f.solo(pb, 14));
  EXPECT_EQ(m.pages_used, 0);
}

// Random arrivals over a few shared prompt openings, with preemptions and
// cancels, with the prefix cache on: every sequence still gets its solo
// tokens, the cache is hit, and every page a sequence held comes back.
TEST(Scheduler, RandomScheduleWithPrefixCacheMatchesSoloRuns) {
  Fixture f;
  f.codec.kv = "tsym3";
  auto s = f.make(20, 8, cached_budget(24));  // 160 tokens
  Rng rng(77);
  const std::vector<TokenId> openings[3] = {f.prompt(40, 900), f.prompt(24, 901), f.prompt(17, 902)};
  struct Req {
    std::vector<TokenId> prompt;
    int max_tokens;
    bool cancelled = false;
  };
  std::map<SeqId, Req> reqs;
  std::vector<SeqId> ids;
  for (int tick = 0; tick < 120; ++tick) {
    if (tick < 90 && rng.next_u64() % 3 == 0) {
      const auto& open = openings[rng.next_u64() % 3];
      std::vector<TokenId> p(open.begin(), open.begin() + ptrdiff_t(1 + rng.next_u64() % open.size()));
      const auto tail = f.prompt(int(rng.next_u64() % 12), 700 + uint64_t(tick));
      p.insert(p.end(), tail.begin(), tail.end());
      Req q{p, 1 + int(rng.next_u64() % 16)};
      const SeqId id = *s->submit(f.request(q.prompt, q.max_tokens));
      reqs[id] = q;
      ids.push_back(id);
    }
    if (!ids.empty() && rng.next_u64() % 12 == 0) {
      const SeqId id = ids[rng.next_u64() % ids.size()];
      reqs[id].cancelled = true;
      s->cancel(id);
    }
    s->step();
    const SchedulerMetrics m = s->metrics();
    EXPECT_EQ(m.pages_used + m.pages_cached + m.pages_free, m.pages_total);
  }
  f.drain(*s);
  const SchedulerMetrics m = s->metrics();
  EXPECT_GT(m.prefix_hit_tokens, 0u);
  EXPECT_GT(m.prefix_evicted_pages, 0u);
  EXPECT_EQ(m.finished, ids.size());
  EXPECT_EQ(m.pages_used, 0);
  EXPECT_EQ(s->pool().used_pages(), m.pages_cached);
  for (int n : f.backend->calls) EXPECT_LE(n, 24);
  for (SeqId id : ids) {
    const Req& q = reqs[id];
    const Record& r = f.rec[id];
    ASSERT_TRUE(r.finished) << "sequence " << id;
    expect_solo(r, q.cancelled, f.solo(q.prompt, q.max_tokens), id);
  }
}

// One prompt sent n times at once (the server's n > 1): the first copy
// prefills it, the others wait for its pages instead of computing them
// again, and each copy still samples its own tokens (its own seed).
TEST(Scheduler, CopiesOfOnePromptPrefillItOnce) {
  Fixture f;
  auto s = f.make(24, 8, cached_budget(64));
  const auto p = f.prompt(41, 9);
  std::vector<SeqId> ids;
  for (int k = 0; k < 3; ++k) ids.push_back(*s->submit(f.request(p, 9, sampled(500 + uint64_t(k)))));
  f.drain(*s);
  const SchedulerMetrics m = s->metrics();
  EXPECT_EQ(m.prefill_tokens, 41u + 2u * (41u - 40u));  // the copies adopt five whole pages each
  EXPECT_EQ(m.prefix_hit_tokens, 80u);
  for (int k = 0; k < 3; ++k)
    EXPECT_EQ(f.rec[ids[size_t(k)]].tokens, f.solo(p, 9, sampled(500 + uint64_t(k)))) << "copy " << k;
  EXPECT_NE(f.rec[ids[0]].tokens, f.rec[ids[1]].tokens);
}

// With an exact window of one page the scheduler still gives every sequence
// its solo run's tokens (a solo run with the same window), through prefix
// cache hits, evictions, preemptions and cancellations: a windowed store
// encodes the bf16 K/V on every path, so recomputed and adopted pages hold
// the codes the solo run made when the pages left its window.
TEST(Scheduler, RandomScheduleWithAnExactWindowMatchesSoloRuns) {
  for (const bool cached : {false, true}) {
    SCOPED_TRACE(cached ? "prefix cache" : "no prefix cache");
    Fixture f;
    f.codec.kv = "k8vturbo2";
    f.window = 1;
    SchedulerOptions o = cached ? cached_budget(24) : budget(24);
    o.max_running = 6;
    auto s = f.make(16, 8, o);  // 128 tokens of packed pages: preemptions
    Rng rng(cached ? 78 : 79);
    const std::vector<TokenId> opening = f.prompt(30, 903);
    struct Req {
      std::vector<TokenId> prompt;
      int max_tokens;
      bool cancelled = false;
    };
    std::map<SeqId, Req> reqs;
    std::vector<SeqId> ids;
    for (int tick = 0; tick < 100; ++tick) {
      if (tick < 70 && rng.next_u64() % 3 == 0) {
        std::vector<TokenId> p(opening.begin(), opening.begin() + ptrdiff_t(1 + rng.next_u64() % opening.size()));
        const auto tail = f.prompt(int(rng.next_u64() % 10), 800 + uint64_t(tick));
        p.insert(p.end(), tail.begin(), tail.end());
        Req q{p, 1 + int(rng.next_u64() % 20)};
        const SeqId id = *s->submit(f.request(q.prompt, q.max_tokens));
        reqs[id] = q;
        ids.push_back(id);
      }
      if (!ids.empty() && rng.next_u64() % 15 == 0) {
        const SeqId id = ids[rng.next_u64() % ids.size()];
        reqs[id].cancelled = true;
        s->cancel(id);
      }
      s->step();
    }
    f.drain(*s);
    const SchedulerMetrics m = s->metrics();
    EXPECT_EQ(m.finished, ids.size());
    if (cached) EXPECT_GT(m.prefix_hit_tokens, 0u);  // and idle cached pages evicted, not sequences preempted
    else EXPECT_GT(m.preemptions, 0u);
    EXPECT_EQ(m.pages_used, 0);
    for (SeqId id : ids) {
      const Req& q = reqs[id];
      const Record& r = f.rec[id];
      ASSERT_TRUE(r.finished) << "sequence " << id;
      expect_solo(r, q.cancelled, f.solo(q.prompt, q.max_tokens), id);
    }
  }
}

TEST(Scheduler, AnExactWindowNeedsAPoolForEveryRunningSequence) {
  Fixture f;
  kv::CacheShape shape = f.model->cache_shape(16 * 8);
  shape.page_tokens = 8;
  shape.window_pages = 2;
  shape.exact_pages = 7;
  SchedulerOptions o = budget(24);
  o.max_running = 4;  // needs 8
  try {
    Scheduler s(*f.model, f.backend->make_cache(f.codec, shape), o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("needs 8 exact pages"), std::string::npos) << e.what();
  }
}

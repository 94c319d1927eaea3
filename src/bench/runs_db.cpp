#include "bench/runs_db.hpp"

#include <sqlite3.h>

#include <cstdlib>
#include <filesystem>
#include <algorithm>
#include <nlohmann/json.hpp>

#include "bench/run_meta.hpp"
#include "bench/stats.hpp"
#include "core/error.hpp"

namespace kvq::bench {

namespace fs = std::filesystem;
using nlohmann::json;

std::string resolve_home(const std::string& flag) {
  fs::path home;
  if (!flag.empty()) {
    home = flag;
  } else if (const char* env = std::getenv("KVQ_HOME"); env && *env) {
    home = env;
  } else {
    const char* h = std::getenv("HOME");
    KVQ_CHECK(h && *h, Errc::io, "neither --home, $KVQ_HOME nor $HOME is set; pass --home DIR");
    home = fs::path(h) / ".kvq";
  }
  std::error_code ec;
  fs::create_directories(home, ec);
  KVQ_CHECK(!ec && fs::is_directory(home), Errc::io, "cannot create the kvq home folder '", home.string(), "': ",
            ec ? ec.message() : "not a directory", " (pass --home DIR or set $KVQ_HOME)");
  return home.string();
}

std::string runs_db_path(const std::string& home) { return (fs::path(home) / "runs.db").string(); }

namespace {

// Migration i takes the schema from version i to i + 1. Never edit a
// released entry: append a new one (and bump RunsDb::kSchemaVersion).
const char* const kMigrations[] = {
    // 0 -> 1
    R"sql(
CREATE TABLE schema_version(version INTEGER NOT NULL, applied_at TEXT NOT NULL);
CREATE TABLE runs(
  run_id INTEGER PRIMARY KEY AUTOINCREMENT,
  kind TEXT NOT NULL,
  started_at TEXT NOT NULL,
  model TEXT NOT NULL,
  device TEXT NOT NULL,
  git_sha TEXT NOT NULL,
  build_type TEXT NOT NULL,
  kvq_version TEXT NOT NULL,
  host TEXT NOT NULL,
  gpu_name TEXT NOT NULL,
  driver TEXT NOT NULL,
  clocks TEXT NOT NULL,
  copy_bw_gbs REAL NOT NULL,
  params_json TEXT NOT NULL);
CREATE TABLE run_ends(
  run_id INTEGER PRIMARY KEY REFERENCES runs(run_id),
  finished_at TEXT NOT NULL,
  status TEXT NOT NULL,
  summary_json TEXT NOT NULL);
CREATE TABLE bench_cells(
  cell_id INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id INTEGER NOT NULL REFERENCES runs(run_id),
  codec TEXT NOT NULL,
  ctx INTEGER NOT NULL,
  gen INTEGER NOT NULL,
  reps INTEGER NOT NULL,
  status TEXT NOT NULL,
  error TEXT NOT NULL,
  flags TEXT NOT NULL,
  decode_tps REAL, decode_tps_min REAL, decode_tps_max REAL,
  ttft_s REAL, ttft_s_min REAL, ttft_s_max REAL,
  prefill_tps REAL, prefill_tps_min REAL, prefill_tps_max REAL,
  itl_p50_ms REAL, itl_p50_ms_min REAL, itl_p50_ms_max REAL,
  itl_p99_ms REAL, itl_p99_ms_min REAL, itl_p99_ms_max REAL,
  kv_seq REAL,
  kv_bytes INTEGER,
  kv_mib REAL,
  bits_per_value REAL,
  kv_capacity_bytes INTEGER,
  device_mem_delta INTEGER,
  weight_bytes INTEGER,
  step_bytes REAL,
  achieved_gbs REAL,
  pct_copy_bw REAL,
  attn_kernels TEXT NOT NULL,
  kv_host_device_bytes INTEGER,
  dispatch_json TEXT NOT NULL,
  digest TEXT NOT NULL,
  digests_agree INTEGER NOT NULL,
  reps_json TEXT NOT NULL);
CREATE INDEX bench_cells_run ON bench_cells(run_id);
CREATE TABLE bench_fits(
  run_id INTEGER NOT NULL REFERENCES runs(run_id),
  codec TEXT NOT NULL,
  a_ms REAL NOT NULL,
  b_ms_per_1k REAL NOT NULL,
  residual_ms REAL NOT NULL,
  n_points INTEGER NOT NULL,
  ctx_min INTEGER NOT NULL,
  ctx_max INTEGER NOT NULL,
  PRIMARY KEY(run_id, codec));
CREATE TABLE eval_results(
  result_id INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id INTEGER NOT NULL REFERENCES runs(run_id),
  codec TEXT NOT NULL,
  metric TEXT NOT NULL,
  ctx INTEGER,
  value REAL NOT NULL,
  detail_json TEXT NOT NULL,
  created_at TEXT NOT NULL);
CREATE INDEX eval_results_run ON eval_results(run_id);
)sql",
    // 1 -> 2: the prefill-once protocol. prefill_n: how many prefills the
    // cell's TTFT and prefill tok/s are from (NULL in rows written before:
    // those came from the `reps` measured runs, each of which prefilled);
    // prefills_json: each timed prefill ("[]" for those rows).
    R"sql(
ALTER TABLE bench_cells ADD COLUMN prefill_n INTEGER;
ALTER TABLE bench_cells ADD COLUMN prefills_json TEXT NOT NULL DEFAULT '[]';
)sql",
    // 2 -> 3: the step batch (kvq bench --batch). batch: sequences decoded
    // together (1 in rows written before: one sequence per step); kv_pages:
    // KV pool pages they held (0 for one-sequence cells); capacity: the batch
    // is what a KV budget admitted (--batch max).
    R"sql(
ALTER TABLE bench_cells ADD COLUMN batch INTEGER NOT NULL DEFAULT 1;
ALTER TABLE bench_cells ADD COLUMN kv_pages INTEGER NOT NULL DEFAULT 0;
ALTER TABLE bench_cells ADD COLUMN capacity INTEGER NOT NULL DEFAULT 0;
)sql",
    // 3 -> 4: kvq bench serve (an OpenAI-compatible server measured over
    // HTTP). One row per load level of a run: a concurrency (mode
    // 'concurrency') or a Poisson request rate (mode 'rate'), with its
    // latency percentiles (NULL when no request of the level succeeded),
    // throughput and failures (errors_json: {reason: count}).
    R"sql(
CREATE TABLE serve_levels(
  run_id INTEGER NOT NULL REFERENCES runs(run_id),
  level INTEGER NOT NULL,
  mode TEXT NOT NULL,
  concurrency INTEGER NOT NULL,
  rate REAL,
  requests INTEGER NOT NULL,
  ok INTEGER NOT NULL,
  failed INTEGER NOT NULL,
  duration_s REAL NOT NULL,
  req_per_s REAL NOT NULL,
  out_tok_per_s REAL NOT NULL,
  in_tok_per_s REAL NOT NULL,
  prompt_tokens INTEGER NOT NULL,
  output_tokens INTEGER NOT NULL,
  ttft_mean_s REAL, ttft_p50_s REAL, ttft_p90_s REAL, ttft_p99_s REAL,
  tpot_p50_ms REAL, tpot_p90_ms REAL, tpot_p99_ms REAL,
  itl_p50_ms REAL, itl_p90_ms REAL, itl_p99_ms REAL,
  e2e_p50_s REAL, e2e_p99_s REAL,
  errors_json TEXT NOT NULL,
  PRIMARY KEY(run_id, level));
)sql",
    // 4 -> 5: the soak (kvq bench serve --disconnect). disconnected: requests
    // that hung up on purpose, neither ok nor failed (0 in rows written
    // before: nobody hung up); server_json: the server's state after the
    // level, read from its /metrics ('{}': not checked, as in those rows).
    R"sql(
ALTER TABLE serve_levels ADD COLUMN disconnected INTEGER NOT NULL DEFAULT 0;
ALTER TABLE serve_levels ADD COLUMN server_json TEXT NOT NULL DEFAULT '{}';
)sql",
};
constexpr int kNumMigrations = int(sizeof kMigrations / sizeof kMigrations[0]);
static_assert(kNumMigrations == RunsDb::kSchemaVersion, "one migration per schema version");

// Append-only: every table rejects UPDATE and DELETE (created after each
// migration for any table that lacks the triggers).
const char* const kAppendOnlyTables[] = {"schema_version", "runs", "run_ends", "bench_cells", "bench_fits",
                                         "eval_results", "serve_levels"};

// A prepared statement with RAII finalize and 1-based binds.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) : db_(db) {
    if (sqlite3_prepare_v2(db, sql, -1, &st_, nullptr) != SQLITE_OK)
      fail(Errc::internal, "runs.db: cannot prepare '", sql, "': ", sqlite3_errmsg(db));
  }
  ~Stmt() { sqlite3_finalize(st_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  Stmt& bind(int i, const std::string& v) {
    check(sqlite3_bind_text(st_, i, v.data(), int(v.size()), SQLITE_TRANSIENT));
    return *this;
  }
  Stmt& bind(int i, const char* v) { return bind(i, std::string(v)); }
  Stmt& bind(int i, double v) {
    check(sqlite3_bind_double(st_, i, v));
    return *this;
  }
  Stmt& bind(int i, int64_t v) {
    check(sqlite3_bind_int64(st_, i, v));
    return *this;
  }
  Stmt& bind(int i, int v) { return bind(i, int64_t(v)); }
  Stmt& bind(int i, uint64_t v) { return bind(i, int64_t(v)); }
  Stmt& bind_null(int i) {
    check(sqlite3_bind_null(st_, i));
    return *this;
  }

  // true: a row is ready; false: done.
  bool step() {
    const int rc = sqlite3_step(st_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    fail(Errc::io, "runs.db: ", sqlite3_errmsg(db_), " (", sqlite3_sql(st_), ")");
  }
  void run() {
    while (step()) {
    }
  }

  bool is_null(int c) const { return sqlite3_column_type(st_, c) == SQLITE_NULL; }
  std::string text(int c) const {
    const auto* p = sqlite3_column_text(st_, c);
    return p ? std::string(reinterpret_cast<const char*>(p), size_t(sqlite3_column_bytes(st_, c))) : std::string();
  }
  double real(int c) const { return sqlite3_column_double(st_, c); }
  int64_t integer(int c) const { return sqlite3_column_int64(st_, c); }

 private:
  void check(int rc) {
    if (rc != SQLITE_OK) fail(Errc::internal, "runs.db: bind failed: ", sqlite3_errmsg(db_));
  }
  sqlite3* db_;
  sqlite3_stmt* st_ = nullptr;
};

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size() && !s.empty()) {
    const size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

json dispatch_to_json(const DispatchStats& d) {
  json layers = json::array();
  for (const auto& k : d.attention)
    layers.push_back({{"layer", k.layer}, {"kernel", k.kernel}, {"phase", k.decode ? "decode" : "prefill"},
                      {"calls", k.calls}});
  return {{"counted", d.counted},
          {"attention", layers},
          {"kv_host_to_device_bytes", d.kv_host_to_device_bytes},
          {"kv_device_to_host_bytes", d.kv_device_to_host_bytes}};
}

DispatchStats dispatch_from_json(const json& j) {
  DispatchStats d;
  d.counted = j.value("counted", false);
  for (const auto& k : j.value("attention", json::array()))
    d.attention.push_back({k.value("layer", 0), k.value("kernel", ""), k.value("phase", "") == "decode",
                           k.value("calls", uint64_t(0))});
  d.kv_host_to_device_bytes = j.value("kv_host_to_device_bytes", uint64_t(0));
  d.kv_device_to_host_bytes = j.value("kv_device_to_host_bytes", uint64_t(0));
  return d;
}

json reps_to_json(const std::vector<RepResult>& reps) {
  json a = json::array();
  for (const auto& r : reps)
    a.push_back({{"decode_tps", r.decode_tps},
                 {"ttft_s", r.ttft_s},
                 {"prefill_tps", r.prefill_tps},
                 {"itl_p50_ms", r.itl_p50_ms},
                 {"itl_p99_ms", r.itl_p99_ms},
                 {"n_generated", r.n_generated},
                 {"digest", r.digest},
                 {"refeed_s", r.refeed_s}});
  return a;
}

json prefills_to_json(const std::vector<PrefillResult>& prefills) {
  json a = json::array();
  for (const auto& p : prefills)
    a.push_back({{"ttft_s", p.ttft_s}, {"prefill_s", p.prefill_s}, {"prefill_tps", p.prefill_tps},
                 {"first_token", p.first_token}});
  return a;
}

std::vector<PrefillResult> prefills_from_json(const json& a) {
  std::vector<PrefillResult> out;
  for (const auto& p : a) {
    PrefillResult x;
    x.ttft_s = p.value("ttft_s", 0.0);
    x.prefill_s = p.value("prefill_s", 0.0);
    x.prefill_tps = p.value("prefill_tps", 0.0);
    x.first_token = p.value("first_token", -1);
    out.push_back(x);
  }
  return out;
}

std::vector<RepResult> reps_from_json(const json& a) {
  std::vector<RepResult> reps;
  for (const auto& r : a) {
    RepResult x;
    x.decode_tps = r.value("decode_tps", 0.0);
    x.ttft_s = r.value("ttft_s", 0.0);
    x.prefill_tps = r.value("prefill_tps", 0.0);
    x.itl_p50_ms = r.value("itl_p50_ms", 0.0);
    x.itl_p99_ms = r.value("itl_p99_ms", 0.0);
    x.n_generated = r.value("n_generated", 0);
    x.digest = r.value("digest", "");
    x.refeed_s = r.value("refeed_s", 0.0);
    reps.push_back(x);
  }
  return reps;
}

RunRow read_run(const Stmt& q) {
  RunRow r;
  r.run_id = q.integer(0);
  RunMeta& m = r.meta;
  m.kind = q.text(1);
  m.started_at = q.text(2);
  m.model = q.text(3);
  m.device = q.text(4);
  m.git_sha = q.text(5);
  m.build_type = q.text(6);
  m.kvq_version = q.text(7);
  m.host = q.text(8);
  m.gpu_name = q.text(9);
  m.driver = q.text(10);
  m.clocks = q.text(11);
  m.copy_bw_gbs = q.real(12);
  m.params_json = q.text(13);
  r.finished_at = q.is_null(14) ? "" : q.text(14);
  r.status = q.is_null(15) ? "incomplete" : q.text(15);
  r.summary_json = q.is_null(16) ? "{}" : q.text(16);
  return r;
}

constexpr const char* kRunSelect =
    "SELECT r.run_id, r.kind, r.started_at, r.model, r.device, r.git_sha, r.build_type, r.kvq_version, r.host, "
    "r.gpu_name, r.driver, r.clocks, r.copy_bw_gbs, r.params_json, e.finished_at, e.status, e.summary_json "
    "FROM runs r LEFT JOIN run_ends e ON e.run_id = r.run_id ";

void check_json_object(const std::string& s, const char* what) {
  json j;
  try {
    j = json::parse(s);
  } catch (const json::exception& e) {
    fail(Errc::invalid_argument, "runs.db: ", what, " is not valid JSON (", e.what(), "): ", s);
  }
  KVQ_CHECK(j.is_object(), Errc::invalid_argument, "runs.db: ", what, " must be a JSON object, got: ", s);
}

}  // namespace

const char* RunsDb::migration_sql(int from_version) {
  KVQ_CHECK(from_version >= 0 && from_version < kNumMigrations, Errc::invalid_argument, "runs.db: no migration from ",
            "schema version ", from_version);
  return kMigrations[from_version];
}

RunsDb::RunsDb(const std::string& path) : path_(path) {
  const int rc = sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr);
  if (rc != SQLITE_OK) {
    const std::string msg = db_ ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
    sqlite3_close(db_);
    db_ = nullptr;
    fail(Errc::io, "cannot open runs database '", path, "': ", msg, " (check the folder, or pass --home DIR)");
  }
  try {
    sqlite3_busy_timeout(db_, 10000);  // a concurrent writer (another sweep) holds the lock briefly
    exec("PRAGMA journal_mode=WAL");
    exec("PRAGMA foreign_keys=ON");
    migrate();
  } catch (...) {
    sqlite3_close(db_);
    db_ = nullptr;
    throw;
  }
}

RunsDb::~RunsDb() {
  if (db_) sqlite3_close(db_);
}

void RunsDb::exec(const char* sql) const {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    const std::string msg = err ? err : sqlite3_errmsg(db_);
    sqlite3_free(err);
    // A file that is not a database, or a locked one, is the user's to fix.
    fail(Errc::io, "runs database '", path_, "': ", msg);
  }
}

int RunsDb::schema_version() const {
  Stmt has(db_, "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'");
  has.step();
  if (has.integer(0) == 0) return 0;
  Stmt q(db_, "SELECT coalesce(max(version), 0) FROM schema_version");
  q.step();
  return int(q.integer(0));
}

void RunsDb::migrate() {
  transaction([&] {
    const int have = schema_version();
    if (have == 0) {
      // A fresh file, or someone else's database: refuse to add tables to the latter.
      Stmt q(db_, "SELECT count(*) FROM sqlite_master WHERE type = 'table'");
      q.step();
      KVQ_CHECK(q.integer(0) == 0, Errc::format, "'", path_,
                "' is an SQLite database but not a kvq runs.db (no schema_version table); use another --home");
    }
    KVQ_CHECK(have <= kSchemaVersion, Errc::format, "'", path_, "' has schema version ", have,
              ", newer than this kvq understands (", kSchemaVersion,
              "); use a newer kvq or another --home");
    for (int v = have; v < kSchemaVersion; ++v) {
      exec(kMigrations[v]);
      Stmt(db_, "INSERT INTO schema_version(version, applied_at) VALUES (?, ?)").bind(1, v + 1).bind(2, utc_now()).run();
    }
    for (const char* t : kAppendOnlyTables)
      for (const char* op : {"UPDATE", "DELETE"}) {
        const std::string sql = str("CREATE TRIGGER IF NOT EXISTS ", t, "_no_", op, " BEFORE ", op, " ON ", t,
                                    " BEGIN SELECT RAISE(ABORT, 'runs.db is append-only: ", op,
                                    " is not allowed'); END");
        exec(sql.c_str());
      }
  });
}

void RunsDb::transaction(const std::function<void()>& body) { in_transaction(body); }

void RunsDb::in_transaction(const std::function<void()>& body) {
  if (tx_depth_ > 0) {  // nested: part of the enclosing transaction
    body();
    return;
  }
  exec("BEGIN IMMEDIATE");
  ++tx_depth_;
  try {
    body();
    --tx_depth_;
    exec("COMMIT");
  } catch (...) {
    tx_depth_ = 0;
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    throw;
  }
}

int64_t RunsDb::begin_run(const RunMeta& m) {
  KVQ_CHECK(!m.kind.empty(), Errc::invalid_argument, "runs.db: a run needs a kind (\"bench\", \"eval\", ...)");
  check_json_object(m.params_json, "params_json");
  int64_t id = 0;
  in_transaction([&] {
    Stmt(db_,
         "INSERT INTO runs(kind, started_at, model, device, git_sha, build_type, kvq_version, host, gpu_name, "
         "driver, clocks, copy_bw_gbs, params_json) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)")
        .bind(1, m.kind)
        .bind(2, m.started_at.empty() ? utc_now() : m.started_at)
        .bind(3, m.model)
        .bind(4, m.device)
        .bind(5, m.git_sha)
        .bind(6, m.build_type)
        .bind(7, m.kvq_version)
        .bind(8, m.host)
        .bind(9, m.gpu_name)
        .bind(10, m.driver)
        .bind(11, m.clocks)
        .bind(12, m.copy_bw_gbs)
        .bind(13, m.params_json)
        .run();
    id = sqlite3_last_insert_rowid(db_);
  });
  return id;
}

void RunsDb::require_run(int64_t run_id) const {
  KVQ_CHECK(run(run_id).has_value(), Errc::invalid_argument, "runs.db: there is no run ", run_id,
            " (begin_run returns the id to use)");
}

void RunsDb::end_run(int64_t run_id, const std::string& status, const std::string& summary_json) {
  check_json_object(summary_json, "summary_json");
  const auto r = run(run_id);
  KVQ_CHECK(r.has_value(), Errc::invalid_argument, "runs.db: there is no run ", run_id);
  KVQ_CHECK(r->finished_at.empty(), Errc::invalid_argument, "runs.db: run ", run_id, " already ended (",
            r->status, " at ", r->finished_at, ")");
  in_transaction([&] {
    Stmt(db_, "INSERT INTO run_ends(run_id, finished_at, status, summary_json) VALUES (?,?,?,?)")
        .bind(1, run_id)
        .bind(2, utc_now())
        .bind(3, status)
        .bind(4, summary_json)
        .run();
  });
}

std::optional<RunRow> RunsDb::run(int64_t run_id) const {
  Stmt q(db_, (std::string(kRunSelect) + "WHERE r.run_id = ?").c_str());
  q.bind(1, run_id);
  if (!q.step()) return std::nullopt;
  return read_run(q);
}

std::vector<RunRow> RunsDb::runs(const std::string& kind) const {
  Stmt q(db_, (std::string(kRunSelect) + "WHERE ? = '' OR r.kind = ? ORDER BY r.run_id").c_str());
  q.bind(1, kind).bind(2, kind);
  std::vector<RunRow> out;
  while (q.step()) out.push_back(read_run(q));
  return out;
}

std::optional<int64_t> RunsDb::latest_run(const std::string& kind) const {
  Stmt q(db_, "SELECT max(run_id) FROM runs WHERE ? = '' OR kind = ?");
  q.bind(1, kind).bind(2, kind);
  q.step();
  if (q.is_null(0)) return std::nullopt;
  return q.integer(0);
}

void RunsDb::add_cell(int64_t run_id, const CellResult& c) {
  require_run(run_id);
  const bool m = c.measured();
  in_transaction([&] {
    Stmt q(db_,
           "INSERT INTO bench_cells(run_id, codec, ctx, gen, reps, status, error, flags, "
           "decode_tps, decode_tps_min, decode_tps_max, ttft_s, ttft_s_min, ttft_s_max, "
           "prefill_tps, prefill_tps_min, prefill_tps_max, itl_p50_ms, itl_p50_ms_min, itl_p50_ms_max, "
           "itl_p99_ms, itl_p99_ms_min, itl_p99_ms_max, kv_seq, kv_bytes, kv_mib, bits_per_value, "
           "kv_capacity_bytes, device_mem_delta, weight_bytes, step_bytes, achieved_gbs, pct_copy_bw, "
           "attn_kernels, kv_host_device_bytes, dispatch_json, digest, digests_agree, reps_json, prefill_n, "
           "prefills_json, batch, kv_pages, capacity) VALUES "
           "(?,?,?,?,?,?,?,?, ?,?,?,?,?,?, ?,?,?,?,?,?, ?,?,?,?,?,?,?, ?,?,?,?,?,?, ?,?,?,?,?,?, ?,?, ?,?,?)");
    // Columns in the order of the INSERT above; NULL for what an unmeasured cell lacks.
    int i = 0;
    auto put = [&](const auto& v) { q.bind(++i, v); };
    auto put_if = [&](bool present, const auto& v) {
      if (present)
        q.bind(++i, v);
      else
        q.bind_null(++i);
    };
    put(run_id);
    put(c.codec);
    put(c.ctx);
    put(c.gen);
    put(c.reps);
    put(c.status);
    put(c.error);
    put(join(c.flags, ","));
    for (const Spread* s : {&c.decode_tps, &c.ttft_s, &c.prefill_tps, &c.itl_p50_ms, &c.itl_p99_ms}) {
      put_if(m, s->median);
      put_if(m, s->min);
      put_if(m, s->max);
    }
    put_if(m, c.kv_seq);
    put_if(m, c.kv_bytes);
    put_if(m, double(c.kv_bytes) / (1024.0 * 1024.0));
    put_if(m, c.bits_per_value);
    put_if(m, c.kv_capacity_bytes);
    put_if(m && c.device_mem_delta >= 0, c.device_mem_delta);
    put_if(m, c.weight_bytes);
    put_if(m, c.step_bytes);
    put_if(m, c.achieved_gbs);
    put_if(m && c.pct_copy_bw > 0, c.pct_copy_bw);
    put(m ? dispatch_summary(c.dispatch) : std::string());
    put_if(m && c.dispatch.counted, c.dispatch.kv_host_to_device_bytes + c.dispatch.kv_device_to_host_bytes);
    put(dispatch_to_json(c.dispatch).dump());
    put(c.digest);
    put(c.digests_agree ? 1 : 0);
    put(reps_to_json(c.rep_results).dump());
    put_if(m, c.prefill_n);
    put(prefills_to_json(c.prefill_results).dump());
    put(c.batch);
    put(c.kv_pages);
    put(c.capacity ? 1 : 0);
    q.run();
  });
}

std::vector<CellResult> RunsDb::cells(int64_t run_id) const {
  Stmt q(db_,
         "SELECT codec, ctx, gen, reps, status, error, flags, "
         "decode_tps, decode_tps_min, decode_tps_max, ttft_s, ttft_s_min, ttft_s_max, "
         "prefill_tps, prefill_tps_min, prefill_tps_max, itl_p50_ms, itl_p50_ms_min, itl_p50_ms_max, "
         "itl_p99_ms, itl_p99_ms_min, itl_p99_ms_max, kv_seq, kv_bytes, bits_per_value, "
         "kv_capacity_bytes, device_mem_delta, weight_bytes, step_bytes, achieved_gbs, pct_copy_bw, "
         "dispatch_json, digest, digests_agree, reps_json, prefill_n, prefills_json, batch, kv_pages, capacity FROM bench_cells "
         "WHERE run_id = ? ORDER BY cell_id");
  q.bind(1, run_id);
  std::vector<CellResult> out;
  while (q.step()) {
    CellResult c;
    int i = 0;
    c.codec = q.text(i++);
    c.ctx = int(q.integer(i++));
    c.gen = int(q.integer(i++));
    c.reps = int(q.integer(i++));
    c.status = q.text(i++);
    c.error = q.text(i++);
    c.flags = split(q.text(i++), ',');
    for (Spread* s : {&c.decode_tps, &c.ttft_s, &c.prefill_tps, &c.itl_p50_ms, &c.itl_p99_ms}) {
      s->median = q.real(i++);
      s->min = q.real(i++);
      s->max = q.real(i++);
    }
    c.kv_seq = q.real(i++);
    c.kv_bytes = uint64_t(q.integer(i++));
    c.bits_per_value = q.real(i++);
    c.kv_capacity_bytes = uint64_t(q.integer(i++));
    c.device_mem_delta = q.is_null(i) ? -1 : q.integer(i);
    ++i;
    c.weight_bytes = uint64_t(q.integer(i++));
    c.step_bytes = q.real(i++);
    c.achieved_gbs = q.real(i++);
    c.pct_copy_bw = q.real(i++);
    c.dispatch = dispatch_from_json(json::parse(q.text(i++)));
    c.digest = q.text(i++);
    c.digests_agree = q.integer(i++) != 0;
    c.rep_results = reps_from_json(json::parse(q.text(i++)));
    // NULL: unmeasured, or written before schema 2, when TTFT came from the
    // measured runs' own prefills.
    c.prefill_n = q.is_null(i) ? (c.measured() ? c.reps : 0) : int(q.integer(i));
    ++i;
    c.prefill_results = prefills_from_json(json::parse(q.text(i++)));
    c.batch = int(q.integer(i++));
    c.kv_pages = int(q.integer(i++));
    c.capacity = q.integer(i++) != 0;
    out.push_back(std::move(c));
  }
  return out;
}

void RunsDb::add_fit(int64_t run_id, const ItlFit& f) {
  require_run(run_id);
  in_transaction([&] {
    Stmt(db_,
         "INSERT INTO bench_fits(run_id, codec, a_ms, b_ms_per_1k, residual_ms, n_points, ctx_min, ctx_max) "
         "VALUES (?,?,?,?,?,?,?,?)")
        .bind(1, run_id)
        .bind(2, f.codec)
        .bind(3, f.a_ms)
        .bind(4, f.b_ms_per_1k)
        .bind(5, f.residual_ms)
        .bind(6, f.n_points)
        .bind(7, f.ctx_min)
        .bind(8, f.ctx_max)
        .run();
  });
}

std::vector<ItlFit> RunsDb::fits(int64_t run_id) const {
  Stmt q(db_,
         "SELECT codec, a_ms, b_ms_per_1k, residual_ms, n_points, ctx_min, ctx_max FROM bench_fits "
         "WHERE run_id = ? ORDER BY rowid");
  q.bind(1, run_id);
  std::vector<ItlFit> out;
  while (q.step())
    out.push_back({q.text(0), q.real(1), q.real(2), q.real(3), int(q.integer(4)), int(q.integer(5)),
                   int(q.integer(6))});
  return out;
}

void RunsDb::add_serve_level(int64_t run_id, const ServeLevel& l) {
  require_run(run_id);
  check_json_object(l.errors_json, "errors_json");
  check_json_object(l.server_json, "server_json");
  const bool m = l.ok > 0;
  in_transaction([&] {
    Stmt q(db_,
           "INSERT INTO serve_levels(run_id, level, mode, concurrency, rate, requests, ok, failed, duration_s, "
           "req_per_s, out_tok_per_s, in_tok_per_s, prompt_tokens, output_tokens, ttft_mean_s, ttft_p50_s, "
           "ttft_p90_s, ttft_p99_s, tpot_p50_ms, tpot_p90_ms, tpot_p99_ms, itl_p50_ms, itl_p90_ms, itl_p99_ms, "
           "e2e_p50_s, e2e_p99_s, errors_json, disconnected, server_json) "
           "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)");
    int i = 0;
    auto put = [&](const auto& v) { q.bind(++i, v); };
    auto put_if = [&](bool present, double v) {
      if (present)
        q.bind(++i, v);
      else
        q.bind_null(++i);
    };
    put(run_id);
    put(l.level);
    put(l.mode);
    put(l.concurrency);
    put_if(l.mode == "rate", l.rate);
    put(l.requests);
    put(l.ok);
    put(l.failed);
    put(l.duration_s);
    put(l.req_per_s);
    put(l.out_tok_per_s);
    put(l.in_tok_per_s);
    put(l.prompt_tokens);
    put(l.output_tokens);
    put_if(m, l.ttft_mean_s);
    for (double v : {l.ttft_s.p50, l.ttft_s.p90, l.ttft_s.p99}) put_if(m, v);
    for (double v : {l.tpot_ms.p50, l.tpot_ms.p90, l.tpot_ms.p99}) put_if(m && l.has_tpot, v);
    for (double v : {l.itl_ms.p50, l.itl_ms.p90, l.itl_ms.p99}) put_if(m && l.has_itl, v);
    put_if(m, l.e2e_s.p50);
    put_if(m, l.e2e_s.p99);
    put(l.errors_json);
    put(l.disconnected);
    put(l.server_json);
    q.run();
  });
}

std::vector<ServeLevel> RunsDb::serve_levels(int64_t run_id) const {
  Stmt q(db_,
         "SELECT level, mode, concurrency, rate, requests, ok, failed, duration_s, req_per_s, out_tok_per_s, "
         "in_tok_per_s, prompt_tokens, output_tokens, ttft_mean_s, ttft_p50_s, ttft_p90_s, ttft_p99_s, "
         "tpot_p50_ms, tpot_p90_ms, tpot_p99_ms, itl_p50_ms, itl_p90_ms, itl_p99_ms, e2e_p50_s, e2e_p99_s, "
         "errors_json, disconnected, server_json FROM serve_levels WHERE run_id = ? ORDER BY level");
  q.bind(1, run_id);
  std::vector<ServeLevel> out;
  while (q.step()) {
    ServeLevel l;
    int i = 0;
    l.level = int(q.integer(i++));
    l.mode = q.text(i++);
    l.concurrency = int(q.integer(i++));
    l.rate = q.real(i++);
    l.requests = int(q.integer(i++));
    l.ok = int(q.integer(i++));
    l.failed = int(q.integer(i++));
    l.duration_s = q.real(i++);
    l.req_per_s = q.real(i++);
    l.out_tok_per_s = q.real(i++);
    l.in_tok_per_s = q.real(i++);
    l.prompt_tokens = q.integer(i++);
    l.output_tokens = q.integer(i++);
    l.ttft_mean_s = q.real(i++);
    for (double* v : {&l.ttft_s.p50, &l.ttft_s.p90, &l.ttft_s.p99}) *v = q.real(i++);
    l.has_tpot = !q.is_null(i);
    for (double* v : {&l.tpot_ms.p50, &l.tpot_ms.p90, &l.tpot_ms.p99}) *v = q.real(i++);
    l.has_itl = !q.is_null(i);
    for (double* v : {&l.itl_ms.p50, &l.itl_ms.p90, &l.itl_ms.p99}) *v = q.real(i++);
    l.e2e_s.p50 = q.real(i++);
    l.e2e_s.p99 = q.real(i++);
    l.errors_json = q.text(i++);
    l.disconnected = int(q.integer(i++));
    l.server_json = q.text(i++);
    out.push_back(std::move(l));
  }
  return out;
}

void RunsDb::add_eval_result(const EvalResult& r) {
  KVQ_CHECK(!r.codec.empty() && !r.metric.empty(), Errc::invalid_argument,
            "runs.db: an eval result needs a codec and a metric name");
  check_json_object(r.detail_json, "detail_json");
  require_run(r.run_id);
  in_transaction([&] {
    Stmt q(db_,
           "INSERT INTO eval_results(run_id, codec, metric, ctx, value, detail_json, created_at) "
           "VALUES (?,?,?,?,?,?,?)");
    q.bind(1, r.run_id).bind(2, r.codec).bind(3, r.metric);
    if (r.ctx) q.bind(4, *r.ctx); else q.bind_null(4);
    q.bind(5, r.value).bind(6, r.detail_json).bind(7, r.created_at.empty() ? utc_now() : r.created_at);
    q.run();
  });
}

std::vector<EvalResult> RunsDb::eval_results(int64_t run_id) const {
  Stmt q(db_,
         "SELECT run_id, codec, metric, ctx, value, detail_json, created_at FROM eval_results WHERE run_id = ? "
         "ORDER BY result_id");
  q.bind(1, run_id);
  std::vector<EvalResult> out;
  while (q.step()) {
    EvalResult r;
    r.run_id = q.integer(0);
    r.codec = q.text(1);
    r.metric = q.text(2);
    if (!q.is_null(3)) r.ctx = q.integer(3);
    r.value = q.real(4);
    r.detail_json = q.text(5);
    r.created_at = q.text(6);
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace kvq::bench

// kvq info: what is in a GGUF file: version, architecture, the ModelConfig,
// tensors by type, tokenizer summary. Prints what it can for non-model files.
#include <cstdarg>
#include "core/text.hpp"
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>

#include "cli/command.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"
#include "gguf/gguf.hpp"
#include "model/config.hpp"

namespace {

using kvq::gguf::File;
using kvq::gguf::Value;
using nlohmann::json;

const char* scaling_name(kvq::RopeScaling s) {
  switch (s) {
    case kvq::RopeScaling::none: return "none";
    case kvq::RopeScaling::linear: return "linear";
    case kvq::RopeScaling::yarn: return "yarn";
    case kvq::RopeScaling::llama3: return "llama3";
  }
  return "?";
}

json config_json(const kvq::ModelConfig& c) {
  return json{{"arch", kvq::arch_name(c.arch)},
              {"name", c.name},
              {"n_layers", c.n_layers},
              {"d_model", c.d_model},
              {"d_ff", c.d_ff},
              {"n_heads", c.n_heads},
              {"n_kv_heads", c.n_kv_heads},
              {"gqa_ratio", c.gqa_ratio()},
              {"head_dim", c.head_dim},
              {"head_dim_v", c.head_dim_v},
              {"vocab_size", c.vocab_size},
              {"context_length", c.context_length},
              {"norm_eps", c.norm_eps},
              {"rope",
               {{"theta", c.rope.theta},
                {"scaling", scaling_name(c.rope.scaling)},
                {"factor", c.rope.factor},
                {"original_context", c.rope.original_context},
                {"style", c.rope.neox ? "neox" : "normal"}}},
              {"qk_norm", c.qk_norm},
              {"tied_embeddings", c.tied_embeddings},
              {"kv_bytes_per_token_bf16", c.kv_bytes_per_token_bf16()}};
}

// Text of a token id for display: the stored piece, or null when out of range.
json token_json(const File& f, const char* id_key) {
  const Value* id = f.find(id_key);
  if (!id || !id->is_integer()) return nullptr;
  json j{{"id", id->as_i64()}};
  const Value* toks = f.find("tokenizer.ggml.tokens");
  if (toks && toks->type == kvq::gguf::ValueType::ARRAY) {
    const auto& items = toks->as_array().items;
    const int64_t i = id->as_i64();
    if (i >= 0 && i < int64_t(items.size()) && items[size_t(i)].type == kvq::gguf::ValueType::STRING)
      j["piece"] = items[size_t(i)].as_string();
  }
  return j;
}

size_t array_len(const File& f, const char* key) {
  const Value* v = f.find(key);
  return v && v->type == kvq::gguf::ValueType::ARRAY ? v->as_array().items.size() : 0;
}

json tokenizer_json(const File& f) {
  if (!f.has("tokenizer.ggml.model")) return nullptr;
  json t;
  t["model"] = f.get_string_or("tokenizer.ggml.model", "");
  t["pre"] = f.get_string_or("tokenizer.ggml.pre", "");
  t["tokens"] = array_len(f, "tokenizer.ggml.tokens");
  t["merges"] = array_len(f, "tokenizer.ggml.merges");
  t["bos"] = token_json(f, "tokenizer.ggml.bos_token_id");
  t["eos"] = token_json(f, "tokenizer.ggml.eos_token_id");
  t["eot"] = token_json(f, "tokenizer.ggml.eot_token_id");
  t["add_bos_token"] = f.get_bool_or("tokenizer.ggml.add_bos_token", false);
  const std::string tmpl = f.get_string_or("tokenizer.chat_template", "");
  t["chat_template"] = !tmpl.empty();
  t["chat_template_first_line"] = tmpl.substr(0, tmpl.find('\n'));
  return t;
}

std::string human_bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double x = double(b);
  int u = 0;
  while (x >= 1024 && u < 4) {
    x /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", x, units[u]);
  return buf;
}

std::string token_text(const json& t) {
  if (t.is_null()) return "-";
  std::string s = std::to_string(t["id"].get<int64_t>());
  if (t.contains("piece")) s += " '" + t["piece"].get<std::string>() + "'";
  return s;
}

// Text output: metadata strings come from the file, so every control byte
// in what is printed (an ESC sequence in general.name) is escaped.
[[gnu::format(printf, 1, 2)]] void tprintf(const char* fmt, ...) {
  va_list ap, ap2;
  va_start(ap, fmt);
  va_copy(ap2, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string buf(size_t(n > 0 ? n : 0) + 1, '\0');
  std::vsnprintf(buf.data(), buf.size(), fmt, ap2);
  va_end(ap2);
  buf.pop_back();
  const std::string out = kvq::printable(buf, true);
  std::fwrite(out.data(), 1, out.size(), stdout);
}

void print_text(const File& f, const json& j, bool show_keys) {
  tprintf("file:          %s\n", f.path().c_str());
  tprintf("format:        GGUF v%u, alignment %llu, %llu bytes (%s), %zu metadata keys\n", f.version(),
              (unsigned long long)f.alignment(), (unsigned long long)f.file_size(),
              human_bytes(f.file_size()).c_str(), f.metadata().size());
  tprintf("architecture:  %s\n", j["architecture"].is_null() ? "(missing: general.architecture not set)"
                                                                   : j["architecture"].get<std::string>().c_str());
  if (!j["config"].is_null()) {
    const json& c = j["config"];
    tprintf("name:          %s\n", c["name"].get<std::string>().c_str());
    tprintf("layers:        %d\n", c["n_layers"].get<int>());
    tprintf("d_model:       %d\n", c["d_model"].get<int>());
    tprintf("d_ff:          %d\n", c["d_ff"].get<int>());
    tprintf("heads:         %d query, %d KV (GQA %d), head_dim %d (v %d)\n", c["n_heads"].get<int>(),
                c["n_kv_heads"].get<int>(), c["gqa_ratio"].get<int>(), c["head_dim"].get<int>(),
                c["head_dim_v"].get<int>());
    tprintf("vocab:         %d\n", c["vocab_size"].get<int>());
    tprintf("context:       %llu\n", (unsigned long long)c["context_length"].get<uint64_t>());
    tprintf("norm eps:      %g\n", c["norm_eps"].get<double>());
    const json& r = c["rope"];
    tprintf("rope:          %s, theta %g, scaling %s", r["style"].get<std::string>().c_str(),
                r["theta"].get<double>(), r["scaling"].get<std::string>().c_str());
    if (r["scaling"] != "none")
      tprintf(" x%g (original context %llu)", r["factor"].get<double>(),
                  (unsigned long long)r["original_context"].get<uint64_t>());
    tprintf("\n");
    tprintf("q/k norm:      %s\n", c["qk_norm"].get<bool>() ? "yes" : "no");
    tprintf("embeddings:    %s\n", c["tied_embeddings"].get<bool>() ? "tied (no output.weight)" : "untied");
    tprintf("KV bf16/token: %llu bytes\n", (unsigned long long)c["kv_bytes_per_token_bf16"].get<uint64_t>());
  } else if (j.contains("config_error")) {
    tprintf("config:        not available: %s\n", j["config_error"].get<std::string>().c_str());
  }
  const json& t = j["tensors"];
  tprintf("tensors:       %llu, %llu bytes (%s)\n", (unsigned long long)t["count"].get<uint64_t>(),
              (unsigned long long)t["bytes"].get<uint64_t>(), human_bytes(t["bytes"].get<uint64_t>()).c_str());
  for (const auto& [type, e] : t["by_type"].items())
    tprintf("  %-6s %6llu tensors %14llu bytes (%s)\n", type.c_str(), (unsigned long long)e["count"].get<uint64_t>(),
                (unsigned long long)e["bytes"].get<uint64_t>(), human_bytes(e["bytes"].get<uint64_t>()).c_str());
  const json& tok = j["tokenizer"];
  if (tok.is_null()) {
    tprintf("tokenizer:     (missing: tokenizer.ggml.model not set)\n");
  } else if (tok.contains("error")) {
    tprintf("tokenizer:     unreadable: %s\n", tok["error"].get<std::string>().c_str());
  } else {
    tprintf("tokenizer:     %s, pre '%s', %zu tokens, %zu merges\n", tok["model"].get<std::string>().c_str(),
                tok["pre"].get<std::string>().c_str(), tok["tokens"].get<size_t>(), tok["merges"].get<size_t>());
    tprintf("  bos %s, eos %s, eot %s, add_bos %s\n", token_text(tok["bos"]).c_str(),
                token_text(tok["eos"]).c_str(), token_text(tok["eot"]).c_str(),
                tok["add_bos_token"].get<bool>() ? "yes" : "no");
    if (tok["chat_template"].get<bool>())
      tprintf("  chat template: yes, first line: %s\n", tok["chat_template_first_line"].get<std::string>().c_str());
    else
      tprintf("  chat template: none\n");
  }
  if (show_keys) {
    tprintf("metadata:\n");
    for (const auto& [k, v] : f.metadata()) tprintf("  %s = %s\n", k.c_str(), v.to_string().c_str());
  }
}

std::function<int()> setup(CLI::App& sub) {
  auto path = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  auto keys = std::make_shared<bool>(false);
  sub.add_option("-m,--model", *path, "GGUF file (default: $KVQ_MODEL or the embedded models/kvq-tiny-code.gguf)");
  sub.add_flag("--json", *as_json, "Print JSON");
  sub.add_flag("--keys", *keys, "Also list every metadata key (arrays truncated)");
  return [path, as_json, keys]() {
    const File f = File::open(path->empty() ? kvq::cli::resolve_model_path("") : *path);
    json j;
    j["file"] = f.path();
    j["version"] = f.version();
    j["alignment"] = f.alignment();
    j["file_size"] = f.file_size();
    j["metadata_keys"] = f.metadata().size();
    const Value* arch = f.find("general.architecture");
    j["architecture"] = arch && arch->type == kvq::gguf::ValueType::STRING ? json(arch->as_string()) : json(nullptr);
    j["config"] = nullptr;
    int status = 0;
    if (!arch) {
      j["config_error"] = "general.architecture is missing: not a model file";
    } else {
      try {
        j["config"] = config_json(kvq::ModelConfig::from_gguf(f));
      } catch (const kvq::Error& e) {
        // A file that claims to be a model but would not load: report, and fail.
        j["config_error"] = e.what();
        status = 1;
      }
    }
    std::map<std::string, std::pair<uint64_t, uint64_t>> by_type;
    uint64_t total = 0;
    for (const auto& t : f.tensors()) {
      auto& e = by_type[kvq::gguf::tensor_type_name(t.type)];
      e.first += 1;
      e.second += t.n_bytes;
      total += t.n_bytes;
    }
    json bt = json::object();
    for (const auto& [name, e] : by_type) bt[name] = {{"count", e.first}, {"bytes", e.second}};
    j["tensors"] = {{"count", f.tensors().size()}, {"bytes", total}, {"by_type", bt}};
    try {
      j["tokenizer"] = tokenizer_json(f);
    } catch (const kvq::Error& e) {
      j["tokenizer"] = {{"error", e.what()}};  // e.g. a key of the wrong type: report, keep going
    }
    if (*as_json) {
      if (*keys) {
        json m = json::object();
        for (const auto& [k, v] : f.metadata()) m[k] = v.to_string();
        j["metadata"] = m;
      }
      std::printf("%s\n", j.dump(2, ' ', false, json::error_handler_t::replace).c_str());
    } else {
      print_text(f, j, *keys);
    }
    if (status != 0)
      kvq::fail(kvq::Errc::format, j["config_error"].get<std::string>());
    return 0;
  };
}

}  // namespace

KVQ_REGISTER_COMMAND("info", "Show a GGUF file's architecture, config, tensors and tokenizer", setup);

#include "tokenizer/hf_import.hpp"

#include <algorithm>
#include <climits>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/file_io.hpp"
#include "tokenizer/pretokenizer.hpp"
#include "tokenizer/unicode.hpp"

namespace kvq {
namespace {

using json = nlohmann::json;

// Nesting deeper than this is refused before parsing: real tokenizer.json files
// nest about 5 levels, and the walks below recurse once per level.
constexpr int kMaxJsonDepth = 64;

// The deepest [ / { nesting of a JSON text, scanning strings correctly; stops
// early once past `limit`. Linear and without recursion.
int json_depth(std::string_view s, int limit) {
  int depth = 0, max_depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '[' || c == '{') {
      max_depth = std::max(max_depth, ++depth);
      if (max_depth > limit) return max_depth;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return max_depth;
}

// nlohmann's messages start with "[json.exception.parse_error.101] "; keep what follows.
std::string json_message(const json::exception& e) {
  std::string m = e.what();
  if (m.rfind("[json.exception.", 0) == 0) {
    const size_t close = m.find("] ");
    if (close != std::string::npos) m.erase(0, close + 2);
  }
  return m;
}

json parse_json(std::string_view text, const std::string& name) {
  const int depth = json_depth(text, kMaxJsonDepth);
  KVQ_CHECK(depth <= kMaxJsonDepth, Errc::format, "'", name, "' nests JSON more than ", kMaxJsonDepth,
            " levels deep; a tokenizer file nests about 5 (is it the file you meant?)");
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(Errc::format, "'", name, "' is not valid JSON: ", json_message(e));
  }
}

// A short, printable excerpt of a JSON value for messages.
std::string excerpt(const json& v) {
  std::string s = v.dump(-1, ' ', true, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

const char* json_type(const json& v) { return v.type_name(); }

// Collects the Split regexes of a pre_tokenizer (possibly nested in a Sequence).
void find_split_regexes(const json& pt, std::vector<std::string>& out) {
  if (!pt.is_object()) return;
  const json* type = pt.contains("type") ? &pt["type"] : nullptr;
  if (!type || !type->is_string()) return;
  if (*type == "Sequence" && pt.contains("pretokenizers") && pt["pretokenizers"].is_array()) {
    for (const auto& p : pt["pretokenizers"]) find_split_regexes(p, out);
  } else if (*type == "Split" && pt.contains("pattern") && pt["pattern"].is_object() &&
             pt["pattern"].contains("Regex") && pt["pattern"]["Regex"].is_string()) {
    out.push_back(pt["pattern"]["Regex"].get<std::string>());
  }
}

bool looks_special(const std::string& t) {
  return t.size() >= 4 && t.compare(0, 2, "<|") == 0 && t.compare(t.size() - 2, 2, "|>") == 0;
}

// Whether the post-processor's single-sequence template starts with a special token.
bool post_processor_adds_bos(const json& pp, const std::string& bos_text) {
  if (!pp.is_object() || !pp.contains("type") || !pp["type"].is_string()) return false;
  const std::string type = pp["type"].get<std::string>();
  if (type == "Sequence" && pp.contains("processors") && pp["processors"].is_array()) {
    for (const auto& p : pp["processors"])
      if (post_processor_adds_bos(p, bos_text)) return true;
    return false;
  }
  if (type != "TemplateProcessing" || !pp.contains("single") || !pp["single"].is_array() || pp["single"].empty())
    return false;
  const json& first = pp["single"][0];
  if (!first.is_object() || !first.contains("SpecialToken") || !first["SpecialToken"].is_object()) return false;
  const json& st = first["SpecialToken"];
  return st.contains("id") && st["id"].is_string() && st["id"].get<std::string>() == bos_text;
}

// A token id from the file: an integer in [0, kMaxTokenizerVocab).
int64_t token_id(const json& v, const std::string& name, const std::string& where) {
  if (!v.is_number_integer())
    fail(Errc::format, "'", name, "': ", where, " has id ", excerpt(v), " (a ", json_type(v),
         "); token ids are integers");
  const int64_t id = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX) ? INT64_MAX : v.get<int64_t>();
  if (id < 0 || id >= kMaxTokenizerVocab)
    fail(Errc::format, "'", name, "': ", where, " has id ", id, ", outside [0, ", kMaxTokenizerVocab,
         "), the ids kvq accepts");
  return id;
}

}  // namespace

void pad_vocab(TokenizerData& d, int vocab_size) {
  KVQ_CHECK(vocab_size >= int(d.tokens.size()), Errc::invalid_argument, "cannot pad a vocabulary of ",
            d.tokens.size(), " tokens down to ", vocab_size, "; the model's vocabulary must be at least as large");
  if (d.types.empty()) d.types.assign(d.tokens.size(), int32_t(TokenType::normal));
  for (int i = int(d.tokens.size()); i < vocab_size; ++i) {
    d.tokens.push_back(str("[PAD", i, "]"));
    d.types.push_back(int32_t(TokenType::unused));
  }
}

TokenizerData parse_hf_tokenizer(std::string_view text, const std::string& path, const std::string* config_text,
                                 const std::string& config_name) {
  const json j = parse_json(text, path);
  auto bad = [&](const std::string& what) { fail(Errc::format, "'", path, "': ", what); };

  if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
    bad("no \"model\" object; is this a tokenizer.json?");
  const json& model = j["model"];
  const std::string mtype = model.contains("type") && model["type"].is_string() ? model["type"].get<std::string>() : "";
  KVQ_CHECK(mtype == "BPE", Errc::unsupported, "'", path, "': tokenizer model type '", utf8::escape(mtype),
            "' is not supported; kvq supports byte-level BPE tokenizers (Qwen2/3, Llama 3)");
  if (!model.contains("vocab") || !model["vocab"].is_object()) bad("model.vocab is missing or not an object");
  if (!model.contains("merges") || !model["merges"].is_array()) bad("model.merges is missing or not an array");
  auto flag = [&](const json& obj, const char* key, const char* where) {
    if (!obj.contains(key) || obj[key].is_null()) return false;
    if (!obj[key].is_boolean()) bad(str(where, key, " is ", excerpt(obj[key]), "; it must be true or false"));
    return obj[key].get<bool>();
  };

  TokenizerData d;
  d.model = "gpt2";

  // Pre-tokenizer: recognised by its regex, then the normalizer and merge mode
  // must be the ones that family uses.
  std::vector<std::string> regexes;
  if (j.contains("pre_tokenizer")) find_split_regexes(j["pre_tokenizer"], regexes);
  for (const auto& r : regexes) {
    d.pre = PreTokenizer::name_for_pattern(r);
    if (!d.pre.empty()) break;
  }
  if (d.pre.empty()) {
    std::string known;
    for (const auto& n : PreTokenizer::names()) known += (known.empty() ? "" : ", ") + n;
    fail(Errc::unsupported, "'", path, "': pre-tokenizer ",
         regexes.empty() ? std::string("has no Split regex")
                         : "regex '" + utf8::escape(regexes[0].substr(0, 80)) + "' is not one kvq knows",
         "; supported: ", known);
  }
  const PreTokenizer pre(d.pre);
  // The normalizer is whatever the file states (null: none), recorded so that
  // a GGUF made from it normalizes the same way.
  const json norm = j.contains("normalizer") ? j["normalizer"] : json();
  if (norm.is_null()) {
    d.normalizer = kNormalizerNone;
  } else if (norm.is_object() && norm.contains("type") && norm["type"] == "NFC") {
    d.normalizer = kNormalizerNfc;
  } else {
    fail(Errc::unsupported, "'", path, "': normalizer ", excerpt(norm),
         " is not supported; kvq supports null (none) and {\"type\": \"NFC\"}");
  }
  const bool ignore_merges = flag(model, "ignore_merges", "model.");
  KVQ_CHECK(ignore_merges == pre.ignore_merges(), Errc::unsupported, "'", path, "': model.ignore_merges = ",
            ignore_merges ? "true" : "false", " does not match the '", d.pre, "' pre-tokenizer");
  KVQ_CHECK(!flag(model, "byte_fallback", "model."), Errc::unsupported, "'", path,
            "': byte_fallback BPE (SentencePiece-style) is not supported");

  // Vocabulary and added tokens, placed by id. Ids are checked before
  // anything is allocated for them.
  struct Added {
    int64_t id;
    std::string content;
    bool special;
  };
  std::vector<Added> added;
  int64_t max_id = -1;
  size_t entries = 0;
  for (const auto& [tok_text, id] : model["vocab"].items()) {
    max_id = std::max(max_id, token_id(id, path, str("vocabulary entry '", utf8::escape(tok_text.substr(0, 40)), "'")));
    ++entries;
  }
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    const json& at = j["added_tokens"];
    if (!at.is_array()) bad(str("added_tokens is a ", json_type(at), "; it must be an array"));
    for (size_t k = 0; k < at.size(); ++k) {
      const json& a = at[k];
      const std::string where = str("added_tokens[", k, "]");
      if (!a.is_object()) bad(str(where, " is a ", json_type(a), "; it must be an object"));
      if (!a.contains("id")) bad(str(where, " has no \"id\""));
      if (!a.contains("content") || !a["content"].is_string())
        bad(str(where, " has no string \"content\""));
      Added ad{token_id(a["id"], path, where), a["content"].get<std::string>(), flag(a, "special", (where + ".").c_str())};
      KVQ_CHECK(!ad.content.empty(), Errc::format, "'", path, "': ", where, " has empty content");
      max_id = std::max(max_id, ad.id);
      added.push_back(std::move(ad));
      ++entries;
    }
  }
  if (max_id < 0) bad("the vocabulary is empty");
  // Ids must be (nearly) dense: a lone huge id would otherwise make kvq
  // allocate an entry for every id below it.
  KVQ_CHECK(uint64_t(max_id) < 2 * uint64_t(entries) + 1024, Errc::format, "'", path, "': token id ", max_id,
            " is far beyond the ", entries, " tokens the file defines (ids must be dense from 0)");
  const size_t n = size_t(max_id + 1);
  d.tokens.assign(n, std::string());
  d.types.assign(n, -1);
  for (const auto& [tok_text, id] : model["vocab"].items()) {
    const int64_t i = id.get<int64_t>();
    if (d.types[i] >= 0)
      bad(str("vocabulary entries '", utf8::escape(d.tokens[i].substr(0, 40)), "' and '",
              utf8::escape(tok_text.substr(0, 40)), "' have the same id ", i));
    d.tokens[i] = tok_text;
    d.types[i] = int32_t(TokenType::normal);
  }
  for (const Added& a : added) {
    d.tokens[a.id] = a.content;
    d.types[a.id] = int32_t(a.special || looks_special(a.content) ? TokenType::control : TokenType::user_defined);
  }
  for (size_t i = 0; i < n; ++i) {
    if (d.types[i] < 0) {
      d.tokens[i] = str("[PAD", i, "]");
      d.types[i] = int32_t(TokenType::unused);
    }
  }

  const json& merges = model["merges"];
  d.merges.reserve(merges.size());
  for (size_t k = 0; k < merges.size(); ++k) {
    const json& m = merges[k];
    if (m.is_string()) {
      d.merges.push_back(m.get<std::string>());
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {  // ["left", "right"]
      d.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
    } else {
      bad(str("model.merges[", k, "] = ", excerpt(m), " is neither \"a b\" nor [\"a\", \"b\"]"));
    }
  }

  // Special ids and the chat template from tokenizer_config.json when present.
  json cfg = json::object();
  if (config_text) {
    cfg = parse_json(*config_text, config_name);
    if (!cfg.is_object()) fail(Errc::format, "'", config_name, "' is a JSON ", json_type(cfg), ", not an object");
  }
  auto cfg_bad = [&](const std::string& what) { fail(Errc::format, "'", config_name, "': ", what); };
  // tokenizer_config.json names special tokens as a string or as {"content": "..."}
  // (null or absent: none); anything else is an error, not silently ignored.
  auto token_text = [&](const char* key) -> std::string {
    if (!cfg.contains(key) || cfg[key].is_null()) return {};
    const json& v = cfg[key];
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
    fail(Errc::format, "'", config_name, "': ", key, " is ", excerpt(v),
         "; it must be a token's text or {\"content\": TEXT}");
  };
  auto id_of = [&](const std::string& t) -> int32_t {
    if (t.empty()) return -1;
    for (size_t i = 0; i < n; ++i)
      if (d.tokens[i] == t && d.types[i] != int32_t(TokenType::normal)) return int32_t(i);
    for (size_t i = 0; i < n; ++i)
      if (d.tokens[i] == t) return int32_t(i);
    return -1;
  };
  auto configured = [&](const char* key) -> int32_t {
    const std::string t = token_text(key);
    const int32_t id = id_of(t);
    if (!t.empty() && id < 0)
      cfg_bad(str(key, " '", utf8::escape(t.substr(0, 40)), "' is not a token of '", path, "'"));
    return id;
  };
  auto first_of = [&](std::initializer_list<const char*> texts) -> int32_t {
    for (const char* t : texts)
      if (int32_t id = id_of(t); id >= 0) return id;
    return -1;
  };
  d.bos = configured("bos_token");
  // Qwen's config has no bos; its GGUF conversions use <|endoftext|> (never added).
  if (d.bos < 0) d.bos = first_of({"<|begin_of_text|>", "<|endoftext|>"});
  d.eos = configured("eos_token");
  if (d.eos < 0) d.eos = first_of({"<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"});
  d.eot = first_of({"<|im_end|>", "<|eot_id|>"});
  d.pad = configured("pad_token");
  if (cfg.contains("add_bos_token") && !cfg["add_bos_token"].is_null()) {
    if (!cfg["add_bos_token"].is_boolean()) cfg_bad("add_bos_token must be true or false");
    d.add_bos = cfg["add_bos_token"].get<bool>();
  } else {
    const std::string bos_text = d.bos >= 0 ? d.tokens[d.bos] : std::string();
    d.add_bos = post_processor_adds_bos(j.contains("post_processor") ? j["post_processor"] : json(), bos_text) ||
                d.pre == "llama-bpe";
  }
  if (cfg.contains("chat_template") && !cfg["chat_template"].is_null()) {
    const json& ct = cfg["chat_template"];
    if (ct.is_string()) {
      d.chat_template = ct.get<std::string>();
    } else if (ct.is_array()) {  // [{"name": "default", "template": ...}, ...]
      for (const auto& e : ct) {
        if (!e.is_object() || !e.contains("name") || !e.contains("template") || !e["template"].is_string())
          cfg_bad("chat_template entries must be {\"name\": ..., \"template\": TEXT}");
        if (e["name"] == "default") d.chat_template = e["template"].get<std::string>();
      }
    } else {
      cfg_bad(str("chat_template is a ", json_type(ct), "; it must be a string or a list of named templates"));
    }
  }
  return d;
}

TokenizerData load_hf_tokenizer(const std::string& path) {
  const std::string text = read_file_bounded(path, kMaxTokenizerJsonBytes, "tokenizer file");
  const auto cfg_path = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (path != "-" && std::filesystem::is_regular_file(cfg_path, ec)) {
    const std::string cfg = read_file_bounded(cfg_path.string(), kMaxTokenizerJsonBytes, "tokenizer config");
    return parse_hf_tokenizer(text, path, &cfg, cfg_path.string());
  }
  return parse_hf_tokenizer(text, path, nullptr, "");
}

}  // namespace kvq

#include "tokenizer/hf_import.hpp"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.hpp"
#include "tokenizer/pretokenizer.hpp"

namespace kvq {
namespace {

using json = nlohmann::json;

json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(Errc::io, "cannot open '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {
    fail(Errc::format, "'", path, "' is not valid JSON: ", e.what());
  }
}

// Collects the Split regexes of a pre_tokenizer (possibly nested in a Sequence).
void find_split_regexes(const json& pt, std::vector<std::string>& out) {
  if (!pt.is_object()) return;
  const std::string type = pt.value("type", "");
  if (type == "Sequence" && pt.contains("pretokenizers")) {
    for (const auto& p : pt["pretokenizers"]) find_split_regexes(p, out);
  } else if (type == "Split" && pt.contains("pattern") && pt["pattern"].contains("Regex")) {
    out.push_back(pt["pattern"]["Regex"].get<std::string>());
  }
}

// tokenizer_config.json stores special tokens as a string or as {"content": ...}.
std::string token_text(const json& cfg, const char* key) {
  if (!cfg.contains(key)) return {};
  const json& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return {};
}

bool looks_special(const std::string& t) {
  return t.size() >= 4 && t.compare(0, 2, "<|") == 0 && t.compare(t.size() - 2, 2, "|>") == 0;
}

// Whether the post-processor's single-sequence template starts with a special token.
bool post_processor_adds_bos(const json& pp, const std::string& bos_text) {
  if (!pp.is_object()) return false;
  const std::string type = pp.value("type", "");
  if (type == "Sequence" && pp.contains("processors")) {
    for (const auto& p : pp["processors"])
      if (post_processor_adds_bos(p, bos_text)) return true;
    return false;
  }
  if (type != "TemplateProcessing" || !pp.contains("single") || pp["single"].empty()) return false;
  const json& first = pp["single"][0];
  return first.contains("SpecialToken") && first["SpecialToken"].value("id", "") == bos_text;
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

TokenizerData load_hf_tokenizer(const std::string& path) {
  const json j = read_json(path);
  auto bad = [&](const std::string& what) { fail(Errc::format, "'", path, "': ", what); };

  if (!j.contains("model") || !j["model"].is_object()) bad("no \"model\" object; is this a tokenizer.json?");
  const json& model = j["model"];
  const std::string mtype = model.value("type", "");
  KVQ_CHECK(mtype == "BPE", Errc::unsupported, "'", path, "': tokenizer model type '", mtype,
            "' is not supported; kvq supports byte-level BPE tokenizers (Qwen2/3, Llama 3)");
  if (!model.contains("vocab") || !model["vocab"].is_object()) bad("model.vocab is missing");
  if (!model.contains("merges") || !model["merges"].is_array()) bad("model.merges is missing");

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
         regexes.empty() ? std::string("has no Split regex") : "regex '" + regexes[0] + "' is not one kvq knows",
         "; supported: ", known);
  }
  const PreTokenizer pre(d.pre);
  // The normalizer is whatever the file states (null: none), recorded so that
  // a GGUF made from it normalizes the same way.
  const json norm = j.value("normalizer", json());
  if (norm.is_null()) {
    d.normalizer = kNormalizerNone;
  } else if (norm.is_object() && norm.value("type", "") == "NFC") {
    d.normalizer = kNormalizerNfc;
  } else {
    fail(Errc::unsupported, "'", path, "': normalizer ", norm.dump(),
         " is not supported; kvq supports null (none) and {\"type\": \"NFC\"}");
  }
  const bool ignore_merges = model.value("ignore_merges", false);
  KVQ_CHECK(ignore_merges == pre.ignore_merges(), Errc::unsupported, "'", path, "': model.ignore_merges = ",
            ignore_merges ? "true" : "false", " does not match the '", d.pre, "' pre-tokenizer");
  KVQ_CHECK(!model.value("byte_fallback", false), Errc::unsupported, "'", path,
            "': byte_fallback BPE (SentencePiece-style) is not supported");

  // Vocabulary and added tokens, placed by id.
  int64_t max_id = -1;
  for (const auto& [text, id] : model["vocab"].items()) max_id = std::max<int64_t>(max_id, id.get<int64_t>());
  const json added = j.value("added_tokens", json::array());
  for (const auto& a : added) max_id = std::max<int64_t>(max_id, a.at("id").get<int64_t>());
  KVQ_CHECK(max_id >= 0 && max_id < INT32_MAX, Errc::format, "'", path, "': bad token ids (max ", max_id, ")");
  const size_t n = size_t(max_id + 1);
  d.tokens.assign(n, std::string());
  d.types.assign(n, -1);
  for (const auto& [text, id] : model["vocab"].items()) {
    const int64_t i = id.get<int64_t>();
    if (i < 0) bad(str("negative id for vocabulary entry '", text, "'"));
    d.tokens[i] = text;
    d.types[i] = int32_t(TokenType::normal);
  }
  for (const auto& a : added) {
    const int64_t i = a.at("id").get<int64_t>();
    const std::string content = a.at("content").get<std::string>();
    d.tokens[i] = content;
    d.types[i] = int32_t(a.value("special", false) || looks_special(content) ? TokenType::control
                                                                             : TokenType::user_defined);
  }
  for (size_t i = 0; i < n; ++i) {
    if (d.types[i] < 0) {
      d.tokens[i] = str("[PAD", i, "]");
      d.types[i] = int32_t(TokenType::unused);
    }
  }

  d.merges.reserve(model["merges"].size());
  for (const auto& m : model["merges"]) {
    if (m.is_string()) {
      d.merges.push_back(m.get<std::string>());
    } else if (m.is_array() && m.size() == 2) {  // newer format: ["left", "right"]
      d.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
    } else {
      bad(str("merge entry ", m.dump(), " is neither \"a b\" nor [\"a\", \"b\"]"));
    }
  }

  // Special ids and the chat template from tokenizer_config.json when present.
  json cfg = json::object();
  const auto cfg_path = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  if (std::filesystem::exists(cfg_path)) cfg = read_json(cfg_path.string());
  auto id_of = [&](const std::string& text) -> int32_t {
    if (text.empty()) return -1;
    for (size_t i = 0; i < n; ++i)
      if (d.tokens[i] == text && d.types[i] != int32_t(TokenType::normal)) return int32_t(i);
    for (size_t i = 0; i < n; ++i)
      if (d.tokens[i] == text) return int32_t(i);
    return -1;
  };
  auto first_of = [&](std::initializer_list<const char*> texts) -> int32_t {
    for (const char* t : texts)
      if (int32_t id = id_of(t); id >= 0) return id;
    return -1;
  };
  d.bos = id_of(token_text(cfg, "bos_token"));
  // Qwen's config has no bos; its GGUF conversions use <|endoftext|> (never added).
  if (d.bos < 0) d.bos = first_of({"<|begin_of_text|>", "<|endoftext|>"});
  d.eos = id_of(token_text(cfg, "eos_token"));
  if (d.eos < 0) d.eos = first_of({"<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"});
  d.eot = first_of({"<|im_end|>", "<|eot_id|>"});
  d.pad = id_of(token_text(cfg, "pad_token"));
  if (cfg.contains("add_bos_token") && cfg["add_bos_token"].is_boolean()) {
    d.add_bos = cfg["add_bos_token"].get<bool>();
  } else {
    const std::string bos_text = d.bos >= 0 ? d.tokens[d.bos] : std::string();
    d.add_bos = post_processor_adds_bos(j.value("post_processor", json()), bos_text) || d.pre == "llama-bpe";
  }
  if (cfg.contains("chat_template")) {
    const json& ct = cfg["chat_template"];
    if (ct.is_string()) {
      d.chat_template = ct.get<std::string>();
    } else if (ct.is_array()) {  // [{"name": "default", "template": ...}, ...]
      for (const auto& e : ct)
        if (e.value("name", "") == "default") d.chat_template = e.value("template", "");
    }
  }
  return d;
}

}  // namespace kvq

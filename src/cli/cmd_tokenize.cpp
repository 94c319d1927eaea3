// kvq tokenize / kvq detokenize: the model's tokenizer from the command line.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "cli/command.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"
#include "core/file_io.hpp"
#include "core/timer.hpp"
#include "gguf/gguf.hpp"
#include "tokenizer/chat.hpp"
#include "tokenizer/tokenizer.hpp"
#include "tokenizer/unicode.hpp"

namespace kvq::cli {
namespace {

struct Source {
  std::string model;           // -m FILE.gguf
  std::string tokenizer_json;  // --tokenizer-json PATH
};

void add_source_options(CLI::App& sub, Source& src) {
  sub.add_option("-m,--model", src.model,
                 "GGUF model whose tokenizer.ggml.* metadata to use (default: $KVQ_MODEL or the embedded "
                 "models/kvq-tiny-code.gguf)");
  sub.add_option("--tokenizer-json", src.tokenizer_json,
                 "Hugging Face tokenizer.json instead of a GGUF (tokenizer_config.json beside it is read too)");
}

Tokenizer load(const Source& src) {
  KVQ_CHECK(src.model.empty() || src.tokenizer_json.empty(), Errc::invalid_argument,
            "give -m FILE.gguf or --tokenizer-json PATH, not both");
  if (!src.tokenizer_json.empty()) return Tokenizer::from_hf_json(src.tokenizer_json);
  const gguf::File f = gguf::File::open(src.model.empty() ? resolve_model_path("") : src.model);  // default: as `kvq run`
  return Tokenizer::from_gguf(f);
}

std::string read_input(const std::string& text, bool have_text, const std::string& file) {
  KVQ_CHECK(!(have_text && !file.empty()), Errc::invalid_argument, "give TEXT or -f FILE, not both");
  if (have_text) return text;
  return read_file_bounded(file.empty() ? "-" : file, kMaxTextInputBytes, "input");
}

// JSON needs valid UTF-8; pieces that are parts of a character are shown escaped.
std::string json_piece(const std::string& bytes) { return utf8::is_valid(bytes) ? bytes : utf8::escape(bytes); }

}  // namespace

KVQ_REGISTER_COMMAND(
    "tokenize", "Print the token ids (and pieces) of a text",
    [](CLI::App& sub) -> std::function<int()> {
      struct Opts {
        Source src;
        std::string text, file, system, chat_template = "auto";
        bool json = false, special = false, ids_only = false, no_bos = false, chat = false, no_think = false,
             stats = false;
      };
      auto o = std::make_shared<Opts>();
      add_source_options(sub, o->src);
      auto* text_opt = sub.add_option("text", o->text, "Text to tokenize (default: -f FILE or standard input)");
      sub.add_option("-f,--file", o->file, "Read the text from FILE ('-' for standard input)");
      sub.add_flag("--json", o->json, "Print {\"ids\": [...], \"pieces\": [...]} as JSON");
      sub.add_flag("--special", o->special, "Recognise special tokens written in the text (<|im_start|>, ...)");
      sub.add_flag("--ids", o->ids_only, "Print only the ids, space separated, on one line");
      sub.add_flag("--no-bos", o->no_bos, "Do not prepend BOS even when the model asks for it (add_bos_token)");
      sub.add_flag("--chat", o->chat,
                   "Format TEXT as a user message with the chat template first (control tokens come from the "
                   "template only; TEXT stays text)");
      sub.add_option("--system", o->system, "System message for --chat");
      sub.add_option("--chat-template", o->chat_template, "Chat template for --chat: auto|chatml|llama3|none")
          ->capture_default_str();
      sub.add_flag("--no-think", o->no_think, "With --chat: disable Qwen3 thinking (enable_thinking = false)");
      sub.add_flag("--stats", o->stats, "Print size, token count and tokenizing speed to standard error");
      for (const char* chat_only : {"--system", "--no-think", "--chat-template"})
        sub.get_option(chat_only)->needs(sub.get_option("--chat"));
      sub.get_option("--special")->excludes(sub.get_option("--chat"));
      return [o, text_opt] {
        const Tokenizer tok = load(o->src);
        std::string text = read_input(o->text, text_opt->count() > 0, o->file);
        const bool special = o->special;
        bool bos = tok.add_bos() && tok.bos() >= 0 && !o->no_bos;
        std::optional<RenderedChat> chat;
        if (o->chat) {
          const ChatTemplate t = resolve_chat_template(o->chat_template, tok.chat_template());
          std::vector<ChatMessage> msgs;
          if (!o->system.empty()) msgs.push_back({"system", o->system});
          msgs.push_back({"user", text});
          chat = render_chat(t, msgs, /*add_generation_prompt=*/true, /*enable_thinking=*/!o->no_think);
          text = chat->text;
          if (chat_template_has_bos(t)) bos = false;  // the template wrote it
        }
        Timer timer;
        std::vector<TokenId> ids = chat ? encode_chat(tok, *chat) : tok.encode(text, special);
        const double secs = timer.seconds();
        if (bos) ids.insert(ids.begin(), tok.bos());

        if (o->json) {
          nlohmann::json j;
          j["ids"] = ids;
          auto& pieces = j["pieces"] = nlohmann::json::array();
          for (TokenId id : ids) pieces.push_back(json_piece(tok.piece(id)));
          j["n_tokens"] = ids.size();
          std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
        } else if (o->ids_only) {
          std::string line;
          for (size_t i = 0; i < ids.size(); ++i) line += (i ? " " : "") + std::to_string(ids[i]);
          std::printf("%s\n", line.c_str());
        } else {
          for (TokenId id : ids) std::printf("%6d  '%s'\n", id, utf8::escape(tok.piece(id)).c_str());
        }
        if (o->stats)
          std::fprintf(stderr, "%zu bytes -> %zu tokens in %.3f s (%.1f MB/s, %.2f bytes/token)\n", text.size(),
                       ids.size(), secs, secs > 0 ? text.size() / secs / 1e6 : 0.0,
                       ids.empty() ? 0.0 : double(text.size()) / double(ids.size()));
        return 0;
      };
    });

KVQ_REGISTER_COMMAND(
    "detokenize", "Print the text of token ids",
    [](CLI::App& sub) -> std::function<int()> {
      struct Opts {
        Source src;
        std::vector<std::string> ids;
        bool special = false, no_newline = false;
      };
      auto o = std::make_shared<Opts>();
      add_source_options(sub, o->src);
      sub.add_option("ids", o->ids, "Token ids: separate arguments, or '1,2,3' / '[1, 2, 3]' (default: standard input)");
      sub.add_flag("--special", o->special, "Show control tokens (<|im_end|>, ...) instead of hiding them");
      sub.add_flag("-n,--no-newline", o->no_newline, "Do not end the output with a newline");
      return [o] {
        const Tokenizer tok = load(o->src);
        std::string all;
        if (o->ids.empty()) {
          all = read_stream_bounded(stdin, "<stdin>", kMaxTextInputBytes, "token id input");
        } else {
          for (const auto& s : o->ids) all += s + " ";
        }
        // Any run of digits (with an optional minus) is an id; everything else separates.
        std::vector<TokenId> ids;
        for (size_t i = 0; i < all.size();) {
          const bool neg = all[i] == '-' && i + 1 < all.size() && std::isdigit(static_cast<unsigned char>(all[i + 1]));
          if (!neg && !std::isdigit(static_cast<unsigned char>(all[i]))) {
            KVQ_CHECK(std::string_view(" \t\r\n,[]").find(all[i]) != std::string_view::npos, Errc::invalid_argument,
                      "cannot read token ids from '", all.substr(i, 20), "'; give integers like 9707 11 1879");
            ++i;
            continue;
          }
          size_t j = i + (neg ? 1 : 0);
          while (j < all.size() && std::isdigit(static_cast<unsigned char>(all[j]))) ++j;
          // Saturating: a 30-digit id is out of range, not a library exception.
          long long v = 0;
          for (size_t k = i + (neg ? 1 : 0); k < j; ++k) v = std::min<long long>(v * 10 + (all[k] - '0'), 1LL << 40);
          if (neg) v = -v;
          KVQ_CHECK(v >= 0 && v < tok.vocab_size(), Errc::invalid_argument, "token id ", v,
                    " is outside the vocabulary (0..", tok.vocab_size() - 1, ")");
          ids.push_back(TokenId(v));
          i = j;
        }
        const std::string text = tok.decode(ids, o->special);
        std::fwrite(text.data(), 1, text.size(), stdout);
        if (!o->no_newline) std::fputc('\n', stdout);
        return 0;
      };
    });

}  // namespace kvq::cli

#include "tokenizer/chat.hpp"

#include "core/error.hpp"

namespace kvq {
namespace {

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// Python's str.strip(chars) family, as the Jinja templates use them.
std::string_view lstrip(std::string_view s, std::string_view chars) {
  const size_t b = s.find_first_not_of(chars);
  return b == std::string_view::npos ? std::string_view() : s.substr(b);
}
std::string_view rstrip(std::string_view s, std::string_view chars) {
  const size_t e = s.find_last_not_of(chars);
  return e == std::string_view::npos ? std::string_view() : s.substr(0, e + 1);
}
std::string_view strip(std::string_view s, std::string_view chars) { return lstrip(rstrip(s, chars), chars); }

// Jinja's `trim` filter (Python str.strip() on ASCII whitespace for our purposes).
constexpr std::string_view kWhitespace = " \t\n\r\v\f";

// The rendered prompt and which parts of it are message content (RenderedChat).
class Renderer {
 public:
  Renderer& tmpl(std::string_view s) {
    out_.text += s;
    return *this;
  }
  Renderer& content(std::string_view s) {
    if (s.empty()) return *this;
    const size_t b = out_.text.size();
    out_.text += s;
    if (!out_.literal.empty() && out_.literal.back().end == b) out_.literal.back().end = out_.text.size();
    else out_.literal.push_back({b, out_.text.size()});
    return *this;
  }
  RenderedChat take() { return std::move(out_); }

 private:
  RenderedChat out_;
};

RenderedChat render_chatml(const std::vector<ChatMessage>& msgs, bool add_generation_prompt, bool enable_thinking) {
  // Mirrors Qwen3's template: a leading system message, then the turns; the
  // reasoning of assistant turns before the last real user query is dropped.
  Renderer out;
  if (!msgs.empty() && msgs[0].role == "system")
    out.tmpl("<|im_start|>system\n").content(msgs[0].content).tmpl("<|im_end|>\n");

  // Index of the last user message that is not a wrapped tool response.
  int last_query = int(msgs.size()) - 1;
  for (int i = int(msgs.size()) - 1; i >= 0; --i) {
    const auto& m = msgs[i];
    if (m.role == "user" && !(starts_with(m.content, "<tool_response>") && ends_with(m.content, "</tool_response>"))) {
      last_query = i;
      break;
    }
  }

  for (size_t i = 0; i < msgs.size(); ++i) {
    const auto& m = msgs[i];
    const bool first = i == 0, last = i + 1 == msgs.size();
    if (m.role == "user" || (m.role == "system" && !first)) {
      out.tmpl("<|im_start|>").content(m.role).tmpl("\n").content(m.content).tmpl("<|im_end|>\n");
    } else if (m.role == "assistant") {
      std::string_view content = m.content;
      std::string_view reasoning;
      const size_t close = content.find("</think>");
      if (close != std::string_view::npos) {
        // content.split('</think>')[-1].lstrip('\n') and
        // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
        const size_t last_close = content.rfind("</think>");
        const std::string_view before = rstrip(content.substr(0, close), "\n");
        const size_t open = before.rfind("<think>");
        reasoning = lstrip(open == std::string_view::npos ? before : before.substr(open + 7), "\n");
        content = lstrip(content.substr(last_close + 8), "\n");
      }
      out.tmpl("<|im_start|>").content(m.role);
      if (int(i) > last_query && (last || !reasoning.empty())) {
        out.tmpl("\n<think>\n").content(strip(reasoning, "\n")).tmpl("\n</think>\n\n").content(lstrip(content, "\n"));
      } else {
        out.tmpl("\n").content(content);
      }
      out.tmpl("<|im_end|>\n");
    } else if (m.role == "tool") {
      if (first || msgs[i - 1].role != "tool") out.tmpl("<|im_start|>user");
      out.tmpl("\n<tool_response>\n").content(m.content).tmpl("\n</tool_response>");
      if (last || msgs[i + 1].role != "tool") out.tmpl("<|im_end|>\n");
    } else if (m.role != "system") {
      fail(Errc::invalid_argument, "chat message role '", m.role,
           "' is not supported by the chatml template (use system, user, assistant or tool)");
    }
  }
  if (add_generation_prompt) {
    out.tmpl("<|im_start|>assistant\n");
    if (!enable_thinking) out.tmpl("<think>\n\n</think>\n\n");
  }
  return out.take();
}

RenderedChat render_llama3(const std::vector<ChatMessage>& msgs, bool add_generation_prompt) {
  Renderer out;
  out.tmpl("<|begin_of_text|>");
  for (const auto& m : msgs)
    out.tmpl("<|start_header_id|>")
        .content(m.role)
        .tmpl("<|end_header_id|>\n\n")
        .content(strip(m.content, kWhitespace))
        .tmpl("<|eot_id|>");
  if (add_generation_prompt) out.tmpl("<|start_header_id|>assistant<|end_header_id|>\n\n");
  return out.take();
}

RenderedChat render_none(const std::vector<ChatMessage>& msgs) {
  Renderer out;
  for (const auto& m : msgs) out.content(m.content);
  return out.take();
}

constexpr const char* kOverrideHint = "pass --chat-template chatml|llama3|none to choose one";

}  // namespace

const char* chat_template_name(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::chatml: return "chatml";
    case ChatTemplate::llama3: return "llama3";
    case ChatTemplate::none: return "none";
  }
  return "?";
}

ChatTemplate chat_template_from_name(std::string_view name) {
  for (ChatTemplate t : {ChatTemplate::chatml, ChatTemplate::llama3, ChatTemplate::none})
    if (name == chat_template_name(t)) return t;
  fail(Errc::invalid_argument, "unknown chat template '", name, "'; valid: chatml, llama3, none (or auto)");
}

ChatTemplate detect_chat_template(std::string_view text) {
  if (text.empty()) fail(Errc::unsupported, "the model has no chat template (tokenizer.chat_template); ", kOverrideHint);
  if (text.find("<|im_start|>") != std::string_view::npos) return ChatTemplate::chatml;
  if (text.find("<|start_header_id|>") != std::string_view::npos) return ChatTemplate::llama3;
  std::string head(text.substr(0, 60));
  for (char& c : head)
    if (c == '\n' || c == '\r') c = ' ';
  fail(Errc::unsupported, "unrecognised chat template (starts \"", head, "...\"); ", kOverrideHint);
}

ChatTemplate resolve_chat_template(std::string_view override_name, std::string_view jinja_text) {
  if (override_name.empty() || override_name == "auto") return detect_chat_template(jinja_text);
  return chat_template_from_name(override_name);
}

RenderedChat render_chat(ChatTemplate t, const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                         bool enable_thinking) {
  switch (t) {
    case ChatTemplate::chatml: return render_chatml(messages, add_generation_prompt, enable_thinking);
    case ChatTemplate::llama3: return render_llama3(messages, add_generation_prompt);
    case ChatTemplate::none: return render_none(messages);
  }
  fail(Errc::internal, "unhandled chat template");
}

std::string format_chat(ChatTemplate t, const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                        bool enable_thinking) {
  return render_chat(t, messages, add_generation_prompt, enable_thinking).text;
}

std::vector<TokenId> encode_chat(const Tokenizer& tok, const RenderedChat& chat) {
  return tok.encode_with_literals(chat.text, chat.literal);
}

std::vector<std::string> chat_turn_openers(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::chatml: return {"<|im_start|>"};
    case ChatTemplate::llama3: return {"<|start_header_id|>"};
    case ChatTemplate::none: return {};
  }
  return {};
}

bool chat_template_has_bos(ChatTemplate t) { return t == ChatTemplate::llama3; }

std::vector<TokenId> encode_chat(const Tokenizer& tok, ChatTemplate t, const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt, bool enable_thinking) {
  const RenderedChat chat = render_chat(t, messages, add_generation_prompt, enable_thinking);
  std::vector<TokenId> ids;
  // Templates that render the BOS text themselves get no second BOS.
  if (!chat_template_has_bos(t) && tok.add_bos() && tok.bos() >= 0) ids.push_back(tok.bos());
  // Control tokens come from the template only; message text stays text.
  const auto body = encode_chat(tok, chat);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

}  // namespace kvq

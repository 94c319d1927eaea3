#include "tokenizer/chat.hpp"

#include "core/error.hpp"
#include "tokenizer/tokenizer.hpp"

namespace kvq {
namespace {

// Builds a ChatPrompt: `out << markup` is template text, `out.user(text)` is
// message data (recorded as a literal range, never read as control tokens).
struct Builder {
  ChatPrompt p;
  Builder& operator<<(std::string_view markup) {
    p.text += markup;
    return *this;
  }
  Builder& user(std::string_view data) {
    if (data.empty()) return *this;
    const size_t b = p.text.size();
    p.text += data;
    if (!p.literal.empty() && p.literal.back().second == b)
      p.literal.back().second = p.text.size();  // adjacent ranges merge (kept disjoint)
    else
      p.literal.emplace_back(b, p.text.size());
    return *this;
  }
};

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

ChatPrompt render_chatml(const std::vector<ChatMessage>& msgs, bool add_generation_prompt, bool enable_thinking) {
  // Mirrors Qwen3's template: a leading system message, then the turns; the
  // reasoning of assistant turns before the last real user query is dropped.
  Builder out;
  if (!msgs.empty() && msgs[0].role == "system") (out << "<|im_start|>system\n").user(msgs[0].content) << "<|im_end|>\n";

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
      (out << "<|im_start|>").user(m.role) << "\n";
      out.user(m.content) << "<|im_end|>\n";
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
      (out << "<|im_start|>").user(m.role) << "\n";
      if (int(i) > last_query && (last || !reasoning.empty())) {
        out << "<think>\n";
        out.user(strip(reasoning, "\n")) << "\n</think>\n\n";
        out.user(lstrip(content, "\n"));
      } else {
        out.user(content);
      }
      out << "<|im_end|>\n";
    } else if (m.role == "tool") {
      if (first || msgs[i - 1].role != "tool") out << "<|im_start|>user";
      out << "\n<tool_response>\n";
      out.user(m.content) << "\n</tool_response>";
      if (last || msgs[i + 1].role != "tool") out << "<|im_end|>\n";
    } else if (m.role != "system") {
      fail(Errc::invalid_argument, "chat message role '", m.role,
           "' is not supported by the chatml template (use system, user, assistant or tool)");
    }
  }
  if (add_generation_prompt) {
    out << "<|im_start|>assistant\n";
    if (!enable_thinking) out << "<think>\n\n</think>\n\n";
  }
  return std::move(out.p);
}

ChatPrompt render_llama3(const std::vector<ChatMessage>& msgs, bool add_generation_prompt) {
  Builder out;
  out << "<|begin_of_text|>";
  for (const auto& m : msgs) {
    (out << "<|start_header_id|>").user(m.role) << "<|end_header_id|>\n\n";
    out.user(strip(m.content, kWhitespace)) << "<|eot_id|>";
  }
  if (add_generation_prompt) out << "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return std::move(out.p);
}

ChatPrompt render_none(const std::vector<ChatMessage>& msgs) {
  Builder out;
  for (const auto& m : msgs) out.user(m.content);
  return std::move(out.p);
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

ChatPrompt render_chat(ChatTemplate t, const std::vector<ChatMessage>& messages, bool add_generation_prompt,
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

std::vector<TokenId> encode_chat(const Tokenizer& tok, ChatTemplate t, const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt, bool enable_thinking) {
  const ChatPrompt p = render_chat(t, messages, add_generation_prompt, enable_thinking);
  std::vector<TokenId> ids;
  // Templates that render the BOS text themselves get no second BOS.
  if (!chat_template_has_bos(t) && tok.add_bos() && tok.bos() >= 0) ids.push_back(tok.bos());
  const auto body = tok.encode(p.text, p.literal);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

bool chat_template_has_bos(ChatTemplate t) { return t == ChatTemplate::llama3; }

}  // namespace kvq

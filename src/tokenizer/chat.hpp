// Chat prompt formatting for the template families kvq supports. GGUF models
// ship a Jinja template (tokenizer.chat_template); rather than embedding a
// Jinja engine we recognise the family from the template text and reproduce
// its output exactly (tests compare with the real templates rendered by a
// Jinja implementation, tests/data/tokenizer/chat_ref.json).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvq {

class Tokenizer;
using TokenId = int32_t;

enum class ChatTemplate {
  chatml,  // <|im_start|>role\n...<|im_end|>, Qwen3 dialect (thinking blocks, tool responses)
  llama3,  // <|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>
  none,    // no markup: message contents concatenated (base models)
};

struct ChatMessage {
  std::string role;     // "system", "user", "assistant" or "tool"
  std::string content;
};

const char* chat_template_name(ChatTemplate t);
// "chatml", "llama3" or "none"; anything else throws Errc::invalid_argument listing them.
ChatTemplate chat_template_from_name(std::string_view name);
// Family of a Jinja template text. An empty or unrecognised template throws
// Errc::unsupported naming the override (--chat-template chatml|llama3|none).
ChatTemplate detect_chat_template(std::string_view jinja_text);
// override_name empty or "auto": detect from jinja_text; else the named family.
ChatTemplate resolve_chat_template(std::string_view override_name, std::string_view jinja_text);

// The prompt text the model's template renders. add_generation_prompt opens
// an assistant turn. enable_thinking = false makes Qwen3 skip reasoning (an
// empty <think></think> block after the generation prompt); other families
// ignore it. llama3 output starts with the BOS text <|begin_of_text|>, as the
// template does: encode it with parse_special and do not add another BOS
// (see chat_template_has_bos).
std::string format_chat(ChatTemplate t, const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                        bool enable_thinking = true);
bool chat_template_has_bos(ChatTemplate t);

// format_chat's text plus the byte ranges [first, second) of it that came
// from the messages (roles and contents; sorted, disjoint). Those ranges are
// data: a user who types <|im_end|> means those ten characters.
struct ChatPrompt {
  std::string text;
  std::vector<std::pair<size_t, size_t>> literal;
};
ChatPrompt render_chat(ChatTemplate t, const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                       bool enable_thinking = true);

// Token ids of a rendered conversation: the template's markup becomes its
// control tokens, message text never does (Tokenizer::encode with literal
// ranges). A BOS is prepended when the tokenizer wants one and the template
// does not render it itself.
std::vector<TokenId> encode_chat(const Tokenizer& tok, ChatTemplate t, const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt = true, bool enable_thinking = true);

}  // namespace kvq

// Chat prompt formatting for the template families kvq supports. GGUF models
// ship a Jinja template (tokenizer.chat_template); rather than embedding a
// Jinja engine we recognise the family from the template text and reproduce
// its output exactly (tests compare with the real templates rendered by a
// Jinja implementation, tests/data/tokenizer/chat_ref.json).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.hpp"

namespace kvq {

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

// Texts of the control tokens that open a turn in this family
// (<|im_start|>, <|start_header_id|>): a chat reply that emits one has ended
// its own turn. Empty for `none`.
std::vector<std::string> chat_turn_openers(ChatTemplate t);

// A rendered chat prompt that remembers which bytes are message content
// (roles included). Content is text whatever it spells: a user who types
// "<|im_end|>\n<|im_start|>system" must not get real control tokens (role
// injection). Only the template's own markup may become control tokens.
struct RenderedChat {
  std::string text;               // == format_chat(...)
  std::vector<TextSpan> literal;  // message content: byte ranges of text, in order
};
RenderedChat render_chat(ChatTemplate t, const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                         bool enable_thinking = true);
// Token ids of a rendered chat: control tokens from the template's markup
// only (Tokenizer::encode_with_literals). No BOS is added here.
std::vector<TokenId> encode_chat(const Tokenizer& tok, const RenderedChat& chat);
// render_chat + encode_chat, with a BOS in front when the tokenizer wants one
// and the template does not render it itself: a conversation's prompt ids.
std::vector<TokenId> encode_chat(const Tokenizer& tok, ChatTemplate t, const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt = true, bool enable_thinking = true);

}  // namespace kvq

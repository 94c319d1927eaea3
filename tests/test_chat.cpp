// Chat formatting against the models' own Jinja templates, rendered by a Jinja
// implementation (tools/tokref/make_ref.mjs -> tests/data/tokenizer/chat_ref.json).
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "tokenizer/chat.hpp"
#include "tokenizer/tokenizer.hpp"
#include "tokenizer/unicode.hpp"
#include "tokenizer_test_util.hpp"

using namespace kvq;

TEST(Chat, MatchesJinjaRenders) {
  std::ifstream in(kvq::test::tok_data("chat_ref.json"));
  ASSERT_TRUE(in) << "missing chat_ref.json: run tools/tokref/regen.sh";
  const auto cases = nlohmann::json::parse(in);
  ASSERT_GE(cases.size(), 10u);
  for (const auto& c : cases) {
    std::vector<ChatMessage> msgs;
    for (const auto& m : c["messages"]) msgs.push_back({m["role"], m["content"]});
    const ChatTemplate t = chat_template_from_name(c["family"].get<std::string>());
    const bool thinking = c.value("enable_thinking", true);
    const std::string got = format_chat(t, msgs, c["add_generation_prompt"].get<bool>(), thinking);
    EXPECT_EQ(got, c["expected"].get<std::string>()) << c["name"];
  }
}

TEST(Chat, DetectsFamiliesFromTemplateText) {
  EXPECT_EQ(detect_chat_template(kvq::test::qwen3().chat_template()), ChatTemplate::chatml);
  EXPECT_EQ(detect_chat_template("{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}"),
            ChatTemplate::llama3);
  EXPECT_EQ(resolve_chat_template("llama3", "<|im_start|>"), ChatTemplate::llama3);
  EXPECT_EQ(resolve_chat_template("auto", "<|im_start|>"), ChatTemplate::chatml);
  EXPECT_EQ(resolve_chat_template("none", ""), ChatTemplate::none);
}

TEST(Chat, UnrecognisedTemplateNamesTheOverride) {
  for (const char* text : {"{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}", ""}) {
    try {
      (void)detect_chat_template(text);
      FAIL() << "expected an error for: " << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::unsupported);
      EXPECT_NE(std::string(e.what()).find("--chat-template chatml|llama3|none"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(chat_template_from_name("vicuna"), Error);
}

TEST(Chat, Qwen3ThinkingSwitch) {
  const std::vector<ChatMessage> msgs = {{"user", "hi"}};
  const std::string on = format_chat(ChatTemplate::chatml, msgs, true, true);
  const std::string off = format_chat(ChatTemplate::chatml, msgs, true, false);
  EXPECT_EQ(on, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(off, on + "<think>\n\n</think>\n\n");
  // Without a generation prompt the switch changes nothing.
  EXPECT_EQ(format_chat(ChatTemplate::chatml, msgs, false, false), format_chat(ChatTemplate::chatml, msgs, false, true));
}

TEST(Chat, FormattedPromptTokenizesToSpecialIds) {
  const Tokenizer& t = kvq::test::qwen3();
  const std::string prompt = format_chat(ChatTemplate::chatml, {{"system", "Be kind."}, {"user", "Hello"}}, true, false);
  const auto ids = t.encode(prompt, /*parse_special=*/true);
  const TokenId im_start = t.find_token("<|im_start|>"), im_end = t.find_token("<|im_end|>");
  size_t starts = 0, ends = 0;
  for (TokenId id : ids) {
    starts += id == im_start;
    ends += id == im_end;
  }
  EXPECT_EQ(starts, 3u);
  EXPECT_EQ(ends, 2u);
  EXPECT_EQ(ids.front(), im_start);
  EXPECT_EQ(t.decode(ids, true), prompt);
  EXPECT_FALSE(chat_template_has_bos(ChatTemplate::chatml));
  EXPECT_TRUE(chat_template_has_bos(ChatTemplate::llama3));
}

TEST(Chat, NoneConcatenatesContents) {
  EXPECT_EQ(format_chat(ChatTemplate::none, {{"system", "a"}, {"user", "b"}}, true, false), "ab");
}

TEST(Chat, ChatmlRejectsUnknownRoles) {
  EXPECT_THROW(format_chat(ChatTemplate::chatml, {{"narrator", "x"}}, true), Error);
}

// Byte-level BPE against reference ids from an independent implementation
// (tools/tokref), plus round trips, special tokens, invalid UTF-8, streaming.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "tokenizer/hf_import.hpp"
#include "tokenizer/pretokenizer.hpp"
#include "tokenizer/tokenizer.hpp"
#include "tokenizer/unicode.hpp"
#include "tokenizer_test_util.hpp"

using namespace kvq;
using kvq::test::qwen3;
using kvq::test::read_jsonl;
using kvq::test::tok_data;

namespace {

std::vector<std::string> corpus() {
  std::vector<std::string> out;
  for (const auto& j : read_jsonl(tok_data("corpus.jsonl"))) out.push_back(j.get<std::string>());
  return out;
}

// Compares every corpus line with the reference ids; reports each mismatch.
void expect_matches_reference(const Tokenizer& tok, const std::string& ref_file) {
  const auto texts = corpus();
  const auto refs = read_jsonl(tok_data(ref_file));
  ASSERT_EQ(texts.size(), refs.size()) << ref_file << " is stale: rerun tools/tokref/regen.sh";
  ASSERT_GE(texts.size(), 100u);
  size_t total = 0, mismatches = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto want = refs[i].get<std::vector<TokenId>>();
    const auto got = tok.encode(texts[i], /*parse_special=*/true);
    total += want.size();
    if (got != want) ++mismatches;
    EXPECT_EQ(got, want) << "corpus line " << i + 1 << ": \"" << utf8::escape(texts[i].substr(0, 120)) << "\"";
  }
  EXPECT_GT(total, 3000u);  // the corpus really exercised the tokenizer
  EXPECT_EQ(mismatches, 0u);
}

// What decode(encode(x)) must give: ill-formed bytes kept, well-formed runs in NFC
// (for tokenizers that normalize).
std::string expected_round_trip(std::string_view x, bool nfc) {
  std::string out, run;
  auto flush = [&] {
    out += nfc ? utf8::nfc(run) : run;
    run.clear();
  };
  for (size_t i = 0; i < x.size();) {
    const size_t n = utf8::sequence_length(x, i);
    if (n == 0) {
      flush();
      out.push_back(x[i++]);
    } else {
      run.append(x.substr(i, n));
      i += n;
    }
  }
  flush();
  return out;
}

// A tiny byte-level vocabulary: the 256 byte tokens (ids 0..255 in byte order)
// plus the given merges, each adding its result as the next id.
TokenizerData tiny_vocab(const std::string& pre, const std::vector<std::string>& merges,
                         const std::vector<std::string>& extra_tokens = {}) {
  TokenizerData d;
  d.pre = pre;
  for (int b = 0; b < 256; ++b) d.tokens.push_back(byte_unicode::encode(std::string(1, char(b))));
  for (const auto& m : merges) {
    d.merges.push_back(m);
    const size_t sp = m.find(' ');
    d.tokens.push_back(m.substr(0, sp) + m.substr(sp + 1));
  }
  for (const auto& t : extra_tokens) d.tokens.push_back(t);
  return d;
}

TokenId byte_id(unsigned char b) { return TokenId(b); }

}  // namespace

// ---------------------------------------------------------------------------
// Reference comparisons

TEST(TokenizerQwen3, MatchesReferenceIdsOnCorpus) {
  expect_matches_reference(qwen3(), "qwen3_ref.jsonl");
}

// 3000 seeded random strings over many Unicode blocks, with ids from Hugging
// Face `tokenizers` 0.23.2 itself (tools/tokref/make_probe.py, hf_ref.py). The
// JavaScript port disagrees with HF on 89 of them (its \s differs); kvq must not.
TEST(TokenizerQwen3, MatchesHuggingFaceOnRandomUnicodeProbe) {
  std::vector<std::string> texts;
  for (const auto& j : read_jsonl(tok_data("probe.jsonl"))) texts.push_back(j.get<std::string>());
  const auto refs = read_jsonl(tok_data("qwen3_hf_probe_ref.jsonl"));
  ASSERT_EQ(texts.size(), 3000u);
  ASSERT_EQ(refs.size(), texts.size());
  size_t mismatches = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto want = refs[i].get<std::vector<TokenId>>();
    const auto got = qwen3().encode(texts[i], true);
    if (got != want && ++mismatches <= 10)
      ADD_FAILURE() << "probe line " << i + 1 << ": \"" << utf8::escape(texts[i]) << "\"";
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(TokenizerLlama3, MatchesReferenceIdsOnCorpus) {
  if (!std::filesystem::exists(kvq::test::llama3_json()))
    GTEST_SKIP() << "Llama 3 tokenizer not installed: run `npm ci` in tools/tokref (tools/install-deps.sh does)";
  const Tokenizer llama = Tokenizer::from_hf_json(kvq::test::llama3_json());
  EXPECT_EQ(llama.pre(), "llama-bpe");
  expect_matches_reference(llama, "llama3_ref.jsonl");
}

TEST(TokenizerQwen3, LoadsMetadataFromTokenizerJson) {
  const Tokenizer& t = qwen3();
  EXPECT_EQ(t.pre(), "qwen2");
  EXPECT_EQ(t.vocab_size(), 151669);
  EXPECT_EQ(t.find_token("<|endoftext|>"), 151643);
  EXPECT_EQ(t.find_token("<|im_end|>"), 151645);
  EXPECT_EQ(t.eos(), 151645);
  EXPECT_EQ(t.bos(), 151643);
  EXPECT_FALSE(t.add_bos());
  EXPECT_TRUE(t.is_control(151644));
  EXPECT_EQ(t.type(151667), TokenType::user_defined);  // <think>
  EXPECT_EQ(t.type(151659), TokenType::control);       // <|fim_prefix|>: spelled <|...|>
  EXPECT_EQ(t.type(9707), TokenType::normal);
  EXPECT_TRUE(t.is_eog(151645));
  EXPECT_TRUE(t.is_eog(151643));
  EXPECT_FALSE(t.is_eog(9707));
  EXPECT_NE(t.chat_template().find("<|im_start|>"), std::string::npos);
  EXPECT_EQ(t.piece(9707), "Hello");
  EXPECT_EQ(t.piece(1879), " world");
  EXPECT_EQ(t.find_token(" world"), 1879);
  EXPECT_EQ(t.find_token("no such token text"), -1);
}

// ---------------------------------------------------------------------------
// Round trips

TEST(TokenizerQwen3, RoundTripsCorpusExactlyForNfcText) {
  const Tokenizer& t = qwen3();
  size_t nfc_cases = 0;
  for (const auto& x : corpus()) {
    for (bool special : {false, true}) {
      const auto ids = t.encode(x, special);
      // Qwen normalizes to NFC, so only NFC text comes back byte-identical.
      EXPECT_EQ(t.decode(ids, /*show_special=*/true), utf8::nfc(x)) << utf8::escape(x.substr(0, 80));
      if (utf8::is_nfc(x)) {
        ++nfc_cases;
        EXPECT_EQ(t.decode(ids, true), x);
      }
    }
  }
  EXPECT_GT(nfc_cases, 200u);
}

TEST(TokenizerQwen3, NormalizesToNfcLikeTheReference) {
  const Tokenizer& t = qwen3();
  EXPECT_EQ(t.encode("e\xCC\x81"), t.encode("\xC3\xA9"));  // e + U+0301 == é
  EXPECT_EQ(t.decode(t.encode("cafe\xCC\x81")), "caf\xC3\xA9");
}

// ---------------------------------------------------------------------------
// Special tokens

TEST(TokenizerQwen3, SpecialTokensOnlyWhenAsked) {
  const Tokenizer& t = qwen3();
  const TokenId im_start = t.find_token("<|im_start|>"), im_end = t.find_token("<|im_end|>");
  const std::string text = "<|im_start|>user\nhi<|im_end|>";
  const auto with = t.encode(text, true);
  ASSERT_GE(with.size(), 3u);
  EXPECT_EQ(with.front(), im_start);
  EXPECT_EQ(with.back(), im_end);

  // Without parse_special the text is ordinary: no control token appears and
  // the ids are those of the same text with the markers spelled by BPE.
  const auto without = t.encode(text, false);
  for (TokenId id : without) EXPECT_FALSE(t.is_control(id)) << id;
  EXPECT_EQ(t.decode(without), text);
  EXPECT_GT(without.size(), with.size());
}

TEST(TokenizerQwen3, UserDefinedTokensAlwaysRecognised) {
  // HF (encode_special_tokens) and llama.cpp (parse_special = false) both keep
  // splitting added tokens that are not special, such as Qwen3's <think>.
  const Tokenizer& t = qwen3();
  const TokenId think = t.find_token("<think>");
  ASSERT_GE(think, 0);
  EXPECT_EQ(t.encode("<think>", false), std::vector<TokenId>{think});
  EXPECT_EQ(t.encode("<think>", true), std::vector<TokenId>{think});
}

TEST(TokenizerQwen3, MergingOrdinaryTextNeverProducesAddedTokens) {
  const Tokenizer& t = qwen3();
  for (const auto& x : corpus())
    for (TokenId id : t.encode(x, /*parse_special=*/false))
      EXPECT_TRUE(t.type(id) == TokenType::normal || t.type(id) == TokenType::user_defined)
          << "id " << id << " in \"" << utf8::escape(x.substr(0, 60)) << "\"";
}

TEST(TokenizerQwen3, ControlTokensHiddenOnDisplay) {
  const Tokenizer& t = qwen3();
  const auto ids = t.encode("<|im_start|>assistant\n<think>\nok\n</think>\n\nDone.<|im_end|>", true);
  EXPECT_EQ(t.decode(ids, /*show_special=*/false), "assistant\n<think>\nok\n</think>\n\nDone.");
  EXPECT_EQ(t.decode(ids, /*show_special=*/true), "<|im_start|>assistant\n<think>\nok\n</think>\n\nDone.<|im_end|>");
}

TEST(TokenizerQwen3, LongestAddedTokenWins) {
  // Leftmost-longest: "<|im_start|>" must not be read as a shorter prefix token.
  const Tokenizer& t = qwen3();
  const auto ids = t.encode("<|im_start|><|im_start|>", true);
  EXPECT_EQ(ids, (std::vector<TokenId>{151644, 151644}));
}

// ---------------------------------------------------------------------------
// Invalid UTF-8: documented behaviour is that each ill-formed byte becomes its
// byte token; well-formed text around it tokenizes normally; nothing throws.

TEST(TokenizerQwen3, InvalidUtf8BytesBecomeByteTokens) {
  const Tokenizer& t = qwen3();
  const auto byte_tok = [&](unsigned char b) { return t.find_token(std::string(1, char(b))); };
  EXPECT_EQ(t.encode("\xFF"), std::vector<TokenId>{byte_tok(0xFF)});
  EXPECT_EQ(t.encode("\xC0\xAF"), (std::vector<TokenId>{byte_tok(0xC0), byte_tok(0xAF)}));  // overlong '/'
  EXPECT_EQ(t.encode("\xED\xA0\x80"),  // UTF-16 surrogate
            (std::vector<TokenId>{byte_tok(0xED), byte_tok(0xA0), byte_tok(0x80)}));
  // A truncated character at the end and a stray continuation in the middle.
  const std::string mixed = "Hello\x80world \xE4\xBD";
  const auto ids = t.encode(mixed);
  EXPECT_EQ(t.decode(ids), mixed);
  const auto hello = t.encode("Hello"), world = t.encode("world ");
  std::vector<TokenId> want = hello;
  want.push_back(byte_tok(0x80));
  want.insert(want.end(), world.begin(), world.end());
  want.push_back(byte_tok(0xE4));
  want.push_back(byte_tok(0xBD));
  EXPECT_EQ(ids, want);
}

TEST(TokenizerQwen3, RandomBytesNeverCrashAndRoundTrip) {
  const Tokenizer& t = qwen3();
  Rng rng(1234);
  for (int iter = 0; iter < 300; ++iter) {
    std::string x(rng.below(64), '\0');
    for (char& c : x) {
      // Mostly ASCII with a good share of high bytes and the occasional NUL.
      const uint64_t r = rng.below(10);
      c = char(r < 5 ? 0x20 + rng.below(95) : r < 9 ? 0x80 + rng.below(128) : rng.below(32));
    }
    std::vector<TokenId> ids;
    ASSERT_NO_THROW(ids = t.encode(x, true));
    EXPECT_EQ(t.decode(ids, true), expected_round_trip(x, true)) << utf8::escape(x);
  }
}

// ---------------------------------------------------------------------------
// Streaming decode

TEST(TokenizerQwen3, StreamDecoderHoldsSplitCharacters) {
  const Tokenizer& t = qwen3();
  const auto byte_tok = [&](unsigned char b) { return t.find_token(std::string(1, char(b))); };
  StreamDecoder s(t);
  // U+4F60 (你) = E4 BD A0, fed one byte token at a time.
  EXPECT_EQ(s.push(byte_tok(0xE4)), "");
  EXPECT_EQ(s.push(byte_tok(0xBD)), "");
  EXPECT_EQ(s.push(byte_tok(0xA0)), "\xE4\xBD\xA0");
  EXPECT_EQ(s.push(t.find_token("Hello")), "Hello");
  EXPECT_EQ(s.flush(), "");
  // A character that never completes comes out as U+FFFD at flush.
  EXPECT_EQ(s.push(byte_tok(0xF0)), "");
  EXPECT_EQ(s.push(byte_tok(0x9F)), "");
  EXPECT_EQ(s.flush(), "\xEF\xBF\xBD\xEF\xBF\xBD");
  // A lead byte followed by a non-continuation is released, replaced.
  EXPECT_EQ(s.push(byte_tok(0xE4)), "");
  EXPECT_EQ(s.push(t.find_token("a")), "\xEF\xBF\xBD" "a");
  // Control tokens are hidden unless asked for.
  EXPECT_EQ(s.push(t.find_token("<|im_end|>")), "");
  StreamDecoder shown(t, /*show_special=*/true);
  EXPECT_EQ(shown.push(t.find_token("<|im_end|>")), "<|im_end|>");
}

TEST(TokenizerQwen3, StreamDecoderEqualsDecodeOnCorpus) {
  const Tokenizer& t = qwen3();
  for (const auto& x : corpus()) {
    const auto ids = t.encode(x, true);
    StreamDecoder s(t, /*show_special=*/true);
    std::string streamed;
    for (TokenId id : ids) {
      const std::string chunk = s.push(id);
      EXPECT_TRUE(utf8::is_valid(chunk)) << utf8::escape(chunk);
      streamed += chunk;
    }
    streamed += s.flush();
    EXPECT_EQ(streamed, t.decode(ids, true)) << utf8::escape(x.substr(0, 80));
  }
}

TEST(TokenizerQwen3, DecodeRejectsOutOfRangeIds) {
  const Tokenizer& t = qwen3();
  EXPECT_THROW(t.decode({151669}), Error);
  EXPECT_THROW(t.decode({-1}), Error);
  EXPECT_FALSE(t.is_eog(-5));
}

// ---------------------------------------------------------------------------
// Pre-tokenizers and BPE on hand-made vocabularies

namespace {
std::vector<std::string> split(const std::string& pre, std::string_view text) {
  PreTokenizer p(pre);
  std::vector<std::string_view> v;
  p.split(text, v);
  return {v.begin(), v.end()};
}
}  // namespace

TEST(PreTokenizer, Qwen2SplitsDigitsOneByOne) {
  EXPECT_EQ(split("qwen2", "I'm 12345"), (std::vector<std::string>{"I", "'m", " ", "1", "2", "3", "4", "5"}));
  EXPECT_EQ(split("qwen2", "Hello world"), (std::vector<std::string>{"Hello", " world"}));
  EXPECT_EQ(split("qwen2", "a  \n\nb"), (std::vector<std::string>{"a", "  \n\n", "b"}));
  EXPECT_EQ(split("qwen2", "x   y"), (std::vector<std::string>{"x", "  ", " y"}));
  EXPECT_EQ(split("qwen2", "WE'RE"), (std::vector<std::string>{"WE", "'RE"}));
  EXPECT_EQ(split("qwen2", "$19.99!"), (std::vector<std::string>{"$", "1", "9", ".", "9", "9", "!"}));
}

TEST(PreTokenizer, LlamaBpeGroupsDigitsByThree) {
  EXPECT_EQ(split("llama-bpe", "I'm 12345"), (std::vector<std::string>{"I", "'m", " ", "123", "45"}));
  EXPECT_EQ(split("llama-bpe", "1234567"), (std::vector<std::string>{"123", "456", "7"}));
  EXPECT_EQ(split("llama-bpe", "٣٤٥٦"), (std::vector<std::string>{"٣٤٥", "٦"}));  // Unicode digits too
}

TEST(PreTokenizer, UnicodeClassesComeFromPcre2) {
  // \p{L} covers CJK and accents; a space-prefixed word keeps its space.
  EXPECT_EQ(split("qwen2", "你好 世界"), (std::vector<std::string>{"你好", " 世界"}));
  EXPECT_EQ(split("qwen2", "Привет, мир"), (std::vector<std::string>{"Привет", ",", " мир"}));
  // Emoji are neither letters nor numbers: grouped as punctuation-like runs.
  EXPECT_EQ(split("qwen2", "hi 😀😀"), (std::vector<std::string>{"hi", " 😀😀"}));
}

TEST(PreTokenizer, UnknownNameIsAClearError) {
  try {
    PreTokenizer p("gpt-4o");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported);
    EXPECT_NE(std::string(e.what()).find("qwen2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("llama-bpe"), std::string::npos) << e.what();
  }
}

TEST(TokenizerBpe, MergesByRankNotByPosition) {
  // "abc": the pair (b,c) has the better rank, so "a"+"bc", not "ab"+"c".
  const Tokenizer t = Tokenizer::from_data(tiny_vocab("qwen2", {"b c", "a b"}));
  EXPECT_EQ(t.encode("abc"), (std::vector<TokenId>{byte_id('a'), 256}));
  EXPECT_EQ(t.encode("ab"), (std::vector<TokenId>{257}));
  // Equal pairs merge left to right: "aaa" with a+a -> "aa" + "a".
  const Tokenizer t2 = Tokenizer::from_data(tiny_vocab("qwen2", {"a a"}));
  EXPECT_EQ(t2.encode("aaa"), (std::vector<TokenId>{256, byte_id('a')}));
  EXPECT_EQ(t2.encode("aaaa"), (std::vector<TokenId>{256, 256}));
}

TEST(TokenizerBpe, LlamaBpeDigitGroupsAndIgnoreMerges) {
  // Merges build "12" and "123"; "45" exists only as a whole vocabulary entry.
  const auto data = [](const std::string& pre) { return tiny_vocab(pre, {"1 2", "12 3"}, {"45"}); };
  const Tokenizer llama = Tokenizer::from_data(data("llama-bpe"));
  const Tokenizer qwen = Tokenizer::from_data(data("qwen2"));
  // llama-bpe: pieces "123", "45"; "45" is taken whole (ignore_merges) although no merge makes it.
  EXPECT_EQ(llama.encode("12345"), (std::vector<TokenId>{257, 258}));
  // qwen2: every digit is its own piece.
  EXPECT_EQ(qwen.encode("12345"),
            (std::vector<TokenId>{byte_id('1'), byte_id('2'), byte_id('3'), byte_id('4'), byte_id('5')}));
  EXPECT_EQ(llama.decode(llama.encode("12345")), "12345");
}

TEST(TokenizerBpe, SpaceIsEncodedAsGpt2Character) {
  // Merges are spelled in byte-to-unicode form: a space is "Ġ" (U+0120).
  const Tokenizer t = Tokenizer::from_data(tiny_vocab("qwen2", {"\xC4\xA0 w"}));
  EXPECT_EQ(t.encode(" w"), (std::vector<TokenId>{256}));
  EXPECT_EQ(t.piece(256), " w");
}

TEST(TokenizerBpe, RejectsInconsistentData) {
  auto expect_error = [](TokenizerData d, Errc code, const std::string& needle) {
    try {
      (void)Tokenizer::from_data(std::move(d));
      FAIL() << "expected an error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  TokenizerData d = tiny_vocab("qwen2", {});
  d.model = "llama";
  expect_error(d, Errc::unsupported, "tokenizer.ggml.model");
  d = tiny_vocab("qwen2", {});
  d.merges.push_back("x yz");
  expect_error(d, Errc::format, "tokenizer.ggml.merges");
  d = tiny_vocab("qwen2", {});
  d.types.assign(3, 1);
  expect_error(d, Errc::format, "tokenizer.ggml.token_type");
  d = tiny_vocab("qwen2", {});
  d.tokens.erase(d.tokens.begin() + 'q');
  expect_error(d, Errc::format, "byte");
  d = tiny_vocab("qwen2", {});
  d.eos = 9999;
  expect_error(d, Errc::format, "tokenizer.ggml.eos_token_id");
  d = tiny_vocab("gpt-4o", {});
  expect_error(d, Errc::unsupported, "tokenizer.ggml.pre");
}

// ---------------------------------------------------------------------------
// Hugging Face import

namespace {
std::string write_temp(const std::string& name, const std::string& text) {
  const auto dir = std::filesystem::temp_directory_path() / ("kvq_tok_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto p = dir / name;
  std::ofstream(p) << text;
  return p.string();
}
}  // namespace

TEST(HfImport, UnknownPreTokenizerIsAClearError) {
  // GPT-2's own pre-tokenizer (ByteLevel with its built-in regex) is not supported.
  const std::string path = write_temp("gpt2_tokenizer.json", R"({
    "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "normalizer": null, "added_tokens": []})");
  try {
    (void)load_hf_tokenizer(path);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported);
    EXPECT_NE(std::string(e.what()).find("supported: qwen2, llama-bpe"), std::string::npos) << e.what();
  }
}

TEST(HfImport, Qwen3TypesAndPadding) {
  TokenizerData d = load_hf_tokenizer(kvq::test::qwen3_json());
  EXPECT_EQ(d.pre, "qwen2");
  EXPECT_EQ(d.tokens.size(), 151669u);
  EXPECT_EQ(d.merges.size(), 151387u);
  EXPECT_EQ(d.merges[0], "\xC4\xA0 \xC4\xA0");  // "Ġ Ġ"
  EXPECT_EQ(d.types[151643], int32_t(TokenType::control));
  EXPECT_EQ(d.types[151667], int32_t(TokenType::user_defined));
  pad_vocab(d, 151936);
  EXPECT_EQ(d.tokens.size(), 151936u);
  EXPECT_EQ(d.tokens[151935], "[PAD151935]");
  EXPECT_EQ(d.types[151700], int32_t(TokenType::unused));
  EXPECT_THROW(pad_vocab(d, 100), Error);
  // Padding entries are never produced and hidden on display.
  const Tokenizer t = Tokenizer::from_data(d);
  EXPECT_EQ(t.vocab_size(), 151936);
  EXPECT_EQ(t.decode({151700}), "");
  EXPECT_EQ(t.encode("[PAD151700]"), qwen3().encode("[PAD151700]"));
}

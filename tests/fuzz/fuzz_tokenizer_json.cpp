// libFuzzer target: tokenizer.json import (`kvq tokenize --tokenizer-json`,
// `kvq synth --vocab`) on arbitrary bytes, then the tokenizer it builds on
// text. The input is the tokenizer.json text, optionally followed by a line
// "=====" and a tokenizer_config.json text. Any outcome other than success or
// kvq::Error (a crash, a sanitizer report, another exception such as
// nlohmann's, a timeout, a huge allocation) is a bug.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/error.hpp"
#include "tokenizer/hf_import.hpp"
#include "tokenizer/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const size_t sep = in.find("\n=====\n");
  const std::string_view json = in.substr(0, sep);
  const std::string config = sep == std::string_view::npos ? std::string() : std::string(in.substr(sep + 7));
  try {
    kvq::TokenizerData d = kvq::parse_hf_tokenizer(json, "fuzz.json", sep == std::string_view::npos ? nullptr : &config,
                                                   "fuzz_config.json");
    const kvq::Tokenizer t = kvq::Tokenizer::from_data(std::move(d));
    // Text from the input itself, and text with added-token, mark and space runs.
    for (std::string_view text : {json.substr(0, 4096), std::string_view("<|im_start|>user\ncafe\xcc\x81   x\r\n"),
                                  std::string_view("a\xcc\x81\xcc\x96\xcc\x81\xcc\x96\xcc\x81\xcc\x96 99 'll")}) {
      for (bool special : {false, true}) {
        const auto ids = t.encode(text, special);
        const std::string back = t.decode(ids, true);
        if (!t.normalizes_nfc() && back != text && !special) __builtin_trap();  // round trip must hold
        for (auto id : ids) (void)t.piece(id);
      }
    }
  } catch (const kvq::Error&) {
  }
  return 0;
}

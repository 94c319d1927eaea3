// Hugging Face tokenizer.json -> tokenizer.ggml.* (llama.cpp's conversion rules).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "tokenizer/vocab.hpp"

namespace kvq {
namespace gguf { class Writer; }

// Reads a byte-level BPE tokenizer.json (and, when it sits beside it,
// tokenizer_config.json for bos/eos/pad, add_bos_token and chat_template).
// The pre-tokenizer is recognised by its Split regex ("qwen2", "llama-bpe");
// an unknown one, or a merge mode that contradicts it, is an error. The
// normalizer is recorded as the file states it (null: "none"; NFC: "NFC";
// others are unsupported).
// Token types follow llama.cpp's converter: vocabulary entries are normal;
// added tokens are control when marked special or spelled <|...|>, else
// user-defined; ids not covered by either are unused "[PADn]" entries.
// Hostile files are refused with one-line Errc::format errors: files over
// kMaxTokenizerJsonBytes, JSON nested deeper than 64 levels, ids that are not
// integers in [0, kMaxTokenizerVocab) or leave most ids undefined, duplicate
// ids, fields of the wrong type, config tokens that are not in the vocabulary.
TokenizerData load_hf_tokenizer(const std::string& tokenizer_json_path);
// The same from the files' text (config_text: tokenizer_config.json, or null);
// the names are for messages. The fuzz target's entry point.
TokenizerData parse_hf_tokenizer(std::string_view json_text, const std::string& name,
                                 const std::string* config_text, const std::string& config_name);

// tokenizer.json files are about 10 MB (Qwen3 11 MB, Gemma 3 33 MB).
inline constexpr size_t kMaxTokenizerJsonBytes = size_t(128) << 20;
// Token ids kvq accepts from a file (the largest real vocabularies are ~262k).
inline constexpr int64_t kMaxTokenizerVocab = int64_t(1) << 22;

// Writes every tokenizer.ggml.* key (and tokenizer.chat_template when known).
void import_hf_tokenizer(const std::string& tokenizer_json_path, gguf::Writer& w);
// Same, padding the vocabulary with unused "[PADn]" tokens up to vocab_size
// (the model's embedding rows, e.g. 151936 for Qwen3); error if it is smaller.
void import_hf_tokenizer(const std::string& tokenizer_json_path, gguf::Writer& w, int vocab_size);

// Pads d.tokens/d.types with unused "[PADn]" entries up to vocab_size.
void pad_vocab(TokenizerData& d, int vocab_size);

}  // namespace kvq

// Hugging Face tokenizer.json -> tokenizer.ggml.* (llama.cpp's conversion rules).
#pragma once

#include <string>

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
TokenizerData load_hf_tokenizer(const std::string& tokenizer_json_path);

// Writes every tokenizer.ggml.* key (and tokenizer.chat_template when known).
void import_hf_tokenizer(const std::string& tokenizer_json_path, gguf::Writer& w);
// Same, padding the vocabulary with unused "[PADn]" tokens up to vocab_size
// (the model's embedding rows, e.g. 151936 for Qwen3); error if it is smaller.
void import_hf_tokenizer(const std::string& tokenizer_json_path, gguf::Writer& w, int vocab_size);

// Pads d.tokens/d.types with unused "[PADn]" entries up to vocab_size.
void pad_vocab(TokenizerData& d, int vocab_size);

}  // namespace kvq

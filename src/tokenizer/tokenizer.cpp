// Byte-level BPE as the Hugging Face `tokenizers` library does it:
//   1. added tokens are cut out of the raw text (leftmost, then longest match);
//   2. each remaining fragment is split into well-formed UTF-8 runs (ill-formed
//      bytes become their own byte tokens), normalized (NFC when the tokenizer's
//      normalizer says so) and
//      pre-tokenized by the model's regex;
//   3. each pre-token is BPE-merged by rank, starting from one symbol per byte.
#include "tokenizer/tokenizer.hpp"

#include <algorithm>
#include <mutex>
#include <queue>
#include <unordered_map>

#include "core/error.hpp"
#include "tokenizer/pretokenizer.hpp"
#include "tokenizer/unicode.hpp"
#include "tokenizer/vocab.hpp"

namespace kvq {
namespace {

// Texts that end a turn in the model families we support; llama.cpp applies
// the same list because GGUF files often record only one of them as eos.
constexpr const char* kEndOfGenerationTexts[] = {"<|im_end|>", "<|endoftext|>", "<|eot_id|>",
                                                 "<|end_of_text|>", "<|eom_id|>"};

// Pre-tokens longer than this are merged without caching: long runs (1000
// spaces, base64) are rarely repeated and would only evict useful entries.
constexpr size_t kMaxCachedPieceBytes = 64;
constexpr size_t kMaxCacheEntries = 1 << 16;

uint64_t pair_key(TokenId a, TokenId b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

}  // namespace

struct Tokenizer::Impl {
  TokenizerData data;
  PreTokenizer pre;
  std::vector<TokenType> types;
  std::vector<std::string> bytes;                  // id -> raw bytes of the token
  std::unordered_map<std::string, TokenId> bpe;    // raw bytes -> id, ordinary vocabulary only
  std::unordered_map<std::string, TokenId> any;    // raw bytes -> id, every token (find_token)
  TokenId byte_token[256];
  struct Merge {
    int32_t rank;
    TokenId result;
  };
  std::unordered_map<uint64_t, Merge> merges;
  // Added tokens that may be cut out of text, indexed by first byte, longest first.
  std::vector<TokenId> added_by_byte[256];
  std::vector<bool> is_eog;
  bool nfc = false;  // normalize to NFC before pre-tokenizing

  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<TokenId>> cache;

  explicit Impl(TokenizerData d) : data(std::move(d)), pre(data.pre) {}

  void build();
  // literal_before: see encode_with_literals; null when there are no literal spans.
  std::vector<TokenId> encode(std::string_view text, bool parse_special,
                              const std::vector<uint32_t>* literal_before) const;
  void encode_fragment(std::string_view text, std::vector<TokenId>& out) const;
  void encode_valid(std::string_view text, std::vector<TokenId>& out) const;
  void bpe_piece(std::string_view piece, std::vector<TokenId>& out) const;
  void merge(std::string_view piece, std::vector<TokenId>& out) const;
};

void Tokenizer::Impl::build() {
  KVQ_CHECK(data.model == "gpt2", Errc::unsupported, "tokenizer model '", data.model, "' (",
            tokenizer_keys::model, ") is not supported; kvq supports byte-level BPE ('gpt2')");
  if (data.normalizer.empty()) {
    nfc = pre.nfc();
  } else {
    KVQ_CHECK(data.normalizer == kNormalizerNfc || data.normalizer == kNormalizerNone, Errc::unsupported,
              tokenizer_keys::normalizer, " = '", data.normalizer, "' is not supported (use '", kNormalizerNfc,
              "' or '", kNormalizerNone, "')");
    nfc = data.normalizer == kNormalizerNfc;
  }
  const size_t n = data.tokens.size();
  KVQ_CHECK(n > 0, Errc::format, tokenizer_keys::tokens, " is empty");
  KVQ_CHECK(n < size_t(INT32_MAX), Errc::format, tokenizer_keys::tokens, " has too many entries (", n, ")");
  KVQ_CHECK(data.types.empty() || data.types.size() == n, Errc::format, tokenizer_keys::token_type, " has ",
            data.types.size(), " entries but ", tokenizer_keys::tokens, " has ", n);

  types.resize(n, TokenType::normal);
  bytes.resize(n);
  bpe.reserve(n);
  any.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (!data.types.empty()) {
      const int32_t t = data.types[i];
      KVQ_CHECK(t >= 0 && t <= 6, Errc::format, tokenizer_keys::token_type, "[", i, "] = ", t,
                " is not a known token type (0..6)");
      types[i] = TokenType(t);
    }
    const TokenId id = TokenId(i);
    if (types[i] == TokenType::normal) {
      // Ordinary entries are spelled in GPT-2's byte-to-unicode form.
      bytes[i] = byte_unicode::decode(data.tokens[i]);
      bpe.emplace(bytes[i], id);
    } else {
      // Added/control/unused entries are stored as plain text (llama.cpp convention).
      bytes[i] = data.tokens[i];
    }
    any.emplace(bytes[i], id);
  }

  for (int b = 0; b < 256; ++b) {
    auto it = bpe.find(std::string(1, char(b)));
    if (it == bpe.end())
      fail(Errc::format, "vocabulary has no byte-level token for byte 0x", std::hex, b,
           " (expected the single character U+", byte_unicode::byte_to_codepoint(uint8_t(b)),
           "); is this a byte-level BPE tokenizer?");
    byte_token[b] = it->second;
  }

  merges.reserve(data.merges.size() * 2);
  for (size_t r = 0; r < data.merges.size(); ++r) {
    const std::string& m = data.merges[r];
    const size_t sp = m.find(' ', 1);
    KVQ_CHECK(sp != std::string::npos && sp + 1 < m.size(), Errc::format, tokenizer_keys::merges, "[", r,
              "] = '", m, "' is not of the form 'left right'");
    const std::string left = byte_unicode::decode(std::string_view(m).substr(0, sp));
    const std::string right = byte_unicode::decode(std::string_view(m).substr(sp + 1));
    const auto l = bpe.find(left), rt = bpe.find(right), res = bpe.find(left + right);
    if (l == bpe.end() || rt == bpe.end() || res == bpe.end())
      fail(Errc::format, tokenizer_keys::merges, "[", r, "] = '", m,
           "' refers to a token that is not in the vocabulary");
    // The first (best-ranked) occurrence of a pair wins, as in HF.
    merges.emplace(pair_key(l->second, rt->second), Merge{int32_t(r), res->second});
  }

  auto check_id = [&](int32_t id, const char* key) {
    KVQ_CHECK(id >= -1 && id < int32_t(n), Errc::format, key, " = ", id, " is outside the vocabulary (",
              n, " tokens)");
  };
  check_id(data.bos, tokenizer_keys::bos_id);
  check_id(data.eos, tokenizer_keys::eos_id);
  check_id(data.eot, tokenizer_keys::eot_id);
  check_id(data.pad, tokenizer_keys::pad_id);

  for (size_t i = 0; i < n; ++i) {
    const TokenType t = types[i];
    if ((t == TokenType::control || t == TokenType::user_defined) && !bytes[i].empty())
      added_by_byte[static_cast<unsigned char>(bytes[i][0])].push_back(TokenId(i));
  }
  for (auto& v : added_by_byte)
    std::stable_sort(v.begin(), v.end(), [&](TokenId a, TokenId b) { return bytes[a].size() > bytes[b].size(); });

  is_eog.assign(n, false);
  for (int32_t id : {data.eos, data.eot})
    if (id >= 0) is_eog[id] = true;
  for (const char* text : kEndOfGenerationTexts) {
    auto it = any.find(text);
    if (it != any.end() && types[it->second] == TokenType::control) is_eog[it->second] = true;
  }
}

// Leftmost-longest search for added tokens (HF's Aho-Corasick semantics).
// Control tokens are eligible only with parse_special; user-defined ones always
// are, as in HF (encode_special_tokens) and llama.cpp (parse_special = false).
std::vector<TokenId> Tokenizer::encode(std::string_view text, bool parse_special) const {
  return impl_->encode(text, parse_special, nullptr);
}

std::vector<TokenId> Tokenizer::encode_with_literals(std::string_view text, const std::vector<TextSpan>& literal) const {
  // literal_before[i]: literal bytes in text[0, i), so a candidate [i, j)
  // overlaps literal text exactly when literal_before[j] > literal_before[i].
  std::vector<uint32_t> literal_before(text.size() + 1, 0);
  std::vector<uint8_t> is_literal(text.size(), 0);
  for (const TextSpan& s : literal) {
    KVQ_CHECK(s.begin <= s.end && s.end <= text.size(), Errc::internal, "literal span [", s.begin, ", ", s.end,
              ") outside a text of ", text.size(), " bytes");
    std::fill(is_literal.begin() + s.begin, is_literal.begin() + s.end, 1);
  }
  for (size_t i = 0; i < text.size(); ++i) literal_before[i + 1] = literal_before[i] + is_literal[i];
  return impl_->encode(text, true, &literal_before);
}

std::vector<TokenId> Tokenizer::Impl::encode(std::string_view text, bool parse_special,
                                             const std::vector<uint32_t>* literal_before) const {
  const Impl& m = *this;
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  size_t plain_start = 0;
  for (size_t i = 0; i < text.size();) {
    const auto& cands = m.added_by_byte[static_cast<unsigned char>(text[i])];
    TokenId hit = -1;
    for (TokenId id : cands) {
      const bool control = m.types[id] == TokenType::control;
      if (!parse_special && control) continue;
      const std::string& t = m.bytes[id];
      if (text.compare(i, t.size(), t) != 0) continue;
      if (control && literal_before && (*literal_before)[i + t.size()] != (*literal_before)[i]) continue;
      hit = id;
      break;
    }
    if (hit < 0) {
      ++i;
      continue;
    }
    m.encode_fragment(text.substr(plain_start, i - plain_start), out);
    out.push_back(hit);
    i += m.bytes[hit].size();
    plain_start = i;
  }
  m.encode_fragment(text.substr(plain_start), out);
  return out;
}

// Ill-formed UTF-8 cannot be normalized or matched by the regex: each such byte
// becomes its own byte token and the well-formed runs around it are tokenized
// normally. So any byte string round-trips through decode.
void Tokenizer::Impl::encode_fragment(std::string_view text, std::vector<TokenId>& out) const {
  size_t run = 0;
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    const size_t len = utf8::sequence_length(text, i);
    if (len > 0) {
      i += len;
      continue;
    }
    encode_valid(text.substr(run, i - run), out);
    out.push_back(byte_token[c]);
    run = ++i;
  }
  encode_valid(text.substr(run), out);
}

void Tokenizer::Impl::encode_valid(std::string_view text, std::vector<TokenId>& out) const {
  if (text.empty()) return;
  std::string normalized;
  if (nfc) {
    normalized = utf8::nfc(text);
    text = normalized;
  }
  std::vector<std::string_view> pieces;
  pre.split(text, pieces);
  for (std::string_view p : pieces) bpe_piece(p, out);
}

void Tokenizer::Impl::bpe_piece(std::string_view piece, std::vector<TokenId>& out) const {
  if (piece.size() == 1) {
    out.push_back(byte_token[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (pre.ignore_merges()) {
    auto it = bpe.find(std::string(piece));
    if (it != bpe.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (piece.size() > kMaxCachedPieceBytes) {
    merge(piece, out);
    return;
  }
  std::string key(piece);
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t before = out.size();
  merge(piece, out);
  std::vector<TokenId> ids(out.begin() + before, out.end());
  std::lock_guard<std::mutex> lock(cache_mu);
  if (cache.size() >= kMaxCacheEntries) cache.clear();
  cache.emplace(std::move(key), std::move(ids));
}

// Rank-ordered merging over a linked list of symbols with a min-heap of
// candidate pairs keyed by (rank, position): the best-ranked pair merges first,
// and equal pairs merge left to right, exactly like HF's BPE word merge.
void Tokenizer::Impl::merge(std::string_view piece, std::vector<TokenId>& out) const {
  struct Sym {
    TokenId id;
    int prev, next;
  };
  const int n = int(piece.size());
  std::vector<Sym> sym(n);
  for (int i = 0; i < n; ++i) sym[i] = {byte_token[static_cast<unsigned char>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1};

  struct Cand {
    int32_t rank;
    int pos;
    TokenId left, right, result;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int pos) {
    if (pos < 0) return;
    const int nx = sym[pos].next;
    if (nx < 0) return;
    auto it = merges.find(pair_key(sym[pos].id, sym[nx].id));
    if (it != merges.end()) heap.push({it->second.rank, pos, sym[pos].id, sym[nx].id, it->second.result});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);

  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Sym& s = sym[c.pos];
    // Stale candidates (a side already merged away) no longer match the list.
    if (s.id != c.left || s.next < 0 || sym[s.next].id != c.right) continue;
    const int gone = s.next;
    s.id = c.result;
    s.next = sym[gone].next;
    if (s.next >= 0) sym[s.next].prev = c.pos;
    sym[gone].id = -1;
    push(s.prev);
    push(c.pos);
  }
  for (int i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
}

// ---------------------------------------------------------------------------

Tokenizer::Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_data(TokenizerData data) {
  Tokenizer t;
  t.impl_ = std::make_unique<Impl>(std::move(data));
  t.impl_->build();
  return t;
}

std::string Tokenizer::decode(const std::vector<TokenId>& ids, bool show_special) const {
  std::string out;
  for (TokenId id : ids) {
    if (!show_special && !is_displayed(id)) continue;
    out += bytes_of(id);
  }
  return out;
}

const std::string& Tokenizer::bytes_of(TokenId id) const {
  KVQ_CHECK(id >= 0 && id < vocab_size(), Errc::out_of_range, "token id ", id, " is outside the vocabulary (",
            vocab_size(), " tokens)");
  return impl_->bytes[id];
}

std::string Tokenizer::piece(TokenId id) const { return bytes_of(id); }

bool Tokenizer::is_displayed(TokenId id) const {
  const TokenType t = type(id);
  return t == TokenType::normal || t == TokenType::user_defined || t == TokenType::byte;
}

TokenType Tokenizer::type(TokenId id) const {
  KVQ_CHECK(id >= 0 && id < vocab_size(), Errc::out_of_range, "token id ", id, " is outside the vocabulary (",
            vocab_size(), " tokens)");
  return impl_->types[id];
}

int Tokenizer::vocab_size() const { return int(impl_->bytes.size()); }
bool Tokenizer::is_control(TokenId id) const { return type(id) == TokenType::control; }
bool Tokenizer::is_eog(TokenId id) const { return id >= 0 && id < vocab_size() && impl_->is_eog[id]; }
std::vector<TokenId> Tokenizer::eog_ids() const {
  std::vector<TokenId> ids;
  for (size_t i = 0; i < impl_->is_eog.size(); ++i)
    if (impl_->is_eog[i]) ids.push_back(TokenId(i));
  return ids;
}
TokenId Tokenizer::bos() const { return impl_->data.bos; }
TokenId Tokenizer::eos() const { return impl_->data.eos; }
TokenId Tokenizer::eot() const { return impl_->data.eot; }
TokenId Tokenizer::pad() const { return impl_->data.pad; }
bool Tokenizer::add_bos() const { return impl_->data.add_bos; }
const std::string& Tokenizer::pre() const { return impl_->data.pre; }
const std::string& Tokenizer::chat_template() const { return impl_->data.chat_template; }
const TokenizerData& Tokenizer::data() const { return impl_->data; }
bool Tokenizer::normalizes_nfc() const { return impl_->nfc; }

TokenId Tokenizer::find_token(std::string_view text) const {
  auto it = impl_->any.find(std::string(text));
  return it == impl_->any.end() ? -1 : it->second;
}

// ---------------------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool show_special) : tok_(&tok), show_special_(show_special) {}

std::string StreamDecoder::push(TokenId id) {
  if (!show_special_ && !tok_->is_displayed(id)) return {};
  pending_ += tok_->bytes_of(id);
  const size_t n = utf8::complete_prefix(pending_);
  std::string out = utf8::sanitize(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8::sanitize(pending_);
  pending_.clear();
  return out;
}

}  // namespace kvq

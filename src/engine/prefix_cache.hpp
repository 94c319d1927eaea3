// Automatic prefix caching (issue 26, item 4; docs/architecture.md,
// "Scheduler"): full KV pages kept after the sequences that wrote them are
// gone, found again by any later sequence whose tokens start the same way.
//
// A cached page is a node of a tree: its key is (its parent node, the
// page_tokens token ids it holds), so a node stands for every token from the
// start of the sequence to the end of its page, and a lookup walks the tree
// page by page from the root. Keys compare the token ids themselves (a hash
// only picks the bucket), so two prefixes never share a page by collision.
//
// One cache serves one store, so the codec is part of the key implicitly
// (the server runs one codec per process). The cache holds one reference to
// each of its pages in the pool; a page that only the cache holds is idle
// and may be evicted: least recently used first, and only pages with no
// cached child (leaves), so a chain is taken back from its end and its
// start, the part most prompts share, stays longest.
//
// The KV rows of a page depend only on its tokens and those before it (a
// token's K/V is its own projection at its position), so a sequence that
// adopts cached pages computes what it would have computed itself; on the
// CPU backend bit for bit, on CUDA up to the order of float sums (prefill
// and decode kernels differ).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "kv/page_pool.hpp"
#include "engine/sampler.hpp"  // TokenId

namespace kvq {

class PrefixCache {
 public:
  using NodeId = uint64_t;  // 0 is the root (no page)

  PrefixCache(kv::PagePool& pool, int page_tokens);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  struct Match {
    std::vector<NodeId> nodes;   // one per matched page, in token order
    std::vector<int32_t> pages;  // the pages (not retained: the caller retains what it keeps)
    int tokens(int page_tokens) const { return int(pages.size()) * page_tokens; }
  };
  // The longest run of cached pages that holds tokens[0, n_pages * page_tokens)
  // from the start, at most max_pages; marks them used now. `tokens` must
  // hold max_pages * page_tokens ids.
  Match match(const TokenId* tokens, int max_pages);

  // Page `page` holds the page_tokens ids at `tokens`, after the prefix that
  // `parent` stands for (0: the sequence's first page). Returns the node of
  // that content: an existing one (the cache keeps its own page; `page`
  // stays the caller's alone) or a new one that retains `page`.
  NodeId insert(NodeId parent, const TokenId* tokens, int32_t page);
  // The page a node holds.
  int32_t page(NodeId id) const;

  // Pages only the cache holds (counted by the pool as references change:
  // read every step for the metrics, so never a walk over the cache).
  int idle_pages() const;
  // Idle pages that evict() can take: those with no page below them in the
  // tree that a sequence holds. (A sequence that prefilled a page the cache
  // already had keeps its own copy, and its later pages chain under the
  // cached one, which then stays while they are held.)
  int evictable_pages() const;
  // Gives back up to `pages` idle pages to the pool, least recently used
  // leaves first; returns how many it freed.
  int evict(int pages);
  // Gives back every page the cache holds (sequences keep theirs).
  void clear();

  int cached_pages() const { return int(nodes_.size()); }
  int page_tokens() const { return page_tokens_; }

 private:
  struct Node {
    NodeId parent = 0;
    int32_t page = -1;
    int children = 0;  // cached children
    uint64_t used = 0;  // the clock of the last match or insert
    std::vector<TokenId> tokens;
  };
  struct Key {
    NodeId parent;
    const TokenId* tokens;  // page_tokens ids (a node's own tokens once stored)
  };
  struct KeyHash {
    int n;
    size_t operator()(const Key& k) const;
  };
  struct KeyEq {
    int n;
    bool operator()(const Key& a, const Key& b) const;
  };

  NodeId find(NodeId parent, const TokenId* tokens) const;
  void drop(NodeId id);

  kv::PagePool* pool_;
  int page_tokens_;
  uint64_t clock_ = 0;
  NodeId next_id_ = 1;
  std::unordered_map<NodeId, Node> nodes_;
  std::unordered_map<Key, NodeId, KeyHash, KeyEq> index_;
};

}  // namespace kvq

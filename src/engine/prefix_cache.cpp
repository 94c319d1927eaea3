#include "engine/prefix_cache.hpp"

#include <algorithm>
#include <queue>
#include <unordered_set>

#include "core/error.hpp"

namespace kvq {

size_t PrefixCache::KeyHash::operator()(const Key& k) const {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ k.parent;  // FNV-1a over the ids, seeded by the parent
  for (int i = 0; i < n; ++i) h = (h ^ uint32_t(k.tokens[i])) * 0x100000001b3ull;
  return size_t(h ^ (h >> 29));
}

bool PrefixCache::KeyEq::operator()(const Key& a, const Key& b) const {
  return a.parent == b.parent && std::equal(a.tokens, a.tokens + n, b.tokens);
}

PrefixCache::PrefixCache(kv::PagePool& pool, int page_tokens)
    : pool_(&pool), page_tokens_(page_tokens), index_(64, KeyHash{page_tokens}, KeyEq{page_tokens}) {
  KVQ_CHECK(page_tokens > 0, Errc::invalid_argument, "prefix cache page size must be positive, not ", page_tokens);
}

PrefixCache::~PrefixCache() { clear(); }

PrefixCache::NodeId PrefixCache::find(NodeId parent, const TokenId* tokens) const {
  const auto it = index_.find(Key{parent, tokens});
  return it == index_.end() ? 0 : it->second;
}

PrefixCache::Match PrefixCache::match(const TokenId* tokens, int max_pages) {
  Match m;
  NodeId parent = 0;
  for (int p = 0; p < max_pages; ++p) {
    const NodeId id = find(parent, tokens + size_t(p) * size_t(page_tokens_));
    if (id == 0) break;
    Node& n = nodes_.at(id);
    n.used = ++clock_;
    m.nodes.push_back(id);
    m.pages.push_back(n.page);
    parent = id;
  }
  return m;
}

PrefixCache::NodeId PrefixCache::insert(NodeId parent, const TokenId* tokens, int32_t page) {
  KVQ_CHECK(parent == 0 || nodes_.count(parent), Errc::internal, "prefix cache: insert under unknown node ", parent);
  if (const NodeId id = find(parent, tokens)) {
    nodes_.at(id).used = ++clock_;
    return id;
  }
  pool_->retain(page);
  pool_->set_cached(page, true);
  const NodeId id = next_id_++;
  Node& n = nodes_[id];
  n.parent = parent;
  n.page = page;
  n.used = ++clock_;
  n.tokens.assign(tokens, tokens + page_tokens_);
  index_.emplace(Key{parent, n.tokens.data()}, id);
  if (parent) ++nodes_.at(parent).children;
  return id;
}

int32_t PrefixCache::page(NodeId id) const {
  const auto it = nodes_.find(id);
  KVQ_CHECK(it != nodes_.end(), Errc::internal, "prefix cache: no node ", id);
  return it->second.page;
}

int PrefixCache::idle_pages() const { return pool_->idle_cached(); }

int PrefixCache::evictable_pages() const {
  std::unordered_set<NodeId> blocked;  // ancestors of a held page
  for (const auto& [id, node] : nodes_)
    if (pool_->refs(node.page) > 1)
      for (NodeId p = node.parent; p && blocked.insert(p).second;) p = nodes_.at(p).parent;
  int n = 0;
  for (const auto& [id, node] : nodes_) n += pool_->refs(node.page) == 1 && !blocked.count(id);
  return n;
}

void PrefixCache::drop(NodeId id) {
  auto it = nodes_.find(id);
  Node& n = it->second;
  index_.erase(Key{n.parent, n.tokens.data()});
  if (n.parent) {
    auto p = nodes_.find(n.parent);
    if (p != nodes_.end()) --p->second.children;
  }
  pool_->set_cached(n.page, false);
  pool_->release(n.page);
  nodes_.erase(it);
}

int PrefixCache::evict(int pages) {
  if (pages <= 0) return 0;
  // Idle leaves by last use, oldest on top; a parent joins when its last
  // cached child goes.
  using Entry = std::pair<uint64_t, NodeId>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  auto idle_leaf = [&](const Node& n) { return n.children == 0 && pool_->refs(n.page) == 1; };
  for (const auto& [id, node] : nodes_)
    if (idle_leaf(node)) heap.emplace(node.used, id);
  int freed = 0;
  while (freed < pages && !heap.empty()) {
    const NodeId id = heap.top().second;
    heap.pop();
    const NodeId parent = nodes_.at(id).parent;
    drop(id);
    ++freed;
    if (parent) {
      const auto p = nodes_.find(parent);
      if (p != nodes_.end() && idle_leaf(p->second)) heap.emplace(p->second.used, parent);
    }
  }
  return freed;
}

void PrefixCache::clear() {
  for (auto& [id, node] : nodes_) {
    pool_->set_cached(node.page, false);
    pool_->release(node.page);
  }
  nodes_.clear();
  index_.clear();
}

}  // namespace kvq

// Host emulator of the tensor-core prefill attention kernel
// (src/backend/cuda/attention_prefill.cu), for checking it on a machine
// without a GPU. run.sh extracts the kernel source (everything but the inline
// PTX helpers) and compiles it here against emulated helpers:
//  - CUDA threads are fibers (a 6-register x86-64 context switch); a CTA runs
//    its 128 threads round-robin, __syncthreads and the warp collectives are
//    barriers that also check every thread reached the SAME collective
//    (a mismatch or deadlock aborts);
//  - ldmatrix (.trans), mma.m16n8k16 bf16 and shfl follow the PTX fragment
//    definitions (A: a0..a7 rows gid / gid+8, cols 2tig / +8; B: k 2tig / +8,
//    n gid; C: rows gid / gid+8, cols 2tig); ldmatrix rows are also checked
//    for shared-memory bank conflicts;
//  - cp.async lands at cp.async.wait_group (late: a missing wait reads stale
//    data) or, with `eager`, at issue (a stage refilled while another warp
//    still reads it shows up); K/V reads outside the cache abort;
//  - shared memory starts as bf16 NaN.
// Outputs are compared with fp64 references under the bounds of
// tests/gpu/prefill_test_util.hpp.
//   dev/prefill_emu/run.sh            odd shapes + a diagonal-offset sweep, both cp.async modes
//   ./emu [late|eager] big            the heavier GPU-test shapes (pos 1000, n 300; ~20 s)
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <functional>
#include <algorithm>
#include <random>
#include <vector>
#include "core/half.hpp"

// ---------------- fibers
extern "C" void emu_switch(void** save_sp, void* new_sp);
asm(R"(
.text
.globl emu_switch
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
)");
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
static Dim3 g_blockIdx, g_gridDim, g_blockDim;
struct Copy { uint32_t dst; const void* src; int bytes; };
struct Fiber {
  void* sp = nullptr;
  std::vector<char> stack;
  bool done = false;
  std::vector<Copy> open;
  std::deque<std::vector<Copy>> groups;
};
static std::vector<Fiber> g_fib;
static void* g_sched_sp;
static int g_cur;
static std::function<void()> g_body;
static long g_progress;
static void yield_fiber() { emu_switch(&g_fib[g_cur].sp, g_sched_sp); }
static void trampoline() {
  g_body();
  g_fib[g_cur].done = true;
  ++g_progress;
  emu_switch(&g_fib[g_cur].sp, g_sched_sp);
  abort();
}
static void run_block(int nthreads) {
  g_fib.assign(nthreads, Fiber{});
  for (auto& f : g_fib) {
    f.stack.resize(1 << 18);
    uintptr_t top = (uintptr_t(f.stack.data()) + f.stack.size()) & ~uintptr_t(15);
    void** s = (void**)top;
    *--s = nullptr;               // fake return address of trampoline
    *--s = (void*)&trampoline;    // ret target
    for (int i = 0; i < 6; ++i) *--s = nullptr;
    f.sp = s;
  }
  for (;;) {
    bool all = true;
    const long before = g_progress;
    for (int i = 0; i < nthreads; ++i) {
      if (g_fib[i].done) continue;
      all = false;
      g_cur = i;
      emu_switch(&g_sched_sp, g_fib[i].sp);
    }
    if (all) break;
    if (g_progress == before) { fprintf(stderr, "DEADLOCK (mismatched barriers)\n"); exit(2); }
  }
}
struct Barrier { int count = 0; long gen = 0; int tag = -1; };
static Barrier g_cta_bar, g_warp_bar[32];
static void bar_wait(Barrier& b, int expected, int tag) {
  if (b.count == 0) b.tag = tag;
  if (b.tag != tag) { fprintf(stderr, "MISMATCHED collective (tag %d vs %d)\n", b.tag, tag); exit(3); }
  const long gen = b.gen;
  if (++b.count == expected) { b.count = 0; ++b.gen; ++g_progress; return; }
  while (b.gen == gen) yield_fiber();
}

// ---------------- CUDA surface
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(a, b)
#define __restrict__
#define __shared__
struct Idx { unsigned x, y, z; };
static inline Idx emu_tid() { return Idx{unsigned(g_cur), 0, 0}; }
#define threadIdx emu_tid()
#define blockIdx g_blockIdx
#define gridDim g_gridDim
#define blockDim g_blockDim
struct alignas(16) uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
static inline void __syncthreads() { bar_wait(g_cta_bar, int(g_blockDim.x), 1000); }

namespace emu {
constexpr size_t kSmemCap = 100 * 1024;
uint4 smem_raw[kSmemCap / 16];
size_t g_smem_bytes;  // the kernel's declared dynamic smem
const uint16_t *g_k_lo, *g_k_hi, *g_v_lo, *g_v_hi;
long g_bank_conflicts, g_ldmatrix;
bool g_eager = false;
using std::min;

struct WarpX { uint32_t in_addr[32]; uint32_t a[32][4]; uint32_t b[32][2]; float f[32]; uint32_t out[32][4]; float dout[32][4]; float fout[32]; };
WarpX g_x[4];
static inline int lane() { return g_cur & 31; }
static inline int warp() { return g_cur >> 5; }
static inline const uint16_t* sm16() { return reinterpret_cast<const uint16_t*>(smem_raw); }

static inline float __shfl_xor_sync(unsigned mask, float v, int m) {
  assert(mask == 0xffffffffu);
  WarpX& x = g_x[warp()];
  x.f[lane()] = v;
  // last arriver fills the outputs
  Barrier& b = g_warp_bar[warp()];
  if (b.count == 31) for (int l = 0; l < 32; ++l) x.fout[l] = x.f[l ^ m];
  bar_wait(b, 32, 10 + m);
  return x.fout[lane()];
}
inline uint32_t smem_u32(const void* p) {
  const ptrdiff_t off = reinterpret_cast<const char*>(p) - reinterpret_cast<const char*>(smem_raw);
  assert(off >= 0 && size_t(off) < g_smem_bytes);
  return uint32_t(off);
}
inline void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  assert(dst % 16 == 0 && dst + 16 <= g_smem_bytes);
  assert(src_bytes == 0 || src_bytes == 16);
  if (src_bytes == 16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    const bool in_k = s >= g_k_lo && s + 8 <= g_k_hi, in_v = s >= g_v_lo && s + 8 <= g_v_hi;
    if (!in_k && !in_v) { fprintf(stderr, "cp.async reads outside the K/V cache\n"); exit(4); }
    if (uintptr_t(src) % 16 != 0) { fprintf(stderr, "cp.async from an unaligned address\n"); exit(5); }
  }
  if (g_eager) {  // lands at once: exposes a stage overwritten while other warps still read it
    char* d = reinterpret_cast<char*>(smem_raw) + dst;
    if (src_bytes) std::memcpy(d, src, 16); else std::memset(d, 0, 16);
    return;
  }
  g_fib[g_cur].open.push_back({dst, src, src_bytes});
}
inline void cp_async_commit() {
  auto& f = g_fib[g_cur];
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}
template <int kPending>
inline void cp_async_wait() {
  auto& f = g_fib[g_cur];
  while (int(f.groups.size()) > kPending) {
    for (const Copy& c : f.groups.front()) {
      char* d = reinterpret_cast<char*>(smem_raw) + c.dst;
      if (c.bytes) std::memcpy(d, c.src, 16); else std::memset(d, 0, 16);
    }
    f.groups.pop_front();
  }
}
static void ldm(uint32_t addr, uint32_t (&r)[4], bool trans) {
  assert(addr % 16 == 0 && addr + 16 <= g_smem_bytes);
  WarpX& x = g_x[warp()];
  x.in_addr[lane()] = addr;
  Barrier& b = g_warp_bar[warp()];
  if (b.count == 31) {
    const uint16_t* s = sm16();
    for (int i = 0; i < 4; ++i) {
      bool used[8] = {};
      for (int rr = 0; rr < 8; ++rr) {
        const int grp = (x.in_addr[8 * i + rr] / 16) % 8;
        if (used[grp]) ++g_bank_conflicts;
        used[grp] = true;
      }
      ++g_ldmatrix;
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      for (int i = 0; i < 4; ++i) {
        uint16_t e0, e1;
        if (!trans) {
          const uint32_t base = x.in_addr[8 * i + g] / 2;
          e0 = s[base + 2 * t];
          e1 = s[base + 2 * t + 1];
        } else {
          e0 = s[x.in_addr[8 * i + 2 * t] / 2 + g];
          e1 = s[x.in_addr[8 * i + 2 * t + 1] / 2 + g];
        }
        x.out[l][i] = uint32_t(e0) | (uint32_t(e1) << 16);
      }
    }
  }
  bar_wait(b, 32, trans ? 21 : 20);
  for (int i = 0; i < 4; ++i) r[i] = x.out[lane()][i];
}
inline void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) { ldm(addr, r, false); }
inline void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) { ldm(addr, r, true); }
static inline float lo_bf(uint32_t u) { return kvq::bf16_to_f32(uint16_t(u & 0xffff)); }
static inline float hi_bf(uint32_t u) { return kvq::bf16_to_f32(uint16_t(u >> 16)); }
inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  WarpX& x = g_x[warp()];
  const int me = lane();
  for (int i = 0; i < 4; ++i) x.a[me][i] = a[i];
  x.b[me][0] = b0;
  x.b[me][1] = b1;
  for (int j = 0; j < 4; ++j) x.dout[me][j] = d[j];
  Barrier& b = g_warp_bar[warp()];
  if (b.count == 31) {
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      A[g][2 * t] = lo_bf(x.a[l][0]); A[g][2 * t + 1] = hi_bf(x.a[l][0]);
      A[g + 8][2 * t] = lo_bf(x.a[l][1]); A[g + 8][2 * t + 1] = hi_bf(x.a[l][1]);
      A[g][2 * t + 8] = lo_bf(x.a[l][2]); A[g][2 * t + 9] = hi_bf(x.a[l][2]);
      A[g + 8][2 * t + 8] = lo_bf(x.a[l][3]); A[g + 8][2 * t + 9] = hi_bf(x.a[l][3]);
      B[2 * t][g] = lo_bf(x.b[l][0]); B[2 * t + 1][g] = hi_bf(x.b[l][0]);
      B[2 * t + 8][g] = lo_bf(x.b[l][1]); B[2 * t + 9][g] = hi_bf(x.b[l][1]);
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      for (int j = 0; j < 4; ++j) {
        const int row = g + (j >= 2 ? 8 : 0), col = 2 * t + (j & 1);
        float acc = x.dout[l][j];
        for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
        x.dout[l][j] = acc;
      }
    }
  }
  bar_wait(b, 32, 30);
  for (int j = 0; j < 4; ++j) d[j] = x.dout[me][j];
}
inline uint32_t pack_bf16(float lo, float hi) {
  return uint32_t(kvq::f32_to_bf16(lo)) | (uint32_t(kvq::f32_to_bf16(hi)) << 16);
}
inline float fast_exp2(float x) { return std::exp2(x); }

#include "kernel_body.inc"

// ---------------- driver
struct Case { int n_kv, G, D, pos, n, splits, slack; };

template <int D>
int run_case(const Case& c, unsigned seed) {
  using T = Tile<D>;
  constexpr int K = T::kKeys;
  std::mt19937 rng(seed);
  std::normal_distribution<float> N01(0.f, 1.f);
  const int n_heads = c.n_kv * c.G, total = c.pos + c.n, max_tokens = total + c.slack;
  std::vector<float> k(size_t(total) * c.n_kv * D), v(k.size()), q(size_t(c.n) * n_heads * D);
  for (size_t i = 0; i < k.size(); ++i) k[i] = N01(rng) + ((i % (c.n_kv * D)) % 3 == 0 ? 1.5f : 0.f);
  for (auto& x : v) x = N01(rng);
  for (auto& x : q) x = 2.f * N01(rng);
  std::vector<uint16_t> kc(size_t(c.n_kv) * max_tokens * D, 0x477f), vc(kc.size(), 0x477f);  // 65504 poison
  for (int t = 0; t < total; ++t)
    for (int h = 0; h < c.n_kv; ++h)
      for (int d = 0; d < D; ++d) {
        kc[(size_t(h) * max_tokens + t) * D + d] = kvq::f32_to_bf16(k[(size_t(t) * c.n_kv + h) * D + d]);
        vc[(size_t(h) * max_tokens + t) * D + d] = kvq::f32_to_bf16(v[(size_t(t) * c.n_kv + h) * D + d]);
      }
  g_k_lo = kc.data(); g_k_hi = kc.data() + kc.size(); g_v_lo = vc.data(); g_v_hi = vc.data() + vc.size();
  const float scale = 1.f / std::sqrt(float(D));
  // --- mirror of launch_prefill()
  const int G = c.G, Tq = kRows / G, q_tiles = (c.n + Tq - 1) / Tq;
  const int len = c.pos + c.n, len_tiles = (len + K - 1) / K;
  int n_chunks = c.splits > 0 ? std::min(c.splits, len_tiles) : 1;
  const int chunk_tiles = (len_tiles + n_chunks - 1) / n_chunks;
  n_chunks = (len_tiles + chunk_tiles - 1) / chunk_tiles;
  std::vector<float> out(q.size(), NAN);
  const size_t rows = size_t(c.n) * n_heads;
  std::vector<float> part(n_chunks > 1 ? rows * n_chunks * (D + 2) : 0, NAN);
  Params p{};
  p.k = kc.data(); p.v = vc.data(); p.q = q.data(); p.out = out.data();
  p.pos = c.pos; p.n = c.n; p.n_heads = n_heads; p.G = G; p.Tq = Tq; p.max_tokens = max_tokens;
  p.chunk_len = chunk_tiles * K; p.n_chunks = n_chunks; p.q_factor = scale * 1.44269504088896340736f;
  if (n_chunks > 1) { p.part_m = part.data(); p.part_l = p.part_m + rows * n_chunks; p.part_o = p.part_l + rows * n_chunks; }
  g_smem_bytes = T::kSmemBytes;
  assert(g_smem_bytes <= kSmemCap);
  g_gridDim = Dim3{unsigned(c.n_kv), unsigned(q_tiles), unsigned(n_chunks)};
  g_blockDim = Dim3{unsigned(kThreads), 1, 1};
  for (unsigned z = 0; z < g_gridDim.z; ++z)
    for (unsigned y = 0; y < g_gridDim.y; ++y)
      for (unsigned x = 0; x < g_gridDim.x; ++x) {
        g_blockIdx = Dim3{x, y, z};
        std::memset(smem_raw, 0xff, sizeof smem_raw);  // bf16 NaN everywhere
        g_body = [&] { prefill_attn_kernel<D>(p); };
        run_block(kThreads);
      }
  if (n_chunks > 1) {
    g_gridDim = Dim3{unsigned(rows), 1, 1};
    g_blockDim = Dim3{unsigned(std::min(D, 128)), 1, 1};
    for (unsigned x = 0; x < rows; ++x) {
      g_blockIdx = Dim3{x, 0, 0};
      g_body = [&] { merge_kernel(p.part_m, p.part_l, p.part_o, n_chunks, D, out.data()); };
      run_block(int(g_blockDim.x));
    }
  }
  // --- references (fp64): bf16 queries (log2 units) and fp32 queries
  int bad = 0;
  double worst1 = 0, worst2 = 0;
  const double u = 1.0 / 256;
  std::vector<double> vmax(c.n_kv, 0), knorm(c.n_kv, 0);
  for (int h = 0; h < c.n_kv; ++h)
    for (int t = 0; t < total; ++t) {
      double n2 = 0;
      for (int d = 0; d < D; ++d) {
        const double kb = kvq::bf16_to_f32(kc[(size_t(h) * max_tokens + t) * D + d]);
        n2 += kb * kb;
        vmax[h] = std::max(vmax[h], double(std::fabs(kvq::bf16_to_f32(vc[(size_t(h) * max_tokens + t) * D + d]))));
      }
      knorm[h] = std::max(knorm[h], std::sqrt(n2));
    }
  for (int t = 0; t < c.n; ++t)
    for (int hq = 0; hq < n_heads; ++hq) {
      const int h = hq / G, T_ = c.pos + t + 1;
      const float* qv = &q[(size_t(t) * n_heads + hq) * D];
      std::vector<double> s1(T_), s2(T_);
      double m1 = -1e300, m2 = -1e300, qn = 0;
      for (int d = 0; d < D; ++d) qn += double(qv[d]) * qv[d];
      qn = std::sqrt(qn);
      for (int j = 0; j < T_; ++j) {
        double a = 0, b = 0;
        for (int d = 0; d < D; ++d) {
          const double kb = kvq::bf16_to_f32(kc[(size_t(h) * max_tokens + j) * D + d]);
          a += double(kvq::bf16_to_f32(kvq::f32_to_bf16(qv[d] * p.q_factor))) * kb;
          b += double(qv[d]) * kb;
        }
        s1[j] = a * std::log(2.0);
        s2[j] = b * scale;
        m1 = std::max(m1, s1[j]);
        m2 = std::max(m2, s2[j]);
      }
      double l1 = 0, l2 = 0;
      for (int j = 0; j < T_; ++j) { l1 += (s1[j] = std::exp(s1[j] - m1)); l2 += (s2[j] = std::exp(s2[j] - m2)); }
      const double E = u * scale * qn * knorm[h];
      for (int d = 0; d < D; ++d) {
        double r1 = 0, r2 = 0;
        for (int j = 0; j < T_; ++j) {
          const double vb = kvq::bf16_to_f32(vc[(size_t(h) * max_tokens + j) * D + d]);
          r1 += s1[j] / l1 * vb;
          r2 += s2[j] / l2 * vb;
        }
        const float y = out[(size_t(t) * n_heads + hq) * D + d];
        const double e1 = std::fabs(y - r1), e2 = std::fabs(y - r2);
        const double b1 = 1e-4 + 1e-4 * std::fabs(r1) + u * vmax[h];
        const double b2 = 1e-4 + 1e-4 * std::fabs(r2) + vmax[h] * (u + std::expm1(2 * E));
        if (!std::isfinite(y) || e1 > b1 || e2 > b2) {
          if (bad++ < 5) printf("  BAD t %d head %d d %d: got %g ref_bf16q %g ref %g\n", t, hq, d, y, r1, r2);
        }
        worst1 = std::max(worst1, e1);
        worst2 = std::max(worst2, e2);
      }
    }
  printf("kv%d G%d D%d pos%d n%d splits%d(%d) slack%d: %s  max err vs bf16-q ref %.2e (bound u*vmax %.2e), vs fp32 ref %.2e\n",
         c.n_kv, c.G, D, c.pos, c.n, c.splits, n_chunks, c.slack, bad ? "FAIL" : "ok", worst1, u * vmax[0], worst2);
  return bad;
}
}  // namespace emu

int main(int argc, char** argv) {
  using emu::Case;
  std::vector<Case> cases = {
      {2, 4, 128, 0, 2, 0, 3},    {2, 4, 128, 1, 17, 0, 0},   {1, 4, 128, 100, 63, 0, 0},
      {1, 4, 128, 130, 64, 3, 5}, {1, 1, 128, 0, 65, 0, 0},   {1, 1, 128, 1, 130, 2, 1},
      {2, 2, 128, 100, 17, 0, 0}, {1, 8, 128, 60, 20, 4, 0},  {2, 5, 128, 33, 17, 0, 0},
      {1, 16, 128, 7, 9, 0, 0},   {1, 64, 128, 10, 3, 0, 0},  {1, 3, 128, 70, 2, 0, 0},
      {2, 1, 64, 0, 2, 0, 0},     {1, 1, 64, 200, 64, 0, 0},  {1, 2, 64, 1, 65, 0, 0},
      {1, 4, 64, 100, 70, 2, 0},  {1, 8, 64, 150, 17, 0, 0},  {1, 3, 64, 100, 63, 2, 0},
      {1, 1, 256, 0, 17, 0, 0},   {1, 2, 256, 1, 63, 0, 0},   {1, 4, 256, 40, 65, 0, 0},
      {1, 8, 256, 100, 20, 0, 7}, {1, 4, 256, 70, 40, 5, 0},
  };
  // diagonal at every offset within a key tile (pos sweep), several groups and head dims
  for (int D : {64, 128, 256})
    for (int G : {1, 4, 5})
      for (int pos = 0; pos < 66; pos += (G == 4 ? 1 : 5)) cases.push_back({1, G, D, pos, G == 1 ? 70 : 33, pos % 3 == 2 ? 2 : 0, pos % 2});
  if (argc > 2 && std::string(argv[2]) == "big") cases = {{2, 4, 128, 1000, 300, 7, 0}, {2, 4, 256, 1000, 300, 1, 0}, {8, 4, 128, 1000, 65, 1, 0}, {2, 8, 64, 1000, 17, 0, 0}, {1, 2, 256, 0, 300, 5, 0}};
  int bad = 0;
  if (argc > 1 && std::string(argv[1]) == "eager") emu::g_eager = true;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    if (c.D == 64) bad += emu::run_case<64>(c, 1234 + i);
    else if (c.D == 128) bad += emu::run_case<128>(c, 1234 + i);
    else bad += emu::run_case<256>(c, 1234 + i);
    fflush(stdout);
  }
  printf("ldmatrix: %ld, bank-conflicted rows: %ld\n", emu::g_ldmatrix, emu::g_bank_conflicts);
  printf("%s\n", bad ? "FAILURES" : "ALL OK");
  return bad != 0;
}

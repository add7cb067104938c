// warp_ops front-end of the CPU emulator (emu_core.h): host implementations of the functions of
// csrc/kernels/warp_ops.cuh, which includes this header instead of its PTX when LRF_KERNEL_EMULATION is defined.
// Used by block_attn_emu.cpp (csrc/kernels/block_attn.cuh), linear_emu.cpp (csrc/kernels/linear.cuh) and
// wgmma_selfcheck_emu.cpp; test support only.
//
//  * ldmatrix / mma.m16n8k16 / shfl_xor are warp collectives (warp_collective): every lane gives its operands,
//    and the 32 lanes' results are computed at once from all of them, with the fragment layouts of the PTX ISA
//    (see warp_ops.cuh); mma products are summed in fp32. block_sync is a block barrier.
//  * cp.async: by default a copy lands at issue time (the earliest the hardware may land it); with
//    defer_copies it lands when the issuing thread's cp.async.wait_group retires its group (the latest).
//    Running both brackets the hardware's timing. A thread that exits with copies in flight is an error.
//  * wgmma.mma_async (RS: A in registers, B in shared memory through a 128B-swizzled matrix descriptor) is a
//    warp collective too: warp w of a warpgroup computes its 16 rows of D from its lanes' A fragments and B
//    decoded from the descriptor (gmma_smem_addr). Without defer_copies it runs at issue. With defer_copies it
//    runs when wgmma.wait_group retires its group, as late as the hardware may: B is read from shared memory
//    then, and the accumulators read NaN in between (a kernel that reads them before the wait, or writes them
//    while the wgmma is in flight, fails). Every batch must follow a wgmma.fence (checked), a thread may not
//    exit with wgmma groups in flight, and the 4 warps of a warpgroup must have issued the same sequence of
//    wgmma instructions by the end of the CTA (checked: they are warpgroup-collective on the device).
//  * A "shared address" is an offset into the core's shared memory (bounds and alignment checked). Global
//    memory is host memory (16-, 8- and 4-byte accesses are alignment checked like the device).
//  * run_cta(): one CTA, body(tid) per thread, threads interleaved at random from a seed.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <type_traits>
#include <vector>

#include <math.h>

#include "emu/emu_core.h"

#define LRF_DEVICE inline
#define __host__
#define __device__

namespace lrf {
namespace emu {

inline constexpr char kLdmatrix[] = "ldmatrix.x4";
inline constexpr char kLdmatrixTrans[] = "ldmatrix.x4.trans";
inline constexpr char kMma[] = "mma.m16n8k16";
inline constexpr char kShfl[] = "shfl.xor";
inline constexpr char kBlockSync[] = "block_sync";
inline constexpr char kClusterSync[] = "barrier.cluster";
inline constexpr char kClusterSyncRelaxed[] = "barrier.cluster.relaxed";
inline constexpr char kSyncWarp[] = "bar.warp.sync";
inline constexpr char kWgmmaFence[] = "wgmma.fence";
inline constexpr char kWgmma[] = "wgmma.mma_async";
inline constexpr char kWgmmaCommit[] = "wgmma.commit_group";
inline constexpr char kWgmmaWait[] = "wgmma.wait_group";

struct Copy {
  uint32_t dst;
  const char* src;
  int bytes;
};

// cp.async state of one thread: copies issued since the last commit, committed groups not yet retired.
struct CopyQueue {
  std::vector<Copy> open;
  std::deque<std::vector<Copy>> groups;
  bool pending() const {
    bool any = !open.empty();
    for (const auto& g : groups) any = any || !g.empty();
    return any;
  }
};

// One warp's share of a wgmma.mma_async: its lanes' A fragments and accumulator arrays.
struct WgmmaOp {
  int n = 0;             // N of m64nNk16
  bool trans_b = false;  // B MN-major
  bool accumulate = true;
  bool fp16 = false;     // else bf16
  uint64_t desc = 0;
  std::array<std::array<uint32_t, 4>, kWarpSize> a{};
  std::array<float*, kWarpSize> d{};  // each lane's accumulator registers (n / 2 floats)
};

// wgmma state of one warp: fenced since its last wait, the open batch, committed groups; with deferred
// execution the in-flight accumulator values live in a Shadow (keyed by the lanes' register arrays) and the
// registers hold NaN.
struct WgmmaWarp {
  bool fenced = false;
  uint64_t trace = 0;  // hash of the warp's sequence of wgmma instructions: the 4 warps of a warpgroup must agree
  std::vector<WgmmaOp> open;
  std::deque<std::vector<WgmmaOp>> groups;
  struct Shadow {
    std::array<float*, kWarpSize> regs{};
    std::vector<float> vals;  // [lane][n / 2]
    int pending = 0;
  };
  std::vector<Shadow> shadows;
  bool busy() const { return !open.empty() || !groups.empty(); }
};

struct WarpOpsState {
  bool defer_copies = false;  // also defers wgmma to its wait_group
  int cluster_ctas = 1;       // run_cluster: the CTAs of one cluster run as one emulated CTA, rank-major
  int cta_threads = 0;        // threads per CTA of that cluster (0: not in run_cluster)
  size_t cta_smem = 0;        // shared-memory bytes per CTA of that cluster
  std::vector<CopyQueue> copies;  // per thread
  std::vector<WgmmaWarp> wgmma;   // per warp
};

inline WarpOpsState& warp_ops_state() {
  static WarpOpsState s;
  return s;
}

// Runs one CTA of `nthreads` threads, body(tid) per thread, with `smem_bytes` of shared memory filled with
// 0xFF bytes (NaN in bf16/fp16: reading shared memory nobody wrote shows up as NaN); the threads interleave
// at random from `seed`: uniform picks for an even seed, the warp-greedy schedule (Launch::warp_greedy: one
// warp as far ahead as the barriers allow) for an odd one, so a grid's CTAs (seed + cta) get both.
inline void run_cta(int nthreads, size_t smem_bytes, const std::function<void(int)>& body, bool defer_copies,
                    uint32_t seed, int cluster_ctas = 1) {
  WarpOpsState& s = warp_ops_state();
  s.defer_copies = defer_copies;
  s.copies.assign(nthreads, CopyQueue{});
  s.wgmma.assign(nthreads / kWarpSize, WgmmaWarp{});
  Launch launch;
  launch.nthreads = nthreads;
  launch.smem_bytes = smem_bytes;
  launch.random_order = true;
  launch.warp_greedy = (seed & 1u) != 0;
  launch.seed = seed;
  const std::function<void()> thread = [&]() {
    body(tid());
    if (s.copies[tid()].pending()) fail("thread exited with cp.async copies in flight");
    if (s.wgmma[warp()].busy()) fail("thread exited with wgmma.mma_async groups not waited for");
  };
  s.cluster_ctas = cluster_ctas;
  s.cta_threads = nthreads / cluster_ctas;
  s.cta_smem = smem_bytes / cluster_ctas;
  emu::run_cta(launch, thread);
  // wgmma.* are warpgroup-collective: every warp of a warpgroup issues the same sequence (a warp that skipped
  // a batch would hang or compute garbage on the device while passing the per-warp emulation)
  for (size_t w = 0; w < s.wgmma.size(); ++w) {
    const size_t first = w / 4 * 4;
    if (first + 4 > s.wgmma.size() && s.wgmma[w].trace != 0) fail("wgmma issued by a warp outside a whole warpgroup");
    if (s.wgmma[w].trace != s.wgmma[first].trace) fail("the warps of a warpgroup issued different wgmma sequences");
  }
}

// Runs one thread-block cluster of `ctas` CTAs of `cta_threads` threads as ONE emulated CTA: thread t is
// thread t % cta_threads of the CTA of rank t / cta_threads, and rank r's shared memory is bytes
// [r * cta_smem, (r + 1) * cta_smem) of the emulated CTA's (cluster_map translates between ranks). The cluster
// barrier is a barrier of every emulated thread. A kernel run this way may use no CTA-level barrier
// (block_sync would wait for the whole cluster and hide a missing cluster barrier): the driver's body checks
// that by passing the kernel cluster > 1 only here.
inline void run_cluster(int ctas, int cta_threads, size_t cta_smem, const std::function<void(int)>& body,
                        uint32_t seed) {
  if (ctas < 1 || ctas * cta_threads > kMaxThreads) fail("run_cluster: too many threads for the emulator");
  run_cta(ctas * cta_threads, size_t(ctas) * cta_smem, body, false, seed, ctas);
}

inline char* smem_ptr(uint32_t addr, size_t bytes) {
  if (size_t(addr) + bytes > smem_bytes()) fail("shared memory access out of bounds");
  return smem() + addr;
}

inline void do_copy(const Copy& cp) {
  char* dst = smem_ptr(cp.dst, 16);
  if (cp.bytes == 16) {
    std::memcpy(dst, cp.src, 16);
  } else {
    std::memset(dst, 0, 16);
  }
}

inline void check_align(const void* p, uintptr_t a, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % a != 0) fail(what);
}

inline uint16_t ld_u16(uint32_t addr) {
  uint16_t v;
  std::memcpy(&v, smem_ptr(addr, 2), 2);
  return v;
}

}  // namespace emu

namespace kernels {

struct Bf16 {};
struct Fp16 {};

struct U128 {
  uint32_t x, y, z, w;
};

inline float to_float(Bf16, uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float to_float(Fp16, uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}

inline uint16_t from_float(Bf16, float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline uint16_t from_float(Fp16, float f) {
  const _Float16 x = static_cast<_Float16>(f);  // round to nearest even
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

inline uint32_t smem_addr(const void* p) {
  const char* q = static_cast<const char*>(p);
  const char* base = emu::smem();
  if (q < base || q > base + emu::smem_bytes()) emu::fail("smem_addr of a non-shared pointer");
  return static_cast<uint32_t>(q - base);
}

inline void ldmatrix_impl(uint32_t (&r)[4], uint32_t addr, bool trans) {
  if (addr % 16 != 0) emu::fail("ldmatrix row address not 16-byte aligned");
  using Regs = std::array<uint32_t, 4>;
  const Regs got = emu::warp_collective<Regs>(
      trans ? emu::kLdmatrixTrans : emu::kLdmatrix, addr, [trans](const auto& rows, auto& out) {
        for (int lane = 0; lane < emu::kWarpSize; ++lane) {
          for (int m = 0; m < 4; ++m) {
            uint16_t lo, hi;
            if (!trans) {  // row lane/4 of matrix m, columns 2(lane%4), +1
              const uint32_t row = rows[8 * m + lane / 4];
              lo = emu::ld_u16(row + 4 * (lane % 4));
              hi = emu::ld_u16(row + 4 * (lane % 4) + 2);
            } else {  // column lane/4 of matrix m, rows 2(lane%4), +1
              lo = emu::ld_u16(rows[8 * m + 2 * (lane % 4)] + 2 * (lane / 4));
              hi = emu::ld_u16(rows[8 * m + 2 * (lane % 4) + 1] + 2 * (lane / 4));
            }
            out[lane][m] = uint32_t(lo) | (uint32_t(hi) << 16);
          }
        }
      });
  for (int m = 0; m < 4; ++m) r[m] = got[m];
}

inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { ldmatrix_impl(r, addr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { ldmatrix_impl(r, addr, true); }

inline uint16_t half_of(uint32_t reg, int k) { return static_cast<uint16_t>(k % 2 ? reg >> 16 : reg & 0xffffu); }

struct MmaOperands {
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
};

template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  using Acc = std::array<float, 4>;
  const MmaOperands mine{{a[0], a[1], a[2], a[3]}, {b0, b1}, {d[0], d[1], d[2], d[3]}};
  const Acc got = emu::warp_collective<Acc>(emu::kMma, mine, [](const auto& ops, auto& out) {
    for (int lane = 0; lane < emu::kWarpSize; ++lane) {
      const int g = lane / 4, tg = lane % 4;
      for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e / 2), col = 2 * tg + (e % 2);
        float acc = ops[lane].c[e];
        for (int k = 0; k < 16; ++k) {
          const uint32_t areg = ops[(row % 8) * 4 + (k % 8) / 2].a[(row / 8) + 2 * (k / 8)];
          const uint32_t breg = ops[col * 4 + (k % 8) / 2].b[k / 8];
          acc += to_float(T{}, half_of(areg, k)) * to_float(T{}, half_of(breg, k));
        }
        out[lane][e] = acc;
      }
    }
  });
  for (int e = 0; e < 4; ++e) d[e] = got[e];
}

// ------------------------------------------------------------------ wgmma (warp_ops.cuh's sm_90a functions)

// Byte address in shared memory of element (n, k), k < 16, of a wgmma B operand described by a 128B-swizzled
// matrix descriptor: the PTX ISA's canonical layouts (CuTe: GMMA::Layout_K_SW128_Atom / Layout_MN_SW128_Atom),
//   K-major  (n % 8) * 128 B + (n / 8) * SBO + (k % 8) * 2 B + (k / 8) * 16 B
//   MN-major (n % 64) * 2 B + (n / 64) * LBO + (k % 8) * 128 B + (k / 8) * SBO
// from the start address, then the 128-byte swizzle of the address itself: bits 4-6 ^= bits 7-9.
inline uint32_t gmma_smem_addr(uint64_t desc, bool mn_major, int n, int k) {
  const uint32_t start = uint32_t(desc & 0x3FFFu) << 4;
  const uint32_t lbo = uint32_t((desc >> 16) & 0x3FFFu) << 4;
  const uint32_t sbo = uint32_t((desc >> 32) & 0x3FFFu) << 4;
  if ((desc >> 62) != 1) emu::fail("wgmma descriptor: only the 128-byte swizzle is emulated");
  if (((desc >> 49) & 7u) != 0) emu::fail("wgmma descriptor: base offset must be 0 (1024-byte aligned tiles)");
  const uint32_t off = mn_major ? uint32_t(n % 64) * 2 + uint32_t(n / 64) * lbo + uint32_t(k % 8) * 128 + uint32_t(k / 8) * sbo
                                : uint32_t(n % 8) * 128 + uint32_t(n / 8) * sbo + uint32_t(k % 8) * 2 + uint32_t(k / 8) * 16;
  const uint32_t addr = start + off;
  return addr ^ (((addr >> 7) & 7u) << 4);
}

// D fragment of m64nNk16 (per warp: its 16 rows): register v of a lane holds (row, column) =
// (lane / 4 + 8 ((v % 4) / 2), 8 (v / 4) + 2 (lane % 4) + v % 2); the A fragment is mma.m16n8k16's.
inline int wgmma_d_row(int lane, int v) { return lane / 4 + 8 * ((v % 4) / 2); }
inline int wgmma_d_col(int lane, int v) { return 8 * (v / 4) + 2 * (lane % 4) + v % 2; }

// One warp's rows of an op: acc[lane] -> that lane's n / 2 accumulators (read unless !accumulate, then written).
inline void wgmma_run(const emu::WgmmaOp& op, const std::array<float*, emu::kWarpSize>& acc) {
  const int n = op.n, k16 = 16;
  std::vector<float> b(size_t(k16) * n);  // B[k][col], read from shared memory now
  for (int k = 0; k < k16; ++k) {
    for (int col = 0; col < n; ++col) {
      const uint16_t h = emu::ld_u16(gmma_smem_addr(op.desc, op.trans_b, col, k));
      b[size_t(k) * n + col] = op.fp16 ? to_float(Fp16{}, h) : to_float(Bf16{}, h);
    }
  }
  for (int lane = 0; lane < emu::kWarpSize; ++lane) {
    for (int v = 0; v < n / 2; ++v) {
      const int row = wgmma_d_row(lane, v), col = wgmma_d_col(lane, v);
      float sum = op.accumulate ? acc[lane][v] : 0.f;
      for (int k = 0; k < k16; ++k) {
        const uint32_t areg = op.a[(row % 8) * 4 + (k % 8) / 2][(row / 8) + 2 * (k / 8)];
        const float av = op.fp16 ? to_float(Fp16{}, half_of(areg, k)) : to_float(Bf16{}, half_of(areg, k));
        sum += av * b[size_t(k) * n + col];
      }
      acc[lane][v] = sum;
    }
  }
}

inline constexpr uint32_t kWgmmaPoison = 0x7FC5A5A5u;  // a quiet NaN: in-flight accumulators read as NaN

// Adds one instruction to the warp's wgmma sequence hash (the warpgroup check of run_cta).
inline void wgmma_trace(emu::WgmmaWarp& w, uint64_t code) { w.trace = w.trace * 1000003u + code + 1; }

inline void wgmma_fence() {
  emu::warp_collective<int>(emu::kWgmmaFence, 0, [](const auto&, auto& out) {
    emu::WgmmaWarp& w = emu::warp_ops_state().wgmma[emu::warp()];
    w.fenced = true;
    wgmma_trace(w, 1);
    out.fill(0);
  });
}

template <typename T, int N, bool TransB>
inline void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
  static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma N");
  struct In {
    std::array<uint32_t, 4> a;
    float* d;
    uint64_t desc;
    bool accumulate;
  };
  const In mine{{a[0], a[1], a[2], a[3]}, d, desc_b, accumulate};
  emu::warp_collective<int>(emu::kWgmma, mine, [](const auto& in, auto& out) {
    emu::WarpOpsState& s = emu::warp_ops_state();
    emu::WgmmaWarp& w = s.wgmma[emu::warp()];
    if (!w.fenced) emu::fail("wgmma.mma_async without a wgmma.fence since the last wgmma.wait_group");
    wgmma_trace(w, 16 + 2 * uint64_t(N) + (TransB ? 1 : 0));
    emu::WgmmaOp op;
    op.n = N;
    op.trans_b = TransB;
    op.fp16 = std::is_same_v<T, Fp16>;
    op.desc = in[0].desc;
    op.accumulate = in[0].accumulate;
    for (int l = 0; l < emu::kWarpSize; ++l) {
      if (in[l].desc != op.desc || in[l].accumulate != op.accumulate) {
        emu::fail("wgmma.mma_async: descriptor or scale-d differs between the lanes of a warp");
      }
      op.a[l] = in[l].a;
      op.d[l] = in[l].d;
    }
    out.fill(0);
    if (!s.defer_copies) {
      wgmma_run(op, op.d);
      return;
    }
    // deferred: the op joins the open batch; its accumulators move to a shadow until the wait that retires it
    emu::WgmmaWarp::Shadow* sh = nullptr;
    for (auto& x : w.shadows) {
      if (x.regs == op.d) sh = &x;
    }
    if (sh == nullptr) {
      w.shadows.push_back({op.d, std::vector<float>(size_t(emu::kWarpSize) * (N / 2)), 0});
      sh = &w.shadows.back();
      float poison;
      std::memcpy(&poison, &kWgmmaPoison, 4);
      for (int l = 0; l < emu::kWarpSize; ++l) {
        for (int v = 0; v < N / 2; ++v) {
          sh->vals[size_t(l) * (N / 2) + v] = op.d[l][v];
          op.d[l][v] = poison;
        }
      }
    }
    ++sh->pending;
    w.open.push_back(op);
  });
}

inline void wgmma_commit() {
  emu::warp_collective<int>(emu::kWgmmaCommit, 0, [](const auto&, auto& out) {
    emu::WgmmaWarp& w = emu::warp_ops_state().wgmma[emu::warp()];
    wgmma_trace(w, 2);
    w.groups.push_back(std::move(w.open));
    w.open.clear();
    out.fill(0);
  });
}

template <int N>
inline void wgmma_wait() {
  emu::warp_collective<int>(emu::kWgmmaWait, 0, [](const auto&, auto& out) {
    emu::WgmmaWarp& w = emu::warp_ops_state().wgmma[emu::warp()];
    wgmma_trace(w, 3 + 4 * uint64_t(N));
    while (static_cast<int>(w.groups.size()) > N) {
      for (const emu::WgmmaOp& op : w.groups.front()) {
        size_t i = 0;
        while (i < w.shadows.size() && w.shadows[i].regs != op.d) ++i;
        if (i == w.shadows.size()) emu::fail("wgmma emulation: lost the accumulators of an op");
        emu::WgmmaWarp::Shadow& sh = w.shadows[i];
        std::array<float*, emu::kWarpSize> acc;
        for (int l = 0; l < emu::kWarpSize; ++l) acc[l] = sh.vals.data() + size_t(l) * (op.n / 2);
        wgmma_run(op, acc);
        if (--sh.pending == 0) {  // the last op on these registers: they get their values now
          for (int l = 0; l < emu::kWarpSize; ++l) {
            for (int v = 0; v < op.n / 2; ++v) {
              uint32_t bits;
              std::memcpy(&bits, &op.d[l][v], 4);
              if (bits != kWgmmaPoison) emu::fail("accumulator registers of an in-flight wgmma were written");
              op.d[l][v] = acc[l][v];
            }
          }
          w.shadows.erase(w.shadows.begin() + static_cast<std::ptrdiff_t>(i));
        }
      }
      w.groups.pop_front();
    }
    w.fenced = false;  // registers are accessed after a wait: the next batch needs a wgmma.fence
    out.fill(0);
  });
}

// No memory model here: every store is visible at once to every proxy.
inline void fence_proxy_async_smem() {}

template <int N>
inline void fence_regs(float (&)[N]) {}
template <int N>
inline void fence_regs(uint32_t (&)[N]) {}

inline void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  if (dst % 16 != 0) emu::fail("cp.async shared address not 16-byte aligned");
  if (src_bytes != 0 && src_bytes != 16) emu::fail("cp.async src-size must be 0 or 16 here");
  if (src_bytes == 16) emu::check_align(src, 16, "cp.async global address not 16-byte aligned");
  const emu::Copy cp{dst, static_cast<const char*>(src), src_bytes};
  emu::smem_ptr(dst, 16);
  emu::WarpOpsState& s = emu::warp_ops_state();
  if (s.defer_copies) {
    s.copies[emu::tid()].open.push_back(cp);
  } else {
    emu::do_copy(cp);
  }
}

inline void cp_async_commit() {
  emu::CopyQueue& q = emu::warp_ops_state().copies[emu::tid()];
  q.groups.push_back(std::move(q.open));
  q.open.clear();
}

template <int N>
inline void cp_async_wait() {
  emu::CopyQueue& q = emu::warp_ops_state().copies[emu::tid()];
  while (static_cast<int>(q.groups.size()) > N) {
    for (const emu::Copy& cp : q.groups.front()) emu::do_copy(cp);
    q.groups.pop_front();
  }
}

inline void block_sync() {
  if (emu::warp_ops_state().cluster_ctas > 1) emu::fail("block_sync in a CTA of a cluster run as one emulated CTA");
  emu::block_barrier(emu::kBlockSync);
}

// Clusters (run_cluster): the rank of the calling thread's CTA, the cluster barrier, and the address of
// `p` (in the caller's CTA's shared memory) in the CTA of rank `rank`.
inline int cluster_ctarank() {
  const emu::WarpOpsState& s = emu::warp_ops_state();
  return emu::tid() / s.cta_threads;
}
inline void cluster_sync() { emu::block_barrier(emu::kClusterSync); }
inline void cluster_sync_relaxed() { emu::block_barrier(emu::kClusterSyncRelaxed); }
inline const float* cluster_map(const float* p, int rank) {
  const emu::WarpOpsState& s = emu::warp_ops_state();
  if (rank < 0 || rank >= s.cluster_ctas) emu::fail("cluster_map: rank outside the cluster");
  const char* mine = emu::smem() + size_t(cluster_ctarank()) * s.cta_smem;
  const char* q = reinterpret_cast<const char*>(p);
  if (q < mine || q >= mine + s.cta_smem) emu::fail("cluster_map: not an address in the caller's shared memory");
  return reinterpret_cast<const float*>(emu::smem() + size_t(rank) * s.cta_smem + (q - mine));
}

// Emulated shared memory of the calling thread's CTA (the rank's slice in a cluster run).
inline char* cta_smem() {
  const emu::WarpOpsState& s = emu::warp_ops_state();
  return emu::smem() + size_t(cluster_ctarank()) * s.cta_smem;
}

// Grids run one after the other here: programmatic dependent launch has nothing to overlap.
inline void griddep_launch_dependents() {}
inline void griddep_wait() {}

inline float fast_exp2(float x) { return std::exp2(x); }

inline float shfl_xor(float v, int mask) {
  if (mask < 0 || mask >= emu::kWarpSize) emu::fail("shfl_xor lane mask outside 0..31");
  struct In {
    float v;
    int mask;
  };
  return emu::warp_collective<float>(emu::kShfl, In{v, mask}, [](const auto& in, auto& out) {
    for (int l = 0; l < emu::kWarpSize; ++l) {
      if (in[l].mask != in[0].mask) emu::fail("shfl_xor with a non-uniform lane mask");
      out[l] = in[l ^ in[l].mask].v;
    }
  });
}

inline U128 ld_global_16(const void* p) {
  emu::check_align(p, 16, "16-byte global load not aligned");
  U128 v;
  std::memcpy(&v, p, 16);
  return v;
}

inline U128 ld_stream_16(const void* p) { return ld_global_16(p); }

inline void ld_generic_f32x2(const float* p, float (&v)[2]) {
  emu::check_align(p, 8, "float2 load not aligned");
  std::memcpy(v, p, 8);
}

inline void warp_sync() { emu::warp_barrier(emu::kSyncWarp); }

inline void st_global_u16(void* p, uint16_t v) {
  emu::check_align(p, 2, "2-byte store not aligned");
  std::memcpy(p, &v, 2);
}

inline void st_global_16(void* p, U128 v) {
  emu::check_align(p, 16, "16-byte global store not aligned");
  std::memcpy(p, &v, 16);
}

template <typename T>
inline uint32_t pack2(float lo, float hi) {
  return uint32_t(from_float(T{}, lo)) | (uint32_t(from_float(T{}, hi)) << 16);
}

template <int N>
inline void ld_global_f32(const float* p, float (&x)[N]) {
  emu::check_align(p, 4 * N, "vector float load not aligned");
  std::memcpy(x, p, 4 * N);
}

inline void st_global_u32(void* p, uint32_t v) {
  emu::check_align(p, 4, "4-byte store not aligned");
  std::memcpy(p, &v, 4);
}

inline void st_global_u64(void* p, uint32_t lo, uint32_t hi) {
  emu::check_align(p, 8, "8-byte store not aligned");
  std::memcpy(p, &lo, 4);
  std::memcpy(static_cast<char*>(p) + 4, &hi, 4);
}

inline void st_global_f32x2(float* p, float a, float b) {
  emu::check_align(p, 8, "float2 store not aligned");
  p[0] = a;
  p[1] = b;
}

}  // namespace kernels
}  // namespace lrf

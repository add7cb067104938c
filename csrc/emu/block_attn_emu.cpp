// CPU driver of the block-attention kernel source (kernels/block_attn.cuh) under emulation (emu_core.h with the
// warp_ops front-end warp_ops.h, which kernels/warp_ops.cuh includes). An executable for
// python_tests/test_block_attn_emu.py; not part of the extension. Build:
//   g++ -std=c++20 -O2 -ffp-contract=off -DLRF_KERNEL_EMULATION -Icsrc csrc/emu/block_attn_emu.cpp -o block_attn_emu
//
//   block_attn_emu run IN OUT
//     IN: int32 B, C, L, Hq, Hkv, D, block_size, dtype (0 bf16, 1 fp16), splits, defer_copies, seed,
//         wgmma (0: the mma.sync variant, 1: the wgmma variant);
//         float32 scale; then q [B,C,Hq,D], k [B,C,Hkv,D], v, k_cache [B,L,Hkv,D], v_cache, each as int64
//         storage elements N, offset, strides of dims 0-2 (elements; the last dim dense) and its N 16-bit
//         storage elements (the launcher's layouts: views of a fused projection, cache windows, padded heads);
//         int32 cache_lens [B], chunk_lens [B].
//     OUT: out [B,C,Hq,D] (contiguous), then the k_cache and v_cache storages (16-bit), as the launcher would
//         leave them (storage outside the cache views included).
//   block_attn_emu splits BASE_CTAS CAPACITY ROWS_PER_CTA RESIDENT   -> prints block_attn_num_splits(...)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/block_attn.cuh"

using namespace lrf::kernels;

namespace {

template <typename V>
void read_into(FILE* f, V& v, size_t n) {
  v.resize(n);
  if (n && std::fread(v.data(), sizeof(v[0]), n, f) != n) lrf::emu::fail("short input file");
}

template <typename T, int D, bool WG>
void run(BlockAttnParams p, int splits_defer, uint32_t seed) {
  const int64_t grid = int64_t(p.m_tiles) * p.num_splits * p.batch * p.hkv;
  for (int64_t cta = 0; cta < grid; ++cta) {
    std::function<void(int)> body = [&](int tid) {
      block_attn_cta<T, D, WG>(p, cta, tid, lrf::emu::smem());
    };
    lrf::emu::run_cta(kBlockAttnThreads, block_attn_smem_bytes(D, WG), body, splits_defer != 0,
                      seed + static_cast<uint32_t>(cta));
  }
  if (p.num_splits > 1) {
    const int64_t rows = int64_t(p.batch) * p.chunk * p.hq;
    const int64_t cgrid = (rows + kBlockAttnCombineWarps - 1) / kBlockAttnCombineWarps;
    for (int64_t cta = 0; cta < cgrid; ++cta) {
      std::function<void(int)> body = [&](int tid) { block_attn_combine_cta<T, D>(p, cta, tid); };
      lrf::emu::run_cta(kBlockAttnCombineWarps * 32, 0, body, false, seed);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "splits") {
    std::printf("%d\n", block_attn_num_splits(std::atoll(argv[2]), std::atoll(argv[3]), std::atoi(argv[4]),
                                              std::atoll(argv[5])));
    return 0;
  }
  if (argc != 4 || std::string(argv[1]) != "run") {
    std::fprintf(stderr, "usage: %s run IN OUT | splits BASE CAP ROWS RESIDENT\n", argv[0]);
    return 2;
  }
  FILE* in = std::fopen(argv[2], "rb");
  if (!in) lrf::emu::fail("cannot open input");
  std::vector<int32_t> hdr;
  read_into(in, hdr, 12);
  std::vector<float> scale;
  read_into(in, scale, 1);
  const int B = hdr[0], C = hdr[1], L = hdr[2], Hq = hdr[3], Hkv = hdr[4], D = hdr[5], bs = hdr[6];
  const int dtype = hdr[7], S = hdr[8], defer = hdr[9];
  const uint32_t seed = static_cast<uint32_t>(hdr[10]);
  const bool wg = hdr[11] != 0;
  // A tensor as the launcher hands it over: its storage copied into a 16-byte aligned buffer, a view into it.
  struct Strided {
    std::vector<uint16_t> storage;  // 8 spare elements: `base` is the 16-byte aligned start
    uint16_t* base = nullptr;
    size_t elems = 0;
    int64_t offset = 0, stride[3] = {0, 0, 0};
  };
  auto read_tensor = [&](Strided& t) {
    std::vector<int64_t> meta;
    read_into(in, meta, 5);
    if (meta[0] < 0 || meta[1] < 0 || meta[1] > meta[0]) lrf::emu::fail("bad tensor storage / offset");
    std::vector<uint16_t> raw;
    read_into(in, raw, size_t(meta[0]));
    t.elems = raw.size();
    t.storage.assign(raw.size() + 8, 0);
    t.base = t.storage.data();
    while (reinterpret_cast<uintptr_t>(t.base) % 16) ++t.base;
    if (!raw.empty()) std::memcpy(t.base, raw.data(), raw.size() * 2);
    t.offset = meta[1];
    for (int d = 0; d < 3; ++d) t.stride[d] = meta[2 + d];
  };
  Strided q, k, v, kc, vc;
  for (Strided* t : {&q, &k, &v, &kc, &vc}) read_tensor(*t);
  std::vector<int32_t> cl, nl;
  read_into(in, cl, B);
  read_into(in, nl, B);
  std::fclose(in);
  // every element of each view lies in its storage (the kernel's reads and writes are not bounds-checked)
  auto inside = [&](const Strided& t, int64_t d0, int64_t d1, int64_t d2) {
    if (d0 == 0 || d1 == 0 || d2 == 0) return true;
    int64_t lo = t.offset, hi = t.offset + D - 1;
    const int64_t sizes[3] = {d0, d1, d2};
    for (int d = 0; d < 3; ++d) (t.stride[d] < 0 ? lo : hi) += (sizes[d] - 1) * t.stride[d];
    return lo >= 0 && hi < int64_t(t.elems);
  };
  if (!inside(q, B, C, Hq) || !inside(k, B, C, Hkv) || !inside(v, B, C, Hkv) || !inside(kc, B, L, Hkv) ||
      !inside(vc, B, L, Hkv))
    lrf::emu::fail("a tensor view reaches past its storage");
  std::vector<uint16_t> out(size_t(B) * C * Hq * D + 8, 0xFFFF);  // poison: every element must be written
  uint16_t* outa = out.data();
  while (reinterpret_cast<uintptr_t>(outa) % 16) ++outa;

  const int G = Hq / Hkv;
  auto t4 = [&](Strided& t) {
    return AttnTensor{reinterpret_cast<char*>(t.base + t.offset), t.stride[0] * 2, t.stride[1] * 2, t.stride[2] * 2};
  };
  BlockAttnParams p{};
  p.q = t4(q);
  p.k = t4(k);
  p.v = t4(v);
  p.k_cache = t4(kc);
  p.v_cache = t4(vc);
  p.out = reinterpret_cast<char*>(outa);
  const int64_t rows = int64_t(B) * C * Hq;
  std::vector<float> o_part, lse_part;
  if (S > 1) {
    o_part.assign(size_t(S) * rows * D, NAN);  // poison: a partial the combine reads must have been written
    lse_part.assign(size_t(S) * rows, NAN);
    p.o_part = o_part.data();
    p.lse_part = lse_part.data();
  }
  p.cache_lens = cl.data();
  p.chunk_lens = nl.data();
  p.batch = B;
  p.chunk = C;
  p.capacity = L;
  p.hq = Hq;
  p.hkv = Hkv;
  p.group = G;
  p.block_size = bs;
  p.m_rows = C * G;
  p.m_tiles = (C * G + kBlockAttnBM - 1) / kBlockAttnBM;
  p.num_splits = S;
  p.scale_log2 = scale[0] * 1.4426950408889634f;

  if (B > 0 && C > 0) {
    auto go = [&](auto wg_tag) {
      constexpr bool WG = decltype(wg_tag)::value;
      if (dtype == 0 && D == 128) run<Bf16, 128, WG>(p, defer, seed);
      else if (dtype == 0 && D == 64) run<Bf16, 64, WG>(p, defer, seed);
      else if (dtype == 1 && D == 128) run<Fp16, 128, WG>(p, defer, seed);
      else if (dtype == 1 && D == 64) run<Fp16, 64, WG>(p, defer, seed);
      else lrf::emu::fail("unsupported dtype / head_dim");
    };
    if (wg) go(std::true_type{});
    else go(std::false_type{});
  }

  FILE* o = std::fopen(argv[3], "wb");
  if (!o) lrf::emu::fail("cannot open output");
  std::fwrite(outa, 2, size_t(B) * C * Hq * D, o);
  std::fwrite(kc.base, 2, kc.elems, o);
  std::fwrite(vc.base, 2, vc.elems, o);
  std::fclose(o);
  return 0;
}

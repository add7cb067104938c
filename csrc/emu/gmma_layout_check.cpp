// Host check of the wgmma variant of block attention against CUTLASS/CuTe's SM90 GMMA definitions (the layouts
// NVIDIA's own Hopper GEMMs run on): an executable for python_tests/test_block_attn_emu.py, never part of the
// extension. Nothing here runs on a GPU; it ties the kernel's hand-written layout math to CuTe's, so that what the
// emulator (warp_ops.h) runs is what the hardware will do. Build (CuTe from the nvidia-cutlass wheel, <cuda/std/...>
// from the CUDA toolkit's cccl headers):
//   g++ -std=c++20 -O1 -DLRF_KERNEL_EMULATION -Icsrc -I<cutlass>/include -I<cuda>/include -I<cuda>/include/cccl \
//       csrc/emu/gmma_layout_check.cpp -o gmma_layout_check
//
// For bf16 / fp16 and head_dim 64 / 128 it checks, element by element:
//  1. the shared-memory K/V tile the kernel writes (block_attn_swz<D, true>) IS CuTe's canonical layout: K as the
//     K-major B operand tile_to_shape(Layout_K_SW128_Atom, [BN keys, D]) and V as the MN-major B operand
//     tile_to_shape(Layout_MN_SW128_Atom, [D, BN keys], column blocks after key groups), 1024-byte aligned;
//  2. the kernel's descriptors (block_attn_k_desc / block_attn_v_desc) equal make_gmma_desc of CuTe's k-step
//     sub-tiles (layout type, LBO, SBO, base offset; the start address as CuTe's unswizzled sub-tile pointer);
//  3. the emulator's descriptor decode (gmma_smem_addr) reads, for every (n, k) of every k-step, the element CuTe
//     addresses;
//  4. the emulator's register fragments of m64nNk16 (D: wgmma_d_row / wgmma_d_col; A: mma.m16n8k16's layout)
//     equal the CLayout / ALayout of CuTe's RS atoms, N = 64 and 128.
// Prints "ok" and exits 0, or prints each mismatch (to stderr) and exits 1.
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include <cstdint>
#include <cstdio>

#include "kernels/block_attn.cuh"

namespace {

int g_failures = 0;

void expect(bool ok, const char* what, int a, int b, long got, long want) {
  if (ok) return;
  if (++g_failures <= 20) std::fprintf(stderr, "mismatch: %s (%d, %d): got %ld, want %ld\n", what, a, b, got, want);
}

template <class Elem, int D>
void check_tiles() {
  using namespace cute;
  constexpr int BN = lrf::kernels::kBlockAttnBN;
  alignas(1024) static Elem buf[BN * D];
  const char* base = reinterpret_cast<const char*>(buf);

  auto k_layout = tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<Int<BN>, Int<D>>{});
  auto v_layout = tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<Int<D>, Int<BN>>{}, Step<_2, _1>{});
  Tensor tk = make_tensor(make_smem_ptr(buf), k_layout);  // (key, d)
  Tensor tv = make_tensor(make_smem_ptr(buf), v_layout);  // (d, key)
  auto byte_of = [&](auto const& ref) { return long(reinterpret_cast<const char*>(&ref) - base); };

  // 1. the kernel's tile layout
  for (int key = 0; key < BN; ++key) {
    for (int d = 0; d < D; ++d) {
      const long ours = long(lrf::kernels::block_attn_swz<D, true>(key, d / 8)) + (d % 8) * 2;
      expect(ours == byte_of(tk(key, d)), "K tile byte of (key, d)", key, d, ours, byte_of(tk(key, d)));
      expect(ours == byte_of(tv(d, key)), "V tile byte of (d, key)", key, d, ours, byte_of(tv(d, key)));
    }
  }

  // 2 + 3. descriptors and the emulator's decode, per k-step
  auto fields_match = [&](uint64_t ours, GmmaDescriptor cute_desc, long start, const char* what, int step) {
    const GmmaDescriptor o(ours);
    expect(o.bitfield.layout_type_ == cute_desc.bitfield.layout_type_, what, step, 0, o.bitfield.layout_type_,
           cute_desc.bitfield.layout_type_);
    expect(o.bitfield.leading_byte_offset_ == cute_desc.bitfield.leading_byte_offset_, what, step, 1,
           o.bitfield.leading_byte_offset_, cute_desc.bitfield.leading_byte_offset_);
    expect(o.bitfield.stride_byte_offset_ == cute_desc.bitfield.stride_byte_offset_, what, step, 2,
           o.bitfield.stride_byte_offset_, cute_desc.bitfield.stride_byte_offset_);
    expect(o.bitfield.base_offset_ == cute_desc.bitfield.base_offset_, what, step, 3, o.bitfield.base_offset_,
           cute_desc.bitfield.base_offset_);
    expect(long(o.bitfield.start_address_) * 16 == start, what, step, 4, long(o.bitfield.start_address_) * 16, start);
  };
  for (int ks = 0; ks < D / 16; ++ks) {
    Tensor sub = local_tile(tk, Shape<Int<BN>, _16>{}, make_coord(0, ks));  // (key, d) of k-step ks
    const GmmaDescriptor want = GMMA::make_gmma_desc<GMMA::Major::K>(sub);
    const long start = long(reinterpret_cast<const char*>(raw_pointer_cast(sub.data())) - base);
    const uint64_t ours = lrf::kernels::block_attn_k_desc(0, ks);
    fields_match(ours, want, start, "K descriptor field (k-step, field)", ks);
    for (int n = 0; n < BN; ++n) {
      for (int k = 0; k < 16; ++k) {
        const long got = lrf::kernels::gmma_smem_addr(ours, false, n, k);
        expect(got == byte_of(sub(n, k)), "K operand decode (n, k)", n, 16 * ks + k, got, byte_of(sub(n, k)));
      }
    }
  }
  for (int kk = 0; kk < BN / 16; ++kk) {
    Tensor sub = local_tile(tv, Shape<Int<D>, _16>{}, make_coord(0, kk));  // (d, key) of k-step kk
    const GmmaDescriptor want = GMMA::make_gmma_desc<GMMA::Major::MN>(sub);
    const long start = long(reinterpret_cast<const char*>(raw_pointer_cast(sub.data())) - base);
    const uint64_t ours = lrf::kernels::block_attn_v_desc(0, kk);
    if (D > 64) fields_match(ours, want, start, "V descriptor field (k-step, field)", kk);
    else {  // one 64-column block: LBO is never used (CuTe leaves it 0), the other fields must agree
      GmmaDescriptor w2 = want;
      w2.bitfield.leading_byte_offset_ = GmmaDescriptor(ours).bitfield.leading_byte_offset_;
      fields_match(ours, w2, start, "V descriptor field (k-step, field)", kk);
    }
    for (int n = 0; n < D; ++n) {
      for (int k = 0; k < 16; ++k) {
        const long got = lrf::kernels::gmma_smem_addr(ours, true, n, k);
        expect(got == byte_of(sub(n, k)), "V operand decode (n, k)", n, 16 * kk + k, got, byte_of(sub(n, k)));
      }
    }
  }
}

// 4. register fragments: CuTe's (thread, value) -> (m, n) / (m, k) against the emulator's.
template <class Atom, int N>
void check_fragments() {
  using namespace cute;
  using Traits = MMA_Traits<Atom>;
  auto c_layout = typename Traits::CLayout{};  // (128 threads, N/2 values) -> m + 64 n
  auto a_layout = typename Traits::ALayout{};  // (128 threads, 8 values) -> m + 64 k
  for (int t = 0; t < 128; ++t) {
    const int w = t / 32, lane = t % 32;
    for (int v = 0; v < N / 2; ++v) {
      const int idx = c_layout(t, v);
      const int m = 16 * w + lrf::kernels::wgmma_d_row(lane, v), n = lrf::kernels::wgmma_d_col(lane, v);
      expect(idx == m + 64 * n, "D fragment (thread, value)", t, v, m + 64 * n, idx);
    }
    for (int v = 0; v < 8; ++v) {  // value v = half v % 2 of register v / 2 (mma.m16n8k16's A fragment)
      const int reg = v / 2;
      const int m = 16 * w + lane / 4 + 8 * (reg % 2), k = 2 * (lane % 4) + v % 2 + 8 * (reg / 2);
      expect(a_layout(t, v) == m + 64 * k, "A fragment (thread, value)", t, v, m + 64 * k, a_layout(t, v));
    }
  }
}

}  // namespace

int main() {
  using namespace cute;
  check_tiles<bfloat16_t, 128>();
  check_tiles<bfloat16_t, 64>();
  check_tiles<half_t, 128>();
  check_tiles<half_t, 64>();
  check_fragments<SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>, 64>();
  check_fragments<SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>, 128>();
  check_fragments<SM90::GMMA::MMA_64x64x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>, 64>();
  check_fragments<SM90::GMMA::MMA_64x128x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::K>, 128>();
  if (g_failures) {
    std::fprintf(stderr, "%d mismatches\n", g_failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}

// Small device helpers over inline PTX, shared by the native kernels. No CUDA or torch headers:
// NVRTC's built-in declarations (uint4, __syncthreads, __cvta_generic_to_shared, ...) suffice,
// so the sources compile anywhere NVRTC runs, with or without a GPU.
#pragma once

namespace qops {

typedef unsigned int u32;
typedef unsigned short u16;

// Predicated global loads: when `pred` is false nothing is loaded and the destination keeps its old
// value (callers never use it then), so there is no branch and no zeroing. They are volatile so
// that the compiler keeps them where they are issued (early, ahead of their use). The 16-byte
// streaming load of data read exactly once (weights) takes the read-only path without allocating in
// L1, so x and the scales keep L1.
__device__ __forceinline__ void ld_stream_v4_if(uint4& v, const void* p, bool pred) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t"
      "@p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "l"(p), "r"(static_cast<int>(pred)));
}

// Predicated loads of 2 and 1 bytes (u8 absmax codes), on the read-only path.
__device__ __forceinline__ void ld_nc_u16_if(u32& v, const void* p, bool pred) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %2, 0;\n\t@p ld.global.nc.u16 %0, [%1];\n\t}"
               : "+r"(v)
               : "l"(p), "r"(static_cast<int>(pred)));
}

__device__ __forceinline__ void ld_nc_u8_if(u32& v, const void* p, bool pred) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %2, 0;\n\t@p ld.global.nc.u8 %0, [%1];\n\t}"
               : "+r"(v)
               : "l"(p), "r"(static_cast<int>(pred)));
}

// 16 bytes of data read many times (x): the read-only path, kept in L1.
__device__ __forceinline__ void ld_nc_v4_if(uint4& v, const void* p, bool pred) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t@p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "l"(p), "r"(static_cast<int>(pred)));
}

__device__ __forceinline__ void ld_nc_v2_if(uint2& v, const void* p, bool pred) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %3, 0;\n\t@p ld.global.nc.v2.u32 {%0, %1}, [%2];\n\t}"
      : "+r"(v.x), "+r"(v.y)
      : "l"(p), "r"(static_cast<int>(pred)));
}

__device__ __forceinline__ void ld_nc_u32_if(u32& v, const void* p, bool pred) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %2, 0;\n\t@p ld.global.nc.u32 %0, [%1];\n\t}"
               : "+r"(v)
               : "l"(p), "r"(static_cast<int>(pred)));
}

// A hint: bring the 128-byte line holding p from DRAM into L2, no register written, no wait.
__device__ __forceinline__ void prefetch_l2_if(const void* p, bool pred) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %1, 0;\n\t@p prefetch.global.L2 [%0];\n\t}" ::"l"(p),
               "r"(static_cast<int>(pred)));
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// cp.async of 16 bytes; src_bytes < 16 zero-fills the rest (0: the whole slot is zeroed).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Predicated cp.async of a weight chunk's pieces: nothing is copied when `pred` is false (the slot
// keeps its old bytes, which callers never use then). All go through L1 (.ca): the 16-byte form
// that bypasses it (.cg) asked the L2 for twice the sectors it needed (Nsight Compute, ebbbefa).
__device__ __forceinline__ void cp_async_16_if(u32 dst, const void* src, bool pred) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %2, 0;\n\t@p cp.async.ca.shared.global [%0], [%1], 16;\n\t}" ::"r"(dst),
               "l"(src), "r"(static_cast<int>(pred))
               : "memory");
}

__device__ __forceinline__ void cp_async_8_if(u32 dst, const void* src, bool pred) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %2, 0;\n\t@p cp.async.ca.shared.global [%0], [%1], 8;\n\t}" ::"r"(dst),
               "l"(src), "r"(static_cast<int>(pred))
               : "memory");
}

__device__ __forceinline__ void cp_async_4_if(u32 dst, const void* src, bool pred) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %2, 0;\n\t@p cp.async.ca.shared.global [%0], [%1], 4;\n\t}" ::"r"(dst),
               "l"(src), "r"(static_cast<int>(pred))
               : "memory");
}

// Bulk copies (sm_90 copy engine) completing on a shared-memory mbarrier: one thread moves `bytes`
// (a multiple of 16, both addresses 16-byte aligned) and the barrier's transaction count falls by
// them as they land. Used by the W4A16 decode kernel's QOPS_SMEM_BULK ring (w4a16_gemv.cu) and the GEMM's
// warp-specialized build (QOPS_WS, w4a16_gemm.cu).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_inval(u32 bar) { asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar) : "memory"); }
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_copy_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src),
               "r"(bytes), "r"(bar)
               : "memory");
}
// One arrival on the barrier (release: this thread's shared-memory reads before it are done).
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared::cta.b64 st, [%0];\n\t}" ::"r"(bar) : "memory");
}
// An arrival on the barrier once every cp.async this thread issued before it has landed; .noinc: the
// barrier's expected count must include it.
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait_parity(u32 bar, u32 parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra WAIT_%=;\n\t}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
#endif

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

template <int LUT>
__device__ __forceinline__ u32 lop3(u32 a, u32 b, u32 c) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(r) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return r;
}

// (a & b) | c
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) { return lop3<(0xF0 & 0xCC) | 0xAA>(a, b, c); }

template <int SEL>
__device__ __forceinline__ u32 prmt(u32 a, u32 b) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "n"(SEL));
  return r;
}

// prmt with a selector known only at run time (a lane's own byte).
__device__ __forceinline__ u32 prmt_r(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ u32 sub_f16x2(u32 a, u32 b) {
  u32 r;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ u32 fma_f16x2(u32 a, u32 b, u32 c) {
  u32 r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// sm_80 has fma.rn.bf16x2 but not sub.bf16x2, so subtraction is written as a*1 + c.
__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b, u32 c) {
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// a * s for f16x2 (DT 0) or bf16x2 (DT 1) pairs: fma with -0 (exact sign; there is no bf16x2 mul before sm_90).
template <int DT>
__device__ __forceinline__ u32 mul2(u32 a, u32 s) {
  if constexpr (DT == 0) return fma_f16x2(a, s, 0x80008000u);
  else return fma_bf16x2(a, s, 0x80008000u);
}

__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// (lo, hi) rounded to f16 and packed, lo in the low half (cvt.rn.f16x2.f32 puts its first source high).
__device__ __forceinline__ u32 f32x2_to_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float f16_bits_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ float bf16_bits_to_f32(u16 h) { return __uint_as_float(static_cast<u32>(h) << 16); }

template <int DT>  // 0: float16, 1: bfloat16
__device__ __forceinline__ float bits_to_f32(u16 h) {
  if constexpr (DT == 0) return f16_bits_to_f32(h);
  else return bf16_bits_to_f32(h);
}

template <int DT>
__device__ __forceinline__ u16 f32_to_bits(float f) {
  if constexpr (DT == 0) return f32_to_f16_bits(f);
  else return f32_to_bf16_bits(f);
}

// Bits of a kernel's `flags` argument saying how `bias` is stored (neither: no bias).
constexpr int kBiasT = 2;    // in the activation dtype
constexpr int kBiasF32 = 4;  // in float32
// `flags` bit of the kernels launched with programmatic dependent launch: release the next launch as
// the kernel starts rather than after its main loop. The next grid launches once every block of this
// one has executed the trigger, so it never takes a slot one of this grid's blocks still waits for;
// it launches, and streams its first weights, while this grid's blocks run. The hosts set it for
// one-wave grids (qops.native.int_weight.early_dependents_flag).
constexpr int kEarlyDependents = 16;

// v + bias[n] as `flags` says the bias is stored (v itself without one).
template <int DT>
__device__ __forceinline__ float add_bias(const void* bias, int flags, int n, float v) {
  if (flags & kBiasT) v += bits_to_f32<DT>(static_cast<const u16*>(bias)[n]);
  else if (flags & kBiasF32) v += static_cast<const float*>(bias)[n];
  return v;
}

// out[m, n] = v (+ bias[n]) rounded to the activation dtype DT.
template <int DT>
__device__ __forceinline__ void store_out(u16* out, const void* bias, int flags, int m, int n, int ldo, float v) {
  out[static_cast<size_t>(m) * ldo + n] = f32_to_bits<DT>(add_bias<DT>(bias, flags, n, v));
}

// Two values rounded to DT, packed as one 32-bit word (a first, in the low half): adjacent outputs in one store.
template <int DT>
__device__ __forceinline__ u32 pack2_bits(float a, float b) {
  return f32_to_bits<DT>(a) | (static_cast<u32>(f32_to_bits<DT>(b)) << 16);
}

__device__ __forceinline__ u32 word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// D += A(16x16, row) * B(16x8, col), fp32 accumulation.
template <int DT>
__device__ __forceinline__ void mma_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if constexpr (DT == 0) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Programmatic dependent launch (sm_90). A kernel launched with programmatic stream serialization
// may start while the kernel ahead of it on the stream is still running. grid_dep_wait() holds the
// calling thread until that kernel has completed and its writes are visible: every read of what an
// earlier kernel may write, and every global write, must come after it. Without the launch attribute
// it returns at once. grid_dep_launch_dependents() lets the next such kernel be scheduled once every
// block of this grid has issued it or exited; it orders no memory (the dependent's own wait does).
// Before sm_90 launches are always serialized and both compile to nothing.
#if __CUDA_ARCH__ >= 900
constexpr bool kGridDep = true;  // whether the two below exist: a kernel may order its prologue around the wait
#else
constexpr bool kGridDep = false;
#endif

__device__ __forceinline__ void grid_dep_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dep_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#if __CUDA_ARCH__ >= 900
// Thread-block clusters (sm_90): barrier and distributed shared memory.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The last cluster barrier of a kernel whose blocks read each other's shared memory: no block may leave
// while another still reads it. Those reads have all returned by then (their values were summed and
// stored before the barrier, in program order), so the arrive need order nothing (.relaxed). With
// cluster_sync's .release arrive every thread first waits for its output stores to be acknowledged
// (MEMBAR.ALL.GPU ahead of the arrive in the SASS): a memory round trip on the launch's tail.
__device__ __forceinline__ void cluster_exit_sync() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// The address of local_addr (a shared-memory address of this block) in cluster block `rank`'s shared memory.
__device__ __forceinline__ u32 dsmem_map(u32 local_addr, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_addr), "r"(rank));
  return remote;
}

// The float at an address of dsmem_map.
__device__ __forceinline__ float ld_dsmem_f32(u32 remote_addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote_addr) : "memory");
  return v;
}
#endif

}  // namespace qops

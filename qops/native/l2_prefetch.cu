// Bring up to four byte ranges from DRAM into L2 and return: a hint, nothing is written.
//
// Why: at batch-1 decode the memory system idles while a small kernel runs (the attention of one
// token reads a few hundred KB), and the matmul after it then starts cold. Requesting that matmul's
// weight during the idle kernel lets it read L2 instead of DRAM (qops.native.l2_prefetch).
//
// Grid (x, y): y selects the range, each thread of x covers kChunk bytes of it. On sm_90 one
// cp.async.bulk.prefetch.L2 a thread asks the copy engine for the whole chunk (no register, no wait);
// before sm_90 the thread issues one prefetch.global.L2 a 128-byte line. The launcher passes ranges
// whose start and length are multiples of 16 bytes (what the bulk form requires).
#include "ptx.cuh"

#ifndef QOPS_PREFETCH_CHUNK
#define QOPS_PREFETCH_CHUNK 8192
#endif

namespace {
constexpr unsigned long long kChunk = QOPS_PREFETCH_CHUNK;
static_assert(kChunk % 128 == 0, "a chunk is whole 128-byte lines");
}  // namespace

extern "C" __global__ void qops_l2_prefetch(const char* p0, unsigned long long n0, const char* p1, unsigned long long n1,
                                            const char* p2, unsigned long long n2, const char* p3, unsigned long long n3) {
  const char* base = blockIdx.y == 0 ? p0 : blockIdx.y == 1 ? p1 : blockIdx.y == 2 ? p2 : p3;
  const unsigned long long bytes = blockIdx.y == 0 ? n0 : blockIdx.y == 1 ? n1 : blockIdx.y == 2 ? n2 : n3;
  const unsigned long long start = (static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x) * kChunk;
  if (start >= bytes) return;
  const unsigned long long left = bytes - start;
  const unsigned size = static_cast<unsigned>(left < kChunk ? left : kChunk);
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + start), "r"(size) : "memory");
#else
  for (unsigned off = 0; off < size; off += 128) qops::prefetch_l2_if(base + start + off, true);
#endif
}

// Where a block's dynamic shared memory starts in the shared window, for a kernel without static shared
// memory launched without a cluster: kernels that use it as an address immediate get it from here
// (qops.native.compiler.dynamic_shared_base), measured on the device rather than assumed (ptxas puts
// it at 0x400 on sm_90, at 0 before).
extern "C" __global__ void qops_smem_base(unsigned* out) {
  extern __shared__ unsigned char dynamic_smem[];
  out[0] = static_cast<unsigned>(__cvta_generic_to_shared(dynamic_smem));
}

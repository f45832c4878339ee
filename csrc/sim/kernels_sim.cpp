// The same kernel source as csrc/cuda/kernels.cu, compiled by the host compiler against the SIMT
// harness (csrc/kvattn/compat.cuh includes csrc/sim/simt.h when __CUDACC__ is not defined).
#include "../kvattn/dispatch.cuh"

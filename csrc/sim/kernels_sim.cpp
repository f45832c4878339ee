// The CUDA module's sources compiled by the host compiler against the SIMT harness
// (csrc/kvattn/compat.cuh includes csrc/sim/simt.h when __CUDACC__ is not defined), in one
// translation unit: the kernels' definitions, then the dispatch, which instantiates the ones its
// module's kvattn_built.h lists (setup.py generates one per harness module).
#include "../kvattn/decode.cuh"
#include "../kvattn/extend.cuh"
#include "../kvattn/resolve_pages.cuh"
#include "../kvattn/write_kv.cuh"
#include "../kvattn/dispatch.cuh"

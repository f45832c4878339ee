// The CPU-harness module `kvattn.backends.cuda_sim._sim`: the binding and the kernels in one
// translation unit, built by the host compiler (setup.py). The test-only variants below include it.
#ifndef KVATTN_MODULE_NAME
#define KVATTN_MODULE_NAME _sim
#endif
#define KVATTN_SIM 1
#include "../module.cpp"
#include "kernels_sim.cpp"

// Test-only: the harness module with the barrier between the K/V tile load and the logits removed.
// tests/test_cuda.py requires its results to disagree with the reference (the harness must catch it).
#define KVATTN_MODULE_NAME _sim_break_barrier
#define KVATTN_SIM_BREAK 1
#define KVATTN_FP32_ONLY 1
#include "module_sim.cpp"

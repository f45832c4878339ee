// Test-only: the harness module without the wait for the K/V stage's async copies before its use.
// tests/test_cuda.py requires its results to disagree with the reference (the harness must catch it).
#define KVATTN_MODULE_NAME _sim_break_barrier
#define KVATTN_SIM_BREAK 1
#define KVATTN_HALF_ONLY 1
#include "module_sim.cpp"

// Test-only: the harness module without the wait for the K/V stage's async copies before its use.
// tests/backends/test_cuda.py requires its results to disagree with the reference (the harness must
// catch it). Built with fp16 at head dims up to 64 only (setup.py HARNESS_SUBSET), all the tests
// need.
#define KVATTN_MODULE_NAME _sim_break_barrier
#define KVATTN_SIM_BREAK 1
#include "module_sim.cpp"

// Test-only: the harness module with a wrong fragment index where the probabilities of QK^T become
// the A operand of P @ V (two registers swapped). tests/backends/test_cuda.py requires its outputs
// to disagree with the reference (the harness's mma must hand each lane exactly the hardware's
// elements). Built with fp16 at head dims up to 64 only (setup.py HARNESS_SUBSET), all the tests
// need.
#define KVATTN_MODULE_NAME _sim_break_fragment
#define KVATTN_SIM_BREAK 3
#include "module_sim.cpp"

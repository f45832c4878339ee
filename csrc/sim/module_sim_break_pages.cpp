// Test-only: the harness module with an off-by-one in the report's page loop (the last page of every
// split is skipped). tests/backends/test_cuda.py requires its reports to disagree with the
// reference. Built with fp16 at head dims up to 64 only (setup.py HARNESS_SUBSET), all the tests
// need.
#define KVATTN_MODULE_NAME _sim_break_pages
#define KVATTN_SIM_BREAK 2
#include "module_sim.cpp"

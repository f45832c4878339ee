// Test-only: the harness module with an off-by-one in the report's page loop (the last page of every
// split is skipped). tests/test_cuda.py requires its reports to disagree with the reference.
#define KVATTN_MODULE_NAME _sim_break_pages
#define KVATTN_SIM_BREAK 2
#define KVATTN_HALF_ONLY 1
#include "module_sim.cpp"

// The binding of the CUDA module `kvattn.backends.cuda._C`, compiled by the host compiler and linked
// with the dispatch (csrc/cuda/dispatch.cu) and the generated kernel units by setup.py.
#define KVATTN_MODULE_NAME _C
#include "../module.cpp"

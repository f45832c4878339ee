// The CUDA build of the kernels (nvcc); the binding is csrc/module.cpp.
#include "../kvattn/dispatch.cuh"

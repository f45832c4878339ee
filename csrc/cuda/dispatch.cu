// The CUDA module's dispatch (nvcc): dispatch.cuh with the kernels' launchers declared only. The
// kernels themselves are compiled by the translation units setup.py generates from
// csrc/instantiations.py (build/generated/cuda/*.cu); the binding is csrc/module.cpp.
#include "kvattn/dispatch.cuh"

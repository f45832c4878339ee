// The kernels' launchers as the dispatch (dispatch.cuh) sees them: one struct per kernel template,
// whose static launch() enqueues that instantiation (grid, block, dynamic shared memory). Defined
// beside their kernels (decode.cuh, extend.cuh, resolve_pages.cuh, write_kv.cuh) and instantiated
// by the translation units setup.py generates from csrc/instantiations.py, so the dispatch compiles
// no kernel. Built<K> is true for the instantiations this module has (the generated
// kvattn_built.h, one per module: a build may compile a subset of the table).
#pragma once

#include <type_traits>

#include "compat.cuh"
#include "params.h"

namespace kvattn {

// VERDICT: reads a decode step's verdict instead of the table and the tags (CHECK only).
template <class T, class KV, int D, bool CHECK, bool VEC, bool VARIANT, bool VERDICT>
struct DecodeKernel {
  static cudaError_t launch(const DecodeParams& p, cudaStream_t stream);
};

// The split merge of the decode (num_splits > 1).
template <class T, bool VARIANT>
struct MergeKernel {
  static cudaError_t launch(const DecodeParams& p, cudaStream_t stream);
};

template <class T, int D, bool CHECK, bool VEC, bool VARIANT>
struct ExtendKernel {
  static cudaError_t launch(const ExtendParams& p, cudaStream_t stream);
};

// The checked extend's page pre-pass.
struct ResolvePagesKernel {
  static cudaError_t launch(const ExtendParams& p, cudaStream_t stream);
};

// The stamping writer: the verdict kernel, then the copy kernel of tokens of element type T into
// pools of element type KV (T, or an fp8 format the tokens are quantised into).
template <class T, class KV>
struct WriteKVKernel {
  static LaunchResult launch(const WriteKVParams& p, cudaStream_t stream);
};

template <class Kernel>
struct Built : std::false_type {};

}  // namespace kvattn

#include "kvattn_built.h"

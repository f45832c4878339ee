// The Python binding, the only C++ file that knows Python. It takes raw pointers (tensor.data_ptr()),
// sizes, strides and a stream handle, so it builds against no particular torch. Compiled twice by
// setup.py: KVATTN_MODULE_NAME=_C with the nvcc-built kernels, and KVATTN_MODULE_NAME=_sim (with
// KVATTN_SIM) with the same kernels built against the CPU harness.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstdint>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvattn/fp8.h"
#include "kvattn/params.h"
#include "kvattn/tiles.h"
#include "kvattn_selection.h"
#include "kvattn_sources.h"
#include "kvattn_tags.h"

#if defined(KVATTN_SIM)
#include "sim/selftest.h"
#include "sim/simt.h"
#endif

#ifndef KVATTN_SIM_BREAK
#define KVATTN_SIM_BREAK 0
#endif

namespace py = pybind11;

namespace {

// Reads the kernel arguments of csrc/kvattn/params.h's lists by name from the launcher's dict,
// and notes each name read: a dict with a name no list has is refused (see check_all_read), so a
// launcher and a kernel cannot disagree silently.
class Args {
 public:
  explicit Args(const py::dict& a, const char* op) : a_(a), op_(op) {}

  py::handle get(const char* key) {
    if (!a_.contains(key)) throw py::key_error(std::string("kvattn binding: ") + op_ + ": missing argument " + key);
    read_.insert(key);
    return a_[key];
  }
  template <class T>
  T PTR(const char* key) {
    return reinterpret_cast<T>(static_cast<uintptr_t>(get(key).cast<unsigned long long>()));
  }
  template <class T>
  T I64(const char* key) {
    return get(key).cast<int64_t>();
  }
  template <class T>
  T I32(const char* key) {
    const int64_t x = get(key).cast<int64_t>();
    if (x < INT32_MIN || x > INT32_MAX)
      throw std::invalid_argument(std::string("kvattn binding: ") + op_ + ": " + key + " is not a 32-bit int: " +
                                  std::to_string(x));
    return static_cast<T>(x);
  }
  template <class T>
  T F32(const char* key) {
    return get(key).cast<float>();
  }

  void check_all_read() const {
    std::string unknown;
    for (const auto& item : a_) {
      const std::string key = py::str(item.first);
      if (!read_.count(key)) unknown += (unknown.empty() ? "" : ", ") + key;
    }
    if (!unknown.empty())
      throw py::key_error(std::string("kvattn binding: ") + op_ + ": unknown argument(s) " + unknown +
                          " (csrc/kvattn/params.h lists the kernel arguments)");
  }

 private:
  const py::dict& a_;
  const char* op_;
  std::set<std::string> read_;
};

#define KVATTN_READ_ARG(kind, type, name) p.name = args.kind<type>(#name);

// The fields decode and extend share, and those the binding derives: the page divisor from
// page_size, the pool type from kv_dtype, the score switches.
void fill_attention(kvattn::AttentionParams& p, Args& args) {
  KVATTN_ATTENTION_ARGS(KVATTN_READ_ARG)
  const int page_size = args.I32<int>("page_size");
  if (page_size < 1 || page_size > 65535) throw std::invalid_argument("page_size must be in [1, 65535]");
  p.page = kvattn::make_page_div(page_size);
  p.var.window_left = args.I32<int>("window_left");
  p.var.window_right = args.I32<int>("window_right");
  p.var.soft_cap = args.F32<float>("soft_cap");
  p.var.alibi = args.PTR<const float*>("alibi");
  p.var.alibi_stride = args.I64<int64_t>("alibi_stride");
  p.var.sinks = args.PTR<const float*>("sinks");
  const int kv_dtype = args.I32<int>("kv_dtype");
  if (kv_dtype < 0 || kv_dtype > 2)
    throw std::invalid_argument("kv_dtype must be 0 (the query's), 1 (float8_e4m3fn) or 2 (float8_e5m2), got " +
                                std::to_string(kv_dtype));
  p.kv_type = static_cast<kvattn::KVType>(kv_dtype);
}

// The attention kernels take codes 0-2 (float32, float16, bfloat16); the writer's tokens also 3-4
// (float8_e4m3fn, float8_e5m2: stored as they are).
kvattn::DType dtype_of(int code, const char* op, int max_code = 2) {
  if (code < 0 || code > max_code)
    throw std::invalid_argument(std::string(op) + ": dtype code must be in [0, " + std::to_string(max_code) +
                                "], got " + std::to_string(code));
  return static_cast<kvattn::DType>(code);
}

// Runs a launcher without the GIL and turns a failure into a Python RuntimeError naming the kernel.
template <class Launch>
void launch_or_raise(Launch&& launch) {
  kvattn::LaunchResult r;
  std::string message;
  {
    py::gil_scoped_release release;
    r = launch();
    if (r.code != 0) message = r.message ? r.message : "unknown error";  // copied before anything relaunches
  }
  if (r.code != 0) {
    throw std::runtime_error(std::string("kvattn: ") + r.kernel + " failed: " + message + " (error " +
                             std::to_string(r.code) + ")");
  }
}

// Returns the launch plan the launcher chose (head chunking, shared memory, splits).
py::dict decode(const py::dict& a, int dtype, bool check, unsigned long long stream) {
  kvattn::DecodeParams p{};
  Args args(a, "decode");
  fill_attention(p, args);
  KVATTN_DECODE_ARGS(KVATTN_READ_ARG)
  args.check_all_read();
  const kvattn::DType type = dtype_of(dtype, "decode");
  launch_or_raise([&] { return kvattn::paged_decode(p, type, check, reinterpret_cast<void*>(stream)); });
  py::dict plan;
  plan["num_chunks"] = p.num_chunks;
  plan["d_split"] = p.d_split;
  plan["vec"] = p.vec;
  plan["smem_bytes"] = p.smem_bytes;
  plan["num_splits"] = p.num_splits;
  return plan;
}

// Returns the launch plan (tile rows, head chunking, shared memory).
py::dict extend(const py::dict& a, int dtype, bool check, unsigned long long stream) {
  kvattn::ExtendParams p{};
  Args args(a, "extend");
  fill_attention(p, args);
  KVATTN_EXTEND_ARGS(KVATTN_READ_ARG)
  p.var.custom_mask = args.PTR<const uint8_t*>("custom_mask");
  p.var.mask_start = args.PTR<const int64_t*>("mask_start");
  p.var.mask_numel = args.I64<int64_t>("mask_numel");
  if (p.var.custom_mask != nullptr && (p.var.mask_start == nullptr || p.var.mask_numel < 1))
    throw std::invalid_argument("extend: a custom_mask needs mask_start and mask_numel >= 1");
  args.check_all_read();
  if (p.num_slots < 1) throw std::invalid_argument("extend: num_slots must be in [1, 2**31)");
  const kvattn::DType type = dtype_of(dtype, "extend");
  launch_or_raise([&] { return kvattn::paged_extend(p, type, check, reinterpret_cast<void*>(stream)); });
  py::dict plan;
  plan["tokens_per_tile"] = p.tokens_per_tile;
  plan["heads_per_tile"] = p.heads_per_tile;
  plan["num_chunks"] = p.num_chunks;
  plan["d_split"] = p.d_split;
  plan["vec"] = p.vec;
  plan["fp8_wide"] = p.fp8_wide;
  plan["smem_bytes"] = p.smem_bytes;
  plan["num_slots"] = p.num_slots;
  return plan;
}

void write_kv(const py::dict& a, int dtype, unsigned long long stream) {
  kvattn::WriteKVParams p{};
  Args args(a, "write_kv");
  KVATTN_WRITE_KV_ARGS(KVATTN_READ_ARG)
  args.check_all_read();
  if (p.kv_dtype < 0 || p.kv_dtype > 2)
    throw std::invalid_argument("write_kv: kv_dtype must be 0 (the tokens'), 1 (float8_e4m3fn) or 2 (float8_e5m2), got " +
                                std::to_string(p.kv_dtype));
  const kvattn::DType type = dtype_of(dtype, "write_kv", 4);
  launch_or_raise([&] { return kvattn::write_kv(p, type, reinterpret_cast<void*>(stream)); });
}

// Pipeline stages (K/V shared-memory buffers per warp for decode, per block for extend) and the
// dynamic shared memory of each attention kernel, by padded head dim: the figures a static view of
// the kernels needs beside the SASS (tools/static_sm90.py).
py::dict tile_layouts() {
  py::dict decode, extend;
  const auto entry = [](int stages, int bytes) {
    py::dict e;
    e["stages"] = stages;
    e["shared_bytes"] = bytes;
    return e;
  };
  py::dict decode_fp8;  // fp8 pools: K/V rows of one byte an element
  // Every head-dim tile of csrc/instantiations.py (the generated KVATTN_HEAD_DIM_TILES).
#define KVATTN_TILE_LAYOUTS(D, FIRST)                                                                        \
  decode[py::int_(D)] = entry(kvattn::DecodeLayout<D>::kStages, kvattn::DecodeLayout<D>::kTotal);            \
  decode_fp8[py::int_(D)] = entry(kvattn::DecodeLayout<D, 1>::kStages, kvattn::DecodeLayout<D, 1>::kTotal); \
  extend[py::int_(D)] = entry(kvattn::ExtendLayout<D>::kStages, kvattn::ExtendLayout<D>::kTotal);
  KVATTN_HEAD_DIM_TILES(KVATTN_TILE_LAYOUTS)
#undef KVATTN_TILE_LAYOUTS
  decode[py::int_(kvattn::kLatentDim)] =
      entry(kvattn::DecodeLayout<kvattn::kLatentDim>::kStages, kvattn::DecodeLayout<kvattn::kLatentDim>::kTotal);
  py::dict d;
  d["decode"] = decode;
  d["decode_fp8"] = decode_fp8;
  d["extend"] = extend;
  return d;
}

std::map<std::string, int64_t> tag_layout() {
  using namespace kvattn::tags;
  return {
      {"STATE_MASK", STATE_MASK},
      {"STATE_FREE", STATE_FREE},
      {"STATE_RESERVED", STATE_RESERVED},
      {"STATE_WRITTEN", STATE_WRITTEN},
      {"VALID_LEN_SHIFT", VALID_LEN_SHIFT},
      {"VALID_LEN_BITS", VALID_LEN_BITS},
      {"VALID_LEN_MAX", VALID_LEN_MAX},
      {"OWNER_SHIFT", OWNER_SHIFT},
      {"OWNER_BITS", OWNER_BITS},
      {"OWNER_MAX", OWNER_MAX},
      {"Violation_OUT_OF_RANGE", Violation_OUT_OF_RANGE},
      {"Violation_FREE", Violation_FREE},
      {"Violation_RESERVED", Violation_RESERVED},
      {"Violation_OWNER_MISMATCH", Violation_OWNER_MISMATCH},
      {"Violation_UNWRITTEN", Violation_UNWRITTEN},
      {"WriteDrop_OUT_OF_RANGE", WriteDrop_OUT_OF_RANGE},
      {"WriteDrop_NOT_HELD", WriteDrop_NOT_HELD},
      {"WriteDrop_GAP", WriteDrop_GAP},
      {"WriteDrop_BAD_LENGTH", WriteDrop_BAD_LENGTH},
  };
}

}  // namespace

PYBIND11_MODULE(KVATTN_MODULE_NAME, m) {
  m.doc() = "kvattn CUDA kernels (raw-pointer binding; see kvattn/backends/cuda/launch.py)";
  m.def("decode", &decode, py::arg("args"), py::arg("dtype"), py::arg("check"), py::arg("stream"),
        "Enqueue the paged decode (and split merge); returns the launch plan. Raises RuntimeError\n"
        "naming the kernel on error.");
  m.def("extend", &extend, py::arg("args"), py::arg("dtype"), py::arg("check"), py::arg("stream"),
        "Enqueue the paged extend; returns the launch plan. Raises RuntimeError naming the kernel\n"
        "on error.");
  m.attr("EXTEND_ROWS") = py::int_(kvattn::kExtendRows);
  m.attr("SOURCE_DIGEST") = py::str(KVATTN_SOURCE_DIGEST);
  m.def("write_kv", &write_kv, py::arg("args"), py::arg("dtype"), py::arg("stream"),
        "Enqueue the stamping writer. Raises RuntimeError naming the kernel on error.");
  m.def("fp8_to_float", [](const std::vector<int>& bytes, const std::string& format) {
    if (format != "e4m3" && format != "e5m2")
      throw std::invalid_argument("fp8_to_float: format must be 'e4m3' or 'e5m2', got '" + format + "'");
    std::vector<float> out;
    for (int b : bytes) {
      if (b < 0 || b > 255) throw std::invalid_argument("fp8_to_float: bytes must be in [0, 255], got " + std::to_string(b));
      const uint8_t x = static_cast<uint8_t>(b);
      out.push_back(format == "e4m3" ? kvattn::e4m3_to_float(x) : kvattn::e5m2_to_float(x));
    }
    return out;
  }, py::arg("bytes"), py::arg("format"), "fp8 bytes as float by the kernels' conversion (csrc/kvattn/fp8.h).");
  m.def("tag_layout", &tag_layout, "The tag constants this module was compiled with.");
  m.def("tile_layouts", &tile_layouts, "Pipeline stages and dynamic shared memory of the attention kernels.");
  m.def("page_div", [](int size, const std::vector<int64_t>& ns) {
    const kvattn::PageDiv d = kvattn::make_page_div(size);
    std::vector<int64_t> q;
    for (int64_t n : ns) q.push_back(kvattn::page_of(d, n));
    return q;
  }, "floor(n / size) by the kernels' multiply-shift division (for the tests).");
  m.attr("SIMULATED") = py::bool_(
#if defined(KVATTN_SIM)
      true
#else
      false
#endif
  );
  m.attr("BREAK") = py::int_(KVATTN_SIM_BREAK);
  // The instantiations this module was built with (csrc/instantiations.py Selection.as_dict, plus
  // their count and the translation units): kvattn/backends/cuda/launch.py not_built reads it.
  m.attr("SELECTION") = py::module_::import("json").attr("loads")(py::str(KVATTN_SELECTION_JSON));
#if defined(KVATTN_SIM)
  m.def("harness_selftest", &kvsim::selftest::run, py::arg("mode"), py::arg("threads"),
        "Run a harness self-test kernel; returns (values, error message or '').");
  m.def("mma_selftest", &kvsim::selftest::mma, py::arg("a"), py::arg("b"), py::arg("bf16"),
        "A (16x16) @ B (16x8) through ldmatrix and mma.m16n8k16 on the harness, A and B given as\n"
        "16-bit patterns row by row; returns (per-lane fragments, D row by row, error or '').");
  m.def("set_seed", &kvsim::set_seed, py::arg("seed"), "Seed of the harness's thread and block order.");
  m.def("float_to_half_bits", [](const std::vector<float>& xs) {
    std::vector<uint16_t> out;
    for (float x : xs) out.push_back(kvsim::float_to_half_bits(x));
    return out;
  });
  m.def("float_to_bf16_bits", [](const std::vector<float>& xs) {
    std::vector<uint16_t> out;
    for (float x : xs) out.push_back(kvsim::float_to_bf16_bits(x));
    return out;
  });
  m.def("half_bits_to_float", [](const std::vector<uint16_t>& xs) {
    std::vector<float> out;
    for (uint16_t x : xs) out.push_back(kvsim::half_bits_to_float(x));
    return out;
  });
#endif
}

// The module `kvattn.backends.cpu._cpu`: the CPU paged attention of attention_cpu.h (decode and
// extend) and the writer of write_kv_cpu.h behind a binding that takes raw pointers, sizes and
// strides by name (kvattn/backends/cpu/__init__.py builds the dict), built by the host compiler
// (setup.py), and the keyed transfer digest's NH of digest_cpu.h. It runs without the GIL; the
// attention and the digest on up to ``threads`` threads.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/attention_cpu.h"
#include "cpu/digest_cpu.h"
#include "cpu/write_kv_cpu.h"
#include "kvattn_sources.h"

namespace py = pybind11;

namespace {

// Reads the call's arguments by name; a name nothing reads is refused, so the launcher and this
// binding cannot disagree silently.
class Args {
 public:
  explicit Args(const py::dict& a) : a_(a) {}
  py::handle get(const char* key) {
    if (!a_.contains(key)) throw py::key_error(std::string("kvattn cpu: missing argument ") + key);
    read_.insert(key);
    return a_[key];
  }
  template <class T>
  T ptr(const char* key) {
    return reinterpret_cast<T>(static_cast<uintptr_t>(get(key).cast<unsigned long long>()));
  }
  int64_t i64(const char* key) { return get(key).cast<int64_t>(); }
  void check_all_read() const {
    for (const auto& item : a_) {
      const std::string key = py::str(item.first);
      if (!read_.count(key)) throw py::key_error("kvattn cpu: unknown argument " + key);
    }
  }

 private:
  const py::dict& a_;
  std::set<std::string> read_;
};

void attend(const py::dict& a, int dtype, int mode) {
  using kvattn::cpu::Mode;
  kvattn::cpu::AttendParams p{};
  Args args(a);
  p.q = args.ptr<const void*>("q");
  p.k = args.ptr<const void*>("k");
  p.v = args.ptr<const void*>("v");
  p.cu_seqlens_q = args.ptr<const int32_t*>("cu_seqlens_q");
  p.block_table = args.ptr<const int32_t*>("block_table");
  p.seq_lens = args.ptr<const int32_t*>("seq_lens");
  p.tags = args.ptr<const int64_t*>("tags");
  p.expected = args.ptr<const int64_t*>("expected");
  p.verdict = args.ptr<const int64_t*>("verdict");
  p.out = args.ptr<void*>("out");
  p.lse = args.ptr<float*>("lse");
  p.violations = args.ptr<int32_t*>("violations");
  p.reasons = args.ptr<int32_t*>("reasons");
  p.checked = args.ptr<int32_t*>("checked");
  p.beyond = args.ptr<int32_t*>("beyond");
  p.page_reasons = args.ptr<int8_t*>("page_reasons");
#define KVATTN_CPU_INT(name) p.name = args.i64(#name);
  KVATTN_CPU_INT(batch)
  KVATTN_CPU_INT(total_q)
  KVATTN_CPU_INT(num_heads)
  KVATTN_CPU_INT(num_kv_heads)
  KVATTN_CPU_INT(head_dim)
  KVATTN_CPU_INT(head_dim_v)
  KVATTN_CPU_INT(page_size)
  KVATTN_CPU_INT(max_pages)
  KVATTN_CPU_INT(num_pages)
  KVATTN_CPU_INT(stride_qt)
  KVATTN_CPU_INT(stride_qh)
  KVATTN_CPU_INT(stride_kp)
  KVATTN_CPU_INT(stride_ks)
  KVATTN_CPU_INT(stride_kh)
  KVATTN_CPU_INT(stride_vp)
  KVATTN_CPU_INT(stride_vs)
  KVATTN_CPU_INT(stride_vh)
  KVATTN_CPU_INT(stride_bt)
  KVATTN_CPU_INT(stride_eb)
  KVATTN_CPU_INT(stride_ep)
  KVATTN_CPU_INT(stride_ot)
  KVATTN_CPU_INT(stride_oh)
  KVATTN_CPU_INT(window_left)
  KVATTN_CPU_INT(window_right)
  KVATTN_CPU_INT(threads)
#undef KVATTN_CPU_INT
  p.scale = args.get("scale").cast<float>();
  p.causal = args.get("causal").cast<bool>();
  p.soft_cap = args.get("soft_cap").cast<float>();
  const int64_t max_isa = args.i64("max_isa");
  args.check_all_read();
  if (max_isa < 0 || max_isa > 2) throw std::invalid_argument("kvattn cpu attend: max_isa must be 0, 1 or 2");
  const auto cap = static_cast<kvattn::cpu::Isa>(max_isa);
  if (p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads != 0)
    throw std::invalid_argument("kvattn cpu attend: num_heads must be a multiple of num_kv_heads");
  if (p.page_size < 1) throw std::invalid_argument("kvattn cpu attend: page_size must be >= 1");
  if (mode < 0 || mode > 2) throw std::invalid_argument("kvattn cpu attend: mode must be 0, 1 or 2");
  if (mode == 2 && p.cu_seqlens_q != nullptr)
    throw std::invalid_argument("kvattn cpu attend: a verdict is read by the decode only");
  if (dtype < 0 || dtype > 2) throw std::invalid_argument("kvattn cpu attend: dtype must be 0, 1 or 2");
  // The Python launcher passes what each mode reads; a call that does not is refused here rather
  // than read through a null pointer. The checked mode writes the report and reads the tags; the
  // verdict's mode reads the verdict, and the tags for the new token's page, whose refusal joins
  // the verdict's report.
  const auto need = [](const void* ptr, const char* name, const char* why) {
    if (ptr == nullptr)
      throw std::invalid_argument(std::string("kvattn cpu attend: ") + name + " is null, which " + why + " reads");
  };
  for (const auto& [ptr, name] : {std::pair<const void*, const char*>{p.k, "k"},
                                  {p.v, "v"},
                                  {p.block_table, "block_table"},
                                  {p.seq_lens, "seq_lens"}})
    need(ptr, name, "every call");
  // An extend with no query rows has empty q and out tensors, whose address may be 0.
  if (p.total_q > 0) {
    need(p.q, "q", "a call with query rows");
    need(p.out, "out", "a call with query rows");
  }
  if (mode != 0)
    for (const auto& [ptr, name] : {std::pair<const void*, const char*>{p.tags, "tags"},
                                    {p.expected, "expected"},
                                    {p.violations, "violations"},
                                    {p.reasons, "reasons"},
                                    {p.checked, "checked"},
                                    {p.beyond, "beyond"},
                                    {p.page_reasons, "page_reasons"}})
      need(ptr, name, mode == 1 ? "the checked mode" : "the verdict's mode");
  if (mode == 2) need(p.verdict, "verdict", "the verdict's mode");
  py::gil_scoped_release release;
  const auto run = [&](auto type) {
    using T = typename decltype(type)::type;
    if (mode == 0) kvattn::cpu::attend<T, Mode::kUnchecked>(p, cap);
    if (mode == 1) kvattn::cpu::attend<T, Mode::kChecked>(p, cap);
    if (mode == 2) kvattn::cpu::attend<T, Mode::kVerdict>(p, cap);
  };
  if (dtype == 0) run(kvattn::TypeTag<float>{});
  if (dtype == 1) run(kvattn::TypeTag<__half>{});
  if (dtype == 2) run(kvattn::TypeTag<__nv_bfloat16>{});
}

void write_kv(const py::dict& a) {
  kvattn::cpu::WriteParams p{};
  Args args(a);
  p.k = args.ptr<const char*>("k");
  p.v = args.ptr<const char*>("v");
  p.k_cache = args.ptr<char*>("k_cache");
  p.v_cache = args.ptr<char*>("v_cache");
  p.slot_mapping = args.ptr<const int64_t*>("slot_mapping");
  p.tags = args.ptr<int64_t*>("tags");
  p.owners = args.ptr<const int64_t*>("owners");
  p.landed = args.ptr<bool*>("landed");
  p.drop_reasons = args.ptr<int8_t*>("drop_reasons");
  p.dropped = args.ptr<int64_t*>("dropped");
#define KVATTN_CPU_INT(name) p.name = args.i64(#name);
  KVATTN_CPU_INT(num_tokens)
  KVATTN_CPU_INT(num_pages)
  KVATTN_CPU_INT(page_size)
  KVATTN_CPU_INT(num_kv_heads)
  KVATTN_CPU_INT(head_dim)
  KVATTN_CPU_INT(head_dim_v)
  KVATTN_CPU_INT(element_size)
  KVATTN_CPU_INT(stride_slots)
  KVATTN_CPU_INT(stride_owner)
  KVATTN_CPU_INT(stride_kt)
  KVATTN_CPU_INT(stride_kh)
  KVATTN_CPU_INT(stride_vt)
  KVATTN_CPU_INT(stride_vh)
  KVATTN_CPU_INT(stride_kp)
  KVATTN_CPU_INT(stride_ks)
  KVATTN_CPU_INT(stride_kkh)
  KVATTN_CPU_INT(stride_vp)
  KVATTN_CPU_INT(stride_vs)
  KVATTN_CPU_INT(stride_vvh)
#undef KVATTN_CPU_INT
  args.check_all_read();
  if (p.page_size < 1) throw std::invalid_argument("kvattn cpu write_kv: page_size must be >= 1");
  py::gil_scoped_release release;
  kvattn::cpu::write_kv(p);
}

// chunks: int64 [num_chunks, 8] (base address; page, slot and head strides in bytes; words per
// slot row and per head; first key word; pages of the pool); out: [n, 4] NH values as uint64.
void nh_pages(const py::dict& a) {
  Args args(a);
  const auto* table = args.ptr<const int64_t*>("chunks");
  const int64_t num_chunks = args.i64("num_chunks");
  const auto* pages = args.ptr<const int64_t*>("pages");
  const auto* lens = args.ptr<const int64_t*>("lens");
  const int64_t n = args.i64("n");
  const int64_t page_size = args.i64("page_size");
  const auto* key = args.ptr<const uint32_t*>("key");
  const int64_t key_words = args.i64("key_words");
  auto* out = args.ptr<uint64_t*>("out");
  const int64_t threads = args.i64("threads");
  args.check_all_read();
  // The Python caller validates every argument; these checks keep a wrong call from reading
  // outside the pools and the key.
  std::vector<kvattn::cpu::NhChunk> chunks(num_chunks);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t* row = table + c * 8;
    const int64_t words = row[4], head_words = row[5], offset = row[6], num_pages = row[7];
    if (head_words < 4 || head_words % 4 != 0 || words % head_words != 0)
      throw std::invalid_argument(
          "kvattn cpu nh_pages: words per head must be a multiple of 4 dividing the words per slot row");
    if (offset < 0 || offset + page_size * words + kvattn::cpu::kNhShift * (kvattn::cpu::kNhInstances - 1) > key_words)
      throw std::invalid_argument("kvattn cpu nh_pages: the key is shorter than the chunks read");
    for (int64_t i = 0; i < n; ++i)
      if (pages[i] < 0 || pages[i] >= num_pages)
        throw std::invalid_argument("kvattn cpu nh_pages: a page outside the pool");
    chunks[c] = {reinterpret_cast<const char*>(static_cast<uintptr_t>(row[0])), row[1], row[2], row[3], words, head_words,
                 offset};
  }
  py::gil_scoped_release release;
  kvattn::cpu::nh_pages(chunks.data(), num_chunks, pages, lens, n, page_size, key, out, std::max<int64_t>(threads, 1));
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "kvattn's CPU paged attention and writer (raw-pointer binding; see kvattn/backends/cpu)";
  m.def("attend", &attend, py::arg("args"), py::arg("dtype"), py::arg("mode"),
        "Run the paged decode (cu_seqlens_q 0) or extend on up to `threads` threads: dtype 0\n"
        "float32, 1 float16, 2 bfloat16; mode 0 unchecked, 1 checked, 2 through a verdict (decode).");
  m.def("write_kv", &write_kv, py::arg("args"),
        "Run the stamping writer on the calling thread (pools of the tokens' own dtype).");
  m.def("nh_pages", &nh_pages, py::arg("args"),
        "The keyed transfer digest's NH of pages of host pools (kvattn.transfer) on up to `threads`\n"
        "threads.");
  m.def(
      "isa",
      [](int max_isa) {
        if (max_isa < 0 || max_isa > 2) throw std::invalid_argument("kvattn cpu isa: max_isa must be 0, 1 or 2");
        static const char* const names[] = {"avx512", "avx2", "baseline"};
        return std::string(names[static_cast<int>(kvattn::cpu::widest_isa(static_cast<kvattn::cpu::Isa>(max_isa)))]);
      },
      py::arg("max_isa"), "The instruction set attend runs in on this CPU under max_isa (0 any, 1 AVX2, 2 none).");
  m.def(
      "exp_nonpositive", [](float x) { return kvattn::cpu::exp_nonpositive(x); }, py::arg("x"),
        "The readers' exp of a score minus its row's maximum (x <= 0), for its accuracy test.");
  m.attr("THREAD_WORK") = kvattn::cpu::kThreadWork;
  m.attr("TILE_ROWS") = kvattn::cpu::kTileRows;
  m.attr("SOURCE_DIGEST") = py::str(KVATTN_SOURCE_DIGEST);
}

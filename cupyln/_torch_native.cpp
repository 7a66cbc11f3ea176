// cupyln.torch's C++ layer: LayerNorm and RMSNorm of CUDA tensors with C++ autograd nodes, so
// that a module call costs the host what torch's own norm does (no Python autograd node, no
// Python on the backward's thread). It runs the prepared passes that cupyln's Python layer made
// (cupyln/_recipe.py: checks, scratch and launches as data) through the driver's launch call;
// a call whose recipe is unknown, whose pointers do not suit it, or whose stream is being
// captured into a CUDA graph asks the Python layer, which runs the call and hands back the
// recipe for the next ones. Built on first use by torch.utils.cpp_extension; no CUDA headers.

#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace py = pybind11;
using torch::autograd::variable_list;

namespace {

// ---------------------------------------------------------------------------- the driver

using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void*, void**, void**);
using CoopFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       unsigned, void*, void**);
using CapturingFn = int (*)(void*, int*);

struct Driver {
  LaunchFn launch = nullptr;
  CoopFn coop = nullptr;
  CapturingFn capturing = nullptr;
  Driver() {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(h, "cupyln: libcuda.so.1 could not be opened");
    launch = reinterpret_cast<LaunchFn>(dlsym(h, "cuLaunchKernel"));
    coop = reinterpret_cast<CoopFn>(dlsym(h, "cuLaunchCooperativeKernel"));
    capturing = reinterpret_cast<CapturingFn>(dlsym(h, "cuStreamIsCapturing"));
    TORCH_CHECK(launch && coop && capturing, "cupyln: the CUDA driver lacks a launch call");
  }
};

Driver& driver() {
  static Driver d;
  return d;
}

void* current_stream(const c10::Device& dev) {
  auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStreamNativeHandle(impl->getStream(dev));
}

// ---------------------------------------------------------------------------- recipes

struct Slot {  // one entry of a call's table: integers and pointers in i, floats in d
  int64_t i = 0;
  double d = 0.0;
};

struct Launch {
  void* fn;
  unsigned grid[3], block[3], smem;
  bool coop;
  std::string kinds;  // p pointer, i int64, f float32, d float64 (cupyln/_driver.py)
  std::vector<int> idx;
  std::vector<size_t> offs;  // each argument's byte offset in the C layout
  size_t bytes;
};

struct Recipe {
  int nptrs;
  std::vector<std::pair<int, int64_t>> checks;
  std::vector<std::pair<int, int>> same16;
  std::vector<int64_t> scratch, zeroed;
  std::vector<Slot> consts;
  int64_t scratch_bytes, zeroed_bytes;
  std::vector<Launch> launches;
};

size_t size_of(char k) { return k == 'f' ? 4 : 8; }

Recipe to_recipe(const py::tuple& t) {
  Recipe r;
  r.nptrs = t[0].cast<int>();
  r.checks = t[1].cast<std::vector<std::pair<int, int64_t>>>();
  r.same16 = t[2].cast<std::vector<std::pair<int, int>>>();
  r.scratch = t[3].cast<std::vector<int64_t>>();
  r.zeroed = t[4].cast<std::vector<int64_t>>();
  for (auto v : t[5].cast<py::list>()) {
    Slot s;
    if (py::isinstance<py::float_>(v)) s.d = v.cast<double>(); else s.i = v.cast<int64_t>();
    r.consts.push_back(s);
  }
  r.scratch_bytes = t[6].cast<int64_t>();
  r.zeroed_bytes = t[7].cast<int64_t>();
  for (auto item : t[8].cast<py::list>()) {
    auto l = item.cast<py::tuple>();
    Launch L;
    L.fn = reinterpret_cast<void*>(l[0].cast<uintptr_t>());
    auto grid = l[1].cast<std::vector<unsigned>>(), block = l[2].cast<std::vector<unsigned>>();
    for (int k = 0; k < 3; ++k) {
      L.grid[k] = grid[k];
      L.block[k] = block[k];
    }
    L.smem = l[3].cast<unsigned>();
    L.coop = l[4].cast<bool>();
    L.kinds = l[5].cast<std::string>();
    L.idx = l[6].cast<std::vector<int>>();
    TORCH_CHECK(L.kinds.size() == L.idx.size() && L.kinds.size() <= 32,
                "cupyln: a recipe's launch does not match its kinds");
    size_t off = 0;
    for (char k : L.kinds) {
      size_t n = size_of(k);
      off = (off + n - 1) / n * n;
      L.offs.push_back(off);
      off += n;
    }
    L.bytes = off;
    r.launches.push_back(std::move(L));
  }
  return r;
}

// The zeroed memory of each (device, stream): ticket counters and atomic sums, which the
// kernels leave zeroed again, so launches in one stream's order share it.
std::mutex zeroed_lock;
std::map<std::pair<int, void*>, at::Tensor> zeroed_memory;

int64_t zeroed_at(void* stream, int64_t bytes, const at::Tensor& like) {
  std::lock_guard<std::mutex> g(zeroed_lock);
  auto& t = zeroed_memory[{like.get_device(), stream}];
  if (!t.defined() || t.numel() < bytes) {
    t = at::zeros({std::max<int64_t>(bytes, 1 << 16)}, like.options().dtype(at::kByte));
  }
  return reinterpret_cast<int64_t>(t.data_ptr());
}

// Runs ``r`` on ``ptrs`` (the pass's pointers, 0 for none); false (nothing launched) where the
// pointers do not suit it or the stream is being captured.
bool run(const Recipe& r, const std::vector<int64_t>& ptrs, const at::Tensor& like,
         void* stream) {
  for (auto& c : r.checks)
    if (ptrs[c.first] & c.second) return false;
  for (auto& s : r.same16)
    if (ptrs[s.second] && ((ptrs[s.first] ^ ptrs[s.second]) & 15)) return false;
  auto& drv = driver();
  int capturing = 0;
  if (drv.capturing(stream, &capturing) != 0 || capturing != 0) return false;
  at::Tensor scratch;
  int64_t base = 0, zero = 0;
  if (r.scratch_bytes) {
    scratch = at::empty({r.scratch_bytes}, like.options().dtype(at::kByte));
    base = reinterpret_cast<int64_t>(scratch.data_ptr());
  }
  if (r.zeroed_bytes) zero = zeroed_at(stream, r.zeroed_bytes, like);
  std::vector<Slot> table(ptrs.size() + r.scratch.size() + r.zeroed.size() + r.consts.size());
  size_t n = 0;
  for (auto p : ptrs) table[n++].i = p;
  for (auto o : r.scratch) table[n++].i = base + o;
  for (auto o : r.zeroed) table[n++].i = zero + o;
  for (auto& c : r.consts) table[n++] = c;
  alignas(8) unsigned char buf[32 * 8];
  void* params[32];
  for (auto& L : r.launches) {
    for (size_t a = 0; a < L.idx.size(); ++a) {
      const Slot& s = table[L.idx[a]];
      unsigned char* at = buf + L.offs[a];
      switch (L.kinds[a]) {
        case 'f': {
          float f = static_cast<float>(s.d);
          std::memcpy(at, &f, 4);
          break;
        }
        case 'd':
          std::memcpy(at, &s.d, 8);
          break;
        default:
          std::memcpy(at, &s.i, 8);
      }
      params[a] = at;
    }
    int err = L.coop ? drv.coop(L.fn, L.grid[0], L.grid[1], L.grid[2], L.block[0], L.block[1],
                                L.block[2], L.smem, stream, params)
                     : drv.launch(L.fn, L.grid[0], L.grid[1], L.grid[2], L.block[0],
                                  L.block[1], L.block[2], L.smem, stream, params, nullptr);
    TORCH_CHECK(err == 0, "cupyln: kernel launch failed with CUDA error ", err, " (grid (",
                L.grid[0], ", ", L.grid[1], ", ", L.grid[2], "), block (", L.block[0], ", ",
                L.block[1], ", ", L.block[2], "), ", L.smem, " bytes of shared memory)");
  }
  return true;
}

// ---------------------------------------------------------------------------- the registry

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& k) const {
    size_t h = 1469598103934665603ull;
    for (auto v : k) h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
    return h;
  }
};

constexpr size_t kMaxRecipes = 4096;  // signatures kept; past that the table starts over
std::mutex registry_lock;
std::unordered_map<std::vector<int64_t>, std::shared_ptr<const Recipe>, KeyHash> registry;

void add_tensor(std::vector<int64_t>& k, const at::Tensor& t) {
  if (!t.defined()) {
    k.push_back(-1);
    return;
  }
  k.push_back(static_cast<int64_t>(t.scalar_type()));
  k.push_back(t.get_device());
  k.push_back(t.dim());
  for (auto s : t.sizes()) k.push_back(s);
  for (auto s : t.strides()) k.push_back(s);
}

void add_tensors(std::vector<int64_t>& k, std::initializer_list<const at::Tensor*> ts) {
  for (auto* t : ts) add_tensor(k, *t);
}

int64_t bits(double v) {
  int64_t b;
  std::memcpy(&b, &v, 8);
  return b;
}

std::shared_ptr<const Recipe> find(const std::vector<int64_t>& key) {
  std::lock_guard<std::mutex> g(registry_lock);
  auto it = registry.find(key);
  return it == registry.end() ? nullptr : it->second;
}

void keep(const std::vector<int64_t>& key, const py::object& recipe) {
  if (recipe.is_none()) return;
  auto r = std::make_shared<const Recipe>(to_recipe(recipe.cast<py::tuple>()));
  std::lock_guard<std::mutex> g(registry_lock);
  if (registry.size() >= kMaxRecipes) registry.clear();
  registry[key] = std::move(r);
}

std::vector<int64_t> ptrs_of(std::initializer_list<const at::Tensor*> ts) {
  std::vector<int64_t> p;
  for (auto* t : ts)
    p.push_back(t && t->defined() ? reinterpret_cast<int64_t>(t->data_ptr()) : 0);
  return p;
}

// The Python layer's calls for what this layer does not run itself (set by cupyln.torch).
py::object* py_forward = nullptr;
py::object* py_backward = nullptr;

at::Tensor opt(const c10::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

// ---------------------------------------------------------------------------- the passes

// ``t`` where the kernels take its rows as they are (the last k axes dense, the leading ones
// one pitch apart: cupyln/_layout.py's row_stride), else a contiguous copy (a transposed view,
// a zero stride): made here, the call keeps its recipe, where the Python layer would copy it
// on every call.
at::Tensor rows(const at::Tensor& t, int64_t k) {
  if (!t.defined() || t.is_contiguous()) return t;
  int64_t nd = t.dim(), expect = 1, span = -1;
  for (int64_t i = nd - 1; i >= nd - k; --i) {
    if (t.size(i) != 1 && t.stride(i) != expect) return t.contiguous();
    expect *= t.size(i);
  }
  for (int64_t i = nd - k - 1; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (t.stride(i) == 0 || (span >= 0 && t.stride(i) != span)) return t.contiguous();
    span = t.stride(i) * t.size(i);
  }
  return t;
}

// y, the statistics (mean undefined for RMSNorm) and, with a residual, h = x + residual (in
// ``hdtype``), into new tensors.
std::vector<at::Tensor> forward_pass(const at::Tensor& x_in, const at::Tensor& w,
                                     const at::Tensor& b, const at::Tensor& r_in, int64_t k,
                                     double eps, bool is_ln, double woff,
                                     c10::optional<at::ScalarType> hdtype) {
  c10::DeviceGuard guard(x_in.device());
  const at::Tensor x = rows(x_in, k), r = rows(r_in, k);
  auto lead = x.sizes().slice(0, x.dim() - k);  // k checked by fits()
  auto dense = x.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor y = at::empty(x.sizes(), dense);
  auto stat = x.options().dtype(at::kFloat);
  at::Tensor mean = is_ln ? at::empty(lead, stat) : at::Tensor(), rstd = at::empty(lead, stat);
  at::Tensor h = r.defined() ? at::empty(x.sizes(), dense.dtype(hdtype.value_or(
                                                        x.scalar_type())))
                             : at::Tensor();
  std::vector<int64_t> key{is_ln ? 1 : 2, k, bits(eps), bits(woff),
                           hdtype ? static_cast<int64_t>(*hdtype) : -1};
  add_tensors(key, {&x, &w, &b, &r});
  auto recipe = find(key);
  if (!recipe || !run(*recipe, ptrs_of({&x, &w, &b, &r, &y, &mean, &rstd, &h}), x,
                      current_stream(x.device()))) {
    py::gil_scoped_acquire gil;
    keep(key, (*py_forward)(is_ln, x, w, b, r, y, mean, rstd, h, k, eps, woff, hdtype));
  }
  return {y, mean, rstd, h};
}

at::Tensor param_like(const at::Tensor& w, const at::Tensor& x, int64_t k) {
  if (w.defined()) return at::empty_like(w, at::MemoryFormat::Contiguous);
  return at::empty(x.sizes().slice(x.dim() - k), x.options());
}

// dx (with dresidual added), dgamma, dbeta where asked; undefined elsewhere.
std::vector<at::Tensor> backward_pass(const at::Tensor& dy_in, const at::Tensor& x_in,
                                      const at::Tensor& w, const at::Tensor& mean,
                                      const at::Tensor& rstd, const at::Tensor& dres_in,
                                      int64_t k, bool is_ln, double woff, bool det, bool need_dx,
                                      bool need_dw, bool need_db) {
  if (!(need_dx || need_dw || need_db)) return {at::Tensor(), at::Tensor(), at::Tensor()};
  c10::DeviceGuard guard(x_in.device());
  const at::Tensor dy = rows(dy_in, k), x = rows(x_in, k), dres = rows(dres_in, k);
  at::Tensor dx = need_dx ? at::empty(x.sizes(), x.options().memory_format(
                                          at::MemoryFormat::Contiguous))
                          : at::Tensor();
  at::Tensor dw = need_dw ? param_like(w, x, k) : at::Tensor();
  at::Tensor db = need_db ? param_like(w, x, k) : at::Tensor();
  std::vector<int64_t> key{is_ln ? 3 : 4, need_dx, need_dw, need_db, det, bits(woff)};
  add_tensors(key, {&dy, &x, &w, &mean, &rstd, &dres});
  auto recipe = find(key);
  if (!recipe || !run(*recipe, ptrs_of({&dy, &x, &w, &mean, &rstd, &dres, &dx, &dw, &db}), x,
                      current_stream(x.device()))) {
    py::gil_scoped_acquire gil;
    keep(key, (*py_backward)(is_ln, dy, x, w, mean, rstd, dres, dx, dw, db, det, woff));
  }
  return {dx, dw, db};
}

// ---------------------------------------------------------------------------- autograd

using torch::autograd::Node;
using torch::autograd::SavedVariable;

// The node of a recorded call, made as torch's generated nodes are: no autograd context and no
// Function::apply, whose general handling of outputs, views and saved data a norm does not
// need. Edges to x, the residual (fused add only), weight and bias.
struct NormBackward : public Node {
  SavedVariable rows_in, weight, mean, rstd;  // rows_in: x as the kernels read it, or h
  int64_t k = 0;
  bool is_ln = true, add = false, det = false;
  double woff = 0.0;
  at::ScalarType x_dtype = at::kFloat, r_dtype = at::kFloat;

  std::string name() const override {
    return add ? "cupyln::AddNormBackward" : "cupyln::NormBackward";
  }

  void release_variables() override {
    rows_in.reset_data();
    weight.reset_data();
    mean.reset_data();
    rstd.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    at::Tensor h = rows_in.unpack(), w0 = weight.unpack();
    size_t pw = add ? 2 : 1;  // the weight's edge
    bool need_x = task_should_compute_output(0), need_r = add && task_should_compute_output(1);
    bool need_h = need_x || need_r, need_w = task_should_compute_output(pw);
    bool need_b = is_ln && task_should_compute_output(pw + 1);
    // dy in h's dtype (the backward's rule); zero where y was not used
    at::Tensor dy = !grads[0].defined() ? at::zeros_like(h, at::MemoryFormat::Contiguous)
                    : add               ? grads[0].to(h.scalar_type())
                                        : grads[0];
    at::Tensor dh = add && need_h ? grads[1] : at::Tensor();  // undefined: h not used
    // parameters in h's dtype or float32 (16-bit weights of a float32 h: widened)
    at::Tensor w = !w0.defined() || w0.scalar_type() == h.scalar_type() ||
                           w0.scalar_type() == at::kFloat
                       ? w0
                       : w0.to(at::kFloat);
    auto g = backward_pass(dy, h, w, mean.unpack(), rstd.unpack(), dh, k, is_ln, woff,
                           det || at::globalContext().deterministicAlgorithms(), need_h,
                           need_w, need_b);
    if (!add) return {g[0], g[1], g[2]};
    auto pdt = w0.defined() ? w0.scalar_type() : h.scalar_type();
    auto as = [](const at::Tensor& t, bool need, at::ScalarType d) {
      return need ? t.to(d) : at::Tensor();
    };
    return {as(g[0], need_x, x_dtype), as(g[0], need_r, r_dtype), as(g[1], need_w, pdt),
            as(g[2], need_b, pdt)};
  }
};

// A new node, owned as this torch's graph owns nodes (std::shared_ptr with torch's deleter
// before torch 2.13, c10::intrusive_ptr since).
template <class N>
auto new_node() {
  using Owner = decltype(torch::autograd::Edge::function);
  if constexpr (std::is_same_v<Owner, std::shared_ptr<Node>>) {
    return std::shared_ptr<N>(new N(), [](N* n) { deleteNode(n); });  // found by ADL
  } else {
    return c10::make_intrusive<N>();
  }
}

// y (then h, with a residual) of a call autograd records, their node made here.
std::vector<at::Tensor> recorded_pass(const at::Tensor& x, const at::Tensor& r,
                                      const at::Tensor& w, const at::Tensor& b, int64_t k,
                                      double eps, bool is_ln, double woff,
                                      c10::optional<at::ScalarType> hdtype, bool det) {
  using torch::autograd::collect_next_edges;
  auto node = new_node<NormBackward>();
  node->add = r.defined();
  node->set_next_edges(node->add ? collect_next_edges(x, r, w, b) : collect_next_edges(x, w, b));
  at::Tensor xr;
  std::vector<at::Tensor> out;
  {
    at::AutoGradMode off(false);  // rows()' copy, where it makes one, is not recorded
    xr = node->add ? x : rows(x, k);
    out = forward_pass(xr, w, b, r, k, eps, is_ln, woff, hdtype);
  }
  // h is this node's output: saved as a view without its history (no cycle), sharing its
  // version counter (an in-place change before the backward is still caught)
  node->rows_in = SavedVariable(node->add ? out[3].tensor_data() : xr, false);
  node->weight = SavedVariable(w, false);
  node->mean = SavedVariable(out[1], false);
  node->rstd = SavedVariable(out[2], false);
  node->k = k;
  node->is_ln = is_ln;
  node->woff = woff;
  node->det = det;
  node->x_dtype = x.scalar_type();
  node->r_dtype = node->add ? r.scalar_type() : x.scalar_type();
  torch::autograd::set_history(out[0], node);
  if (node->add) torch::autograd::set_history(out[3], node);
  return out;
}

// The number of normalized axes where x ends in ``shape``, else 0: the Python layer then takes
// the call and names what is wrong.
int64_t fits(const at::Tensor& x, const std::vector<int64_t>& shape) {
  int64_t k = static_cast<int64_t>(shape.size());
  bool ok = k >= 1 && k <= x.dim();
  for (int64_t i = 0; ok && i < k; ++i) ok = x.size(x.dim() - k + i) == shape[i];
  return ok ? k : 0;
}

// Whether autograd records a call: grad mode on and an input that requires grad. Otherwise the
// pass runs without an autograd node, as torch's own operations do.
bool recorded(std::initializer_list<at::Tensor> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const auto& t : ts)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

// Whether an input carries a forward-mode tangent: the Python layer takes such calls (its
// autograd.Function names what it lacks).
bool dual(std::initializer_list<at::Tensor> ts) {
  for (const auto& t : ts)
    if (t.defined() && t._fw_grad(0).defined()) return true;
  return false;
}

// y, or (y, h) with a residual; empty where the C++ layer does not take the call.
std::vector<at::Tensor> call(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                             const at::Tensor& b, const std::vector<int64_t>& shape, double eps,
                             bool is_ln, double woff, c10::optional<at::ScalarType> hdtype,
                             bool det) {
  int64_t k = fits(x, shape);
  if (!k || dual({x, r, w, b})) return {};
  if (recorded({x, r, w, b})) return recorded_pass(x, r, w, b, k, eps, is_ln, woff, hdtype, det);
  return forward_pass(x, w, b, r, k, eps, is_ln, woff, hdtype);
}

// ---------------------------------------------------------------------------- the custom ops
//
// CUDA kernels of cupyln's custom ops (defined by cupyln.torch; torch.compile's graphs call
// them): the passes above in place of the ops' Python implementations, which still take a call
// whose shapes do not hold together, to name what is wrong. Gradients not asked for come back
// as 0-element tensors, as the ops' schemas have it.

py::object* py_ops = nullptr;  // the ops' Python implementations, a dict by op name
std::unique_ptr<torch::Library> ops_library;

using Two = std::tuple<at::Tensor, at::Tensor>;
using Three = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Four = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

template <typename Out, typename... Args>
Out python_op(const char* name, const Args&... args) {
  py::gil_scoped_acquire gil;
  return (*py_ops)[name](args...).template cast<Out>();
}

std::vector<int64_t> ints(c10::SymIntArrayRef shape) {
  std::vector<int64_t> v;
  for (const auto& s : shape) v.push_back(s.expect_int());
  return v;
}

Three ln_fwd_op(const at::Tensor& x, const c10::optional<at::Tensor>& w,
                const c10::optional<at::Tensor>& b, c10::SymIntArrayRef shape, double eps,
                bool det, double woff) {
  auto s = ints(shape);
  int64_t k = fits(x, s);
  if (!k) return python_op<Three>("layer_norm_fwd", x, w, b, s, eps, det, woff);
  auto o = forward_pass(x, opt(w), opt(b), at::Tensor(), k, eps, true, woff, c10::nullopt);
  return {o[0], o[1], o[2]};
}

Two rms_fwd_op(const at::Tensor& x, const c10::optional<at::Tensor>& w,
               c10::SymIntArrayRef shape, double eps, bool det, double woff) {
  auto s = ints(shape);
  int64_t k = fits(x, s);
  if (!k) return python_op<Two>("rms_norm_fwd", x, w, s, eps, det, woff);
  auto o = forward_pass(x, opt(w), at::Tensor(), at::Tensor(), k, eps, false, woff, c10::nullopt);
  return {o[0], o[2]};
}

Four add_ln_fwd_op(const at::Tensor& x, const at::Tensor& r, const c10::optional<at::Tensor>& w,
                   const c10::optional<at::Tensor>& b, c10::SymIntArrayRef shape, double eps,
                   c10::optional<at::ScalarType> hdtype, double woff, bool det) {
  auto s = ints(shape);
  int64_t k = fits(x, s);
  if (!k) return python_op<Four>("add_layer_norm_fwd", x, r, w, b, s, eps, hdtype, woff, det);
  auto o = forward_pass(x, opt(w), opt(b), r, k, eps, true, woff, hdtype);
  return {o[0], o[1], o[2], o[3]};
}

Three add_rms_fwd_op(const at::Tensor& x, const at::Tensor& r, const c10::optional<at::Tensor>& w,
                     c10::SymIntArrayRef shape, double eps, c10::optional<at::ScalarType> hdtype,
                     double woff, bool det) {
  auto s = ints(shape);
  int64_t k = fits(x, s);
  if (!k) return python_op<Three>("add_rms_norm_fwd", x, r, w, s, eps, hdtype, woff, det);
  auto o = forward_pass(x, opt(w), at::Tensor(), r, k, eps, false, woff, hdtype);
  return {o[0], o[2], o[3]};
}

at::Tensor filled(const at::Tensor& g, const at::Tensor& x) {
  return g.defined() ? g : at::empty({0}, x.options());
}

Three ln_bwd_op(const at::Tensor& dy, const at::Tensor& x, const c10::optional<at::Tensor>& w,
                const at::Tensor& mean, const at::Tensor& rstd, bool need_dx, bool need_dw,
                bool need_db, bool det, const c10::optional<at::Tensor>& dres, double woff) {
  int64_t k = x.dim() - rstd.dim();
  if (k < 1)
    return python_op<Three>("layer_norm_bwd", dy, x, w, mean, rstd, need_dx, need_dw, need_db,
                            det, dres, woff);
  at::Tensor wt = opt(w);
  auto g = backward_pass(dy, x, wt, mean, rstd, opt(dres), k,
                         true, woff, det, need_dx, need_dw && wt.defined(), need_db);
  return {filled(g[0], x), filled(g[1], x), filled(g[2], x)};
}

Two rms_bwd_op(const at::Tensor& dy, const at::Tensor& x, const c10::optional<at::Tensor>& w,
               const at::Tensor& rstd, bool need_dx, bool need_dw, bool det,
               const c10::optional<at::Tensor>& dres, double woff) {
  int64_t k = x.dim() - rstd.dim();
  if (k < 1)
    return python_op<Two>("rms_norm_bwd", dy, x, w, rstd, need_dx, need_dw, det, dres, woff);
  at::Tensor wt = opt(w);
  auto g = backward_pass(dy, x, wt, at::Tensor(), rstd, opt(dres),
                         k, false, woff, det, need_dx, need_dw && wt.defined(), false);
  return {filled(g[0], x), filled(g[1], x)};
}

// Registers the kernels above for CUDA tensors, once; ``impls``: the ops' Python
// implementations by name. A kernel whose signature disagrees with its op's schema throws here.
void register_ops(py::object impls) {
  if (ops_library) return;
  py_ops = new py::object(std::move(impls));
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "cupyln",
                                              c10::DispatchKey::CUDA, __FILE__, __LINE__);
  lib->impl("layer_norm_fwd", TORCH_FN(ln_fwd_op));
  lib->impl("rms_norm_fwd", TORCH_FN(rms_fwd_op));
  lib->impl("add_layer_norm_fwd", TORCH_FN(add_ln_fwd_op));
  lib->impl("add_rms_norm_fwd", TORCH_FN(add_rms_fwd_op));
  lib->impl("layer_norm_bwd", TORCH_FN(ln_bwd_op));
  lib->impl("rms_norm_bwd", TORCH_FN(rms_bwd_op));
  ops_library = std::move(lib);
}

void set_python(py::object fwd, py::object bwd) {
  delete py_forward;
  delete py_backward;
  py_forward = new py::object(std::move(fwd));
  py_backward = new py::object(std::move(bwd));
}

void clear() {
  std::lock_guard<std::mutex> g(registry_lock);
  registry.clear();
}

size_t size() {
  std::lock_guard<std::mutex> g(registry_lock);
  return registry.size();
}

// ---------------------------------------------------------------------------- the calls
//
// norm and add_norm as METH_FASTCALL functions: arguments read straight from the call's array,
// without pybind11's overload dispatch and argument conversion, on every module call.

const at::Tensor& tensor_arg(PyObject* o, const char* name) {
  TORCH_CHECK_TYPE(THPVariable_Check(o), name, " must be a torch.Tensor");
  return THPVariable_Unpack(o);
}

at::Tensor optional_arg(PyObject* o, const char* name) {
  return o == Py_None ? at::Tensor() : tensor_arg(o, name);
}

std::vector<int64_t> shape_arg(PyObject* o) {
  TORCH_CHECK_TYPE(PyTuple_Check(o) || PyList_Check(o),
                   "normalized_shape must be a tuple or list of ints");
  PyObject** items = PySequence_Fast_ITEMS(o);
  std::vector<int64_t> v(PySequence_Fast_GET_SIZE(o));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = PyLong_AsLongLong(items[i]);
    if (v[i] == -1 && PyErr_Occurred()) throw python_error();
  }
  return v;
}

double float_arg(PyObject* o) {
  double v = PyFloat_AsDouble(o);
  if (v == -1.0 && PyErr_Occurred()) throw python_error();
  return v;
}

bool bool_arg(PyObject* o) {
  int v = PyObject_IsTrue(o);
  if (v < 0) throw python_error();
  return v;
}

// norm(x, weight, bias, shape, eps, is_ln, weight_offset, deterministic): y, or None where x
// does not end in shape.
PyObject* norm_call(PyObject*, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(n == 8, "norm takes 8 arguments, got ", n);
  auto out = call(tensor_arg(a[0], "x"), at::Tensor(), optional_arg(a[1], "weight"),
                  optional_arg(a[2], "bias"), shape_arg(a[3]), float_arg(a[4]), bool_arg(a[5]),
                  float_arg(a[6]), c10::nullopt, bool_arg(a[7]));
  if (out.empty()) Py_RETURN_NONE;
  return THPVariable_Wrap(std::move(out[0]));
  END_HANDLE_TH_ERRORS
}

// add_norm(x, residual, weight, bias, shape, eps, is_ln, weight_offset, residual_dtype,
// deterministic): (y, h), or () where x does not end in shape.
PyObject* add_norm_call(PyObject*, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(n == 10, "add_norm takes 10 arguments, got ", n);
  c10::optional<at::ScalarType> hdtype;
  if (a[8] != Py_None) {
    TORCH_CHECK_TYPE(THPDtype_Check(a[8]), "residual_dtype must be a torch.dtype or None");
    hdtype = reinterpret_cast<THPDtype*>(a[8])->scalar_type;
  }
  auto out = call(tensor_arg(a[0], "x"), tensor_arg(a[1], "residual"),
                  optional_arg(a[2], "weight"), optional_arg(a[3], "bias"), shape_arg(a[4]),
                  float_arg(a[5]), bool_arg(a[6]), float_arg(a[7]), hdtype, bool_arg(a[9]));
  PyObject* t = PyTuple_New(out.empty() ? 0 : 2);
  if (t && !out.empty()) {
    PyTuple_SET_ITEM(t, 0, THPVariable_Wrap(std::move(out[0])));
    PyTuple_SET_ITEM(t, 1, THPVariable_Wrap(std::move(out[3])));
  }
  return t;
  END_HANDLE_TH_ERRORS
}

PyMethodDef calls[] = {
    {"norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(norm_call)),
     METH_FASTCALL, "LayerNorm (is_ln) or RMSNorm of x over its trailing shape; None where x "
     "does not end in it"},
    {"add_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(add_norm_call)),
     METH_FASTCALL, "(y, h): the norm of h = x + residual, and h; () where x does not end in "
     "the shape"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  for (PyMethodDef* d = calls; d->ml_name; ++d)
    m.add_object(d->ml_name, py::reinterpret_steal<py::object>(PyCFunction_New(d, nullptr)));
  m.def("set_python", &set_python, "the Python layer's forward and backward calls");
  m.def("register_ops", &register_ops, "the custom ops' CUDA kernels, given their Python "
        "implementations by name");
  m.def("clear", &clear, "forget every recipe");
  m.def("size", &size, "recipes kept");
}

// host/compiled_call.cpp -- the compiled entry of rtkernels' cached calls (host C++, no CUDA
// headers; rtkernels/compiled_call.py builds it with the system compiler at first use).
//
// A cached call (rtkernels/call_cache.py) repeats a planned launch with new data pointers. In
// Python that costs about 20 us of host time a call on a slow host: the signature, the output's
// allocation and the launch are each a few Python-to-C++ crossings. Here the same three happen in
// one crossing. Python registers a call after it has passed every check and been planned:
// register() computes the signature from the call's own arguments (the same function lookups use,
// so the two cannot disagree) and keeps its program: temporaries to allocate and launches whose
// pointer parameters name a source (q, k, v, the output, the decay tensor, the states, a temporary)
// plus a byte offset. call() computes the signature, finds the program, allocates, launches on
// torch's current stream and returns the output, or the miss sentinel for anything it does not
// know (Python then runs its own path). A call with autograd history gets this file's autograd
// node, whose backward calls Python's (the same body as the Python Function).

#include <Python.h>

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <array>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                         void**);
using ReplaceFn = int (*)(void*, void*);  // cuTensorMapReplaceAddress

// Where a pointer parameter's value comes from (plus the slot's byte offset).
enum Source : int { SRC_Q, SRC_K, SRC_V, SRC_OUT, SRC_DECAY, SRC_S0, SRC_FINAL, SRC_CONST, SRC_TEMP0 };
constexpr int MAX_WORDS = 96;        // 8-byte kernel parameter words of one launch
constexpr size_t MAX_ENTRIES = 512;  // a backstop: Python's call cache, as large, clears this one with itself
constexpr int INVALID_CONTEXT = 201;  // CUDA_ERROR_INVALID_CONTEXT: a thread with no current context
constexpr int MAP_BYTES = 128, MAX_MAPS = 5;  // a CUtensorMap (64-byte aligned)

struct Launch {
  void* fn = nullptr;
  std::array<unsigned, 3> grid{}, block{};
  unsigned smem = 0;
  int n_head = 0;                                  // pointer parameters, then one struct parameter
  std::vector<uint64_t> words;                     // the parameters as planned (pointer slots: written per call)
  std::vector<std::pair<int, int64_t>> head;       // per pointer slot: (source, byte offset)
  std::vector<unsigned char> maps;                 // the tensor-map parameter as encoded (empty: none)
  std::vector<std::pair<int, int64_t>> map_sources;  // map i follows pointer slot .first less .second bytes
};

struct Entry : c10::intrusive_ptr_target {
  std::vector<Launch> launches;
  std::vector<std::vector<int64_t>> temps;  // the shape of each float32 temporary
  std::vector<int64_t> out_shape, state_shape;
  at::ScalarType out_dtype = at::kFloat;
  int device = 0;
  bool need_state = false, device_decay = false;
  int keep_temp = -1;                // the temporary the backward receives (the forward's states), or -1
  PyObject* owner = nullptr;         // keeps the planned launch (and the tensors it reads) alive
  PyObject* info = nullptr;          // what the Python backward needs besides the tensors
  ~Entry() override {
    if (owner || info) {
      PyGILState_STATE s = PyGILState_Ensure();
      Py_XDECREF(owner);
      Py_XDECREF(info);
      PyGILState_Release(s);
    }
  }
};

// Never destroyed: an Entry's destructor takes the GIL, which is gone at process exit (Python
// clears the map at exit instead, rtkernels/compiled_call.py).
auto& g_entries = *new std::unordered_map<std::string, c10::intrusive_ptr<Entry>>();
LaunchFn g_launch = nullptr;
ReplaceFn g_replace = nullptr;
PyObject* g_backward = nullptr;      // rtkernels.compiled_call.node_backward
PyObject* g_answers = nullptr;       // rtkernels.autotune.answers (its _generation, _forced)
PyObject* g_plan = nullptr;          // rtkernels.methods.chunk.plan (its overrides)
PyObject* g_decay = nullptr;         // rtkernels.decay (its _strict)
PyObject* g_overrides = nullptr;     // the overrides object in force at init (a strong reference)
PyObject* g_miss = nullptr;          // returned by call() for a call it does not know
PyObject* s_generation = nullptr, * s_forced = nullptr, * s_overrides = nullptr, * s_strict = nullptr;

// ---- the signature ----------------------------------------------------------------------------
struct Key {
  std::string bytes;
  void word(int64_t x) { bytes.append(reinterpret_cast<const char*>(&x), sizeof x); }
  bool text(PyObject* s) {  // false for a string with no UTF-8 form (lone surrogates)
    Py_ssize_t n = 0;
    const char* p = PyUnicode_AsUTF8AndSize(s, &n);
    if (p == nullptr) {
      PyErr_Clear();
      return false;
    }
    word(n);
    bytes.append(p, (size_t)n);
    return true;
  }
  void tensor(const at::Tensor& t, bool grad) {
    word((int64_t)t.scalar_type());
    word(t.get_device());
    word(t.dim());
    for (int64_t s : t.sizes()) word(s);
    for (int64_t s : t.strides()) word(s);
    word(grad && t.requires_grad());
  }
};

bool is_tensor(PyObject* o) { return Py_TYPE(o) == (PyTypeObject*)THPVariableClass; }

// A CUDA tensor with storage, or false.
bool cuda_tensor(const at::Tensor& t) { return t.defined() && t.is_cuda() && t.has_storage(); }

// A number (float or int, exact types) as a tag and its value; false for anything else.
bool number(Key& key, PyObject* o) {
  int64_t v = 0;
  if (PyFloat_CheckExact(o)) {
    const double d = PyFloat_AS_DOUBLE(o);
    std::memcpy(&v, &d, sizeof d);  // by its bits
    key.word(1);
  } else if (PyLong_CheckExact(o)) {
    int overflow = 0;
    v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    key.word(2);
  } else {
    return false;
  }
  key.word(v);
  return true;
}

// The decay (or decay_rate) argument: None, a number, or a CUDA tensor (Tensor or Parameter).
bool decay_arg(Key& key, PyObject* o, bool grad, bool strict) {
  if (o == Py_None) {
    key.word(0);
    return true;
  }
  if (THPVariable_CheckExact(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (strict || !cuda_tensor(t)) return false;  // a CPU tensor is keyed by value: Python's path
    key.word(3);
    key.tensor(t, grad);
    return true;
  }
  return number(key, o);
}

PyObject* module_attr(PyObject* m, PyObject* name) { return PyObject_GetAttr(m, name); }  // new reference

// The process state a plan depends on (autotune answers, forced candidate, overrides, strict
// checks): false where a call must take Python's path (a forced candidate, overrides other than
// the ones at init, strict decay checks), else the answers' generation into the key.
bool epoch(Key& key, bool& strict) {
  PyObject* forced = module_attr(g_answers, s_forced);
  PyObject* over = module_attr(g_plan, s_overrides);
  PyObject* st = module_attr(g_decay, s_strict);
  PyObject* gen = module_attr(g_answers, s_generation);
  bool ok = forced == Py_None && over == g_overrides && st != nullptr && gen != nullptr && PyLong_CheckExact(gen);
  if (ok) {
    strict = st == Py_True;
    key.word(PyLong_AsLongLong(gen));
  }
  Py_XDECREF(forced);
  Py_XDECREF(over);
  Py_XDECREF(st);
  Py_XDECREF(gen);
  if (!ok) PyErr_Clear();
  return ok;
}

// The signature of (q, k, v, decay, decay_rate, scale, method, layout, initial_state,
// return_state, fp32_precision), or false where Python's path must run.
bool signature(PyObject* const* a, Key& key) {
  PyObject *q = a[0], *k = a[1], *v = a[2], *s0 = a[8], *ret = a[9], *prec = a[10];
  if (!is_tensor(q) || !is_tensor(k) || !is_tensor(v)) return false;
  const at::Tensor &tq = THPVariable_Unpack(q), &tk = THPVariable_Unpack(k), &tv = THPVariable_Unpack(v);
  if (!cuda_tensor(tq) || !cuda_tensor(tk) || !cuda_tensor(tv)) return false;
  bool strict = false;
  key.bytes.reserve(512);
  if (!epoch(key, strict)) return false;
  const bool grad = at::GradMode::is_enabled();
  key.word(grad);
  for (const at::Tensor* t : {&tq, &tk, &tv}) key.tensor(*t, grad);
  key.word(((uintptr_t)tq.data_ptr() | (uintptr_t)tk.data_ptr() | (uintptr_t)tv.data_ptr()) & 15);
  if (!decay_arg(key, a[3], grad, strict) || !decay_arg(key, a[4], grad, strict)) return false;
  if (!number(key, a[5])) return false;
  if (!PyUnicode_CheckExact(a[6]) || !PyUnicode_CheckExact(a[7]) || !key.text(a[6]) || !key.text(a[7])) return false;
  if (s0 == Py_None) {
    key.word(0);
  } else {
    if (!is_tensor(s0)) return false;
    const at::Tensor& t = THPVariable_Unpack(s0);
    if (!cuda_tensor(t)) return false;
    key.word(1);
    key.tensor(t, grad);
  }
  if (ret != Py_True && ret != Py_False) return false;
  key.word(ret == Py_True);
  if (prec == Py_None) {  // float32 follows torch's matmul setting, read per call as Python's key reads it
    key.word(tq.scalar_type() == at::kFloat ? 16 + (int64_t)at::globalContext().float32MatmulPrecision() : 0);
  } else {
    if (!PyUnicode_CheckExact(prec) || !key.text(prec)) return false;
  }
  return true;
}

// ---- running a program ----------------------------------------------------------------------
struct Operands {
  const at::Tensor *q, *k, *v, *decay, *s0;  // decay, s0: may be undefined
  at::Tensor out, final;
  std::vector<at::Tensor> temps;
};

// The output, the final state and the temporaries (float32, in the shapes Python's path gives them).
void allocate(const Entry& e, Operands& x, const at::TensorOptions& opts) {
  x.out = at::empty(e.out_shape, opts.dtype(e.out_dtype));
  if (e.need_state) x.final = at::empty(e.state_shape, opts.dtype(at::kFloat));
  for (const auto& shape : e.temps) x.temps.push_back(at::empty(shape, opts.dtype(at::kFloat)));
}

// Allocates and launches the program; false (nothing launched) where the first launch finds no
// current context, which Python's path handles.
bool run(const Entry& e, Operands& x) {
  auto impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::Device dev(c10::DeviceType::CUDA, (c10::DeviceIndex)e.device);
  std::optional<c10::DeviceGuard> guard;
  if (impl->getDevice() != dev) guard.emplace(dev);
  allocate(e, x, at::TensorOptions().device(dev));
  uint64_t base[SRC_TEMP0 + 8] = {};
  auto ptr = [](const at::Tensor* t) { return t && t->defined() ? (uint64_t)(uintptr_t)t->data_ptr() : 0; };
  base[SRC_Q] = ptr(x.q), base[SRC_K] = ptr(x.k), base[SRC_V] = ptr(x.v), base[SRC_OUT] = ptr(&x.out);
  base[SRC_DECAY] = ptr(x.decay), base[SRC_S0] = ptr(x.s0), base[SRC_FINAL] = ptr(&x.final);
  for (size_t i = 0; i < x.temps.size(); ++i) base[SRC_TEMP0 + i] = ptr(&x.temps[i]);
  void* stream = impl->getStream(dev).native_handle();
  for (size_t l = 0; l < e.launches.size(); ++l) {
    const Launch& L = e.launches[l];
    uint64_t words[MAX_WORDS];
    void* params[MAX_WORDS + 2];
    std::memcpy(words, L.words.data(), L.words.size() * 8);
    for (int i = 0; i < L.n_head; ++i) words[i] = base[L.head[i].first] + (uint64_t)L.head[i].second;
    const int slots = std::min<int>((int)L.words.size(), L.n_head + 1);
    for (int i = 0; i < slots; ++i) params[i] = &words[i];
    alignas(64) unsigned char maps[MAX_MAPS * MAP_BYTES];
    params[slots] = maps;  // read only where the kernel has that parameter
    if (!L.maps.empty()) {  // this call's copy of the maps, each pointed at its tensor
      std::memcpy(maps, L.maps.data(), L.maps.size());
      for (size_t m = 0; m < L.map_sources.size(); ++m) {
        void* at = (void*)(uintptr_t)(words[L.map_sources[m].first] - (uint64_t)L.map_sources[m].second);
        const int st = g_replace(maps + MAP_BYTES * m, at);
        TORCH_CHECK(st == 0, "rtkernels: cuTensorMapReplaceAddress failed with CUDA driver status ", st);
      }
    }
    const int status = g_launch(L.fn, L.grid[0], L.grid[1], L.grid[2], L.block[0], L.block[1], L.block[2], L.smem,
                                stream, params, nullptr);
    if (status == INVALID_CONTEXT && l == 0) return false;
    TORCH_CHECK(status == 0, "rtkernels: cuLaunchKernel failed with CUDA driver status ", status);
  }
  return true;
}

// ---- autograd ---------------------------------------------------------------------------------
at::Tensor unpack_or_none(PyObject* o) { return o == Py_None ? at::Tensor() : THPVariable_Unpack(o); }
PyObject* wrap(const at::Tensor& t) {
  if (!t.defined()) Py_RETURN_NONE;
  return THPVariable_Wrap(t);
}

// The autograd node of a call with history, a plain Node rather than a torch::autograd::Function
// (that one wraps inputs and outputs in bookkeeping this call does not need: about a third of
// its host cost). Edges: q, k, v, the decay source, s0 (an absent one is an empty edge).
using NodePtr = decltype(torch::autograd::Edge::function);  // shared_ptr or (newer torch) intrusive_ptr

template <class N, class P = NodePtr>
auto new_node() {
  if constexpr (std::is_same_v<P, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<N>(new N());
  } else {
    return c10::make_intrusive<N>();
  }
}

struct CachedAttentionBackward : torch::autograd::Node {
  torch::autograd::SavedVariable q, k, v, s0;
  c10::intrusive_ptr<Entry> entry;
  at::Tensor decay, kept;  // the CUDA decay tensor read (or undefined); the forward's states kept (or undefined)

  std::string name() const override { return "RtkernelsCachedCallBackward"; }

  void release_variables() override {
    q.reset_data(), k.reset_data(), v.reset_data(), s0.reset_data();
    kept = at::Tensor();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const at::Tensor tq = q.unpack(), tk = k.unpack(), tv = v.unpack(), ts0 = s0.unpack();
    at::Tensor g_out = grads.size() > 0 ? grads[0] : at::Tensor();
    at::Tensor g_state = grads.size() > 1 ? grads[1] : at::Tensor();
    torch::autograd::variable_list out(5);
    pybind11::gil_scoped_acquire gil;
    PyObject* flags = PyTuple_New(5);
    for (int i = 0; i < 5; ++i) PyTuple_SET_ITEM(flags, i, PyBool_FromLong(task_should_compute_output((size_t)i)));
    PyObject* args[] = {entry->info, wrap(tq), wrap(tk), wrap(tv), wrap(decay), wrap(ts0), wrap(kept), flags,
                        wrap(g_out), wrap(g_state)};
    constexpr size_t nargs = sizeof args / sizeof args[0];
    PyObject* res = PyObject_Vectorcall(g_backward, args, nargs, nullptr);
    for (size_t i = 1; i < nargs; ++i) Py_DECREF(args[i]);
    if (!res) throw python_error();
    const bool shaped = PyTuple_Check(res) && PyTuple_GET_SIZE(res) == 5;
    for (int i = 0; shaped && i < 5; ++i) out[(size_t)i] = unpack_or_none(PyTuple_GET_ITEM(res, i));
    Py_DECREF(res);
    TORCH_CHECK(shaped, "rtkernels: the compiled entry's backward expected 5 gradients");
    return out;
  }
};

// Runs a call with autograd history: the program, then the node as the outputs' grad_fn. False
// (nothing launched, no node) where run() is.
bool run_with_history(const c10::intrusive_ptr<Entry>& e, Operands& x, const at::Tensor& source) {
  if (!run(*e, x)) return false;
  auto node = new_node<CachedAttentionBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(*x.q, *x.k, *x.v, source, *x.s0));
  node->q = torch::autograd::SavedVariable(*x.q, false);
  node->k = torch::autograd::SavedVariable(*x.k, false);
  node->v = torch::autograd::SavedVariable(*x.v, false);
  node->s0 = torch::autograd::SavedVariable(*x.s0, false);
  node->entry = e;
  node->decay = *x.decay;
  if (e->keep_temp >= 0) node->kept = x.temps[(size_t)e->keep_temp];
  torch::autograd::set_history(x.out, node);
  if (e->need_state) torch::autograd::set_history(x.final, node);
  return true;
}

// ---- the Python functions ---------------------------------------------------------------------
// call(q, k, v, decay, decay_rate, scale, method, layout, initial_state, return_state,
// fp32_precision): the output (or (output, final state)), or the miss sentinel.
PyObject* call(PyObject*, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(g_miss != nullptr, "rtk_compiled_call: init() first");
  if (n != 11 || g_launch == nullptr) return Py_NewRef(g_miss);
  static thread_local Key key;  // its buffer reused: no allocation a call
  key.bytes.clear();
  if (!signature(a, key)) return Py_NewRef(g_miss);
  auto it = g_entries.find(key.bytes);
  if (it == g_entries.end()) return Py_NewRef(g_miss);
  const c10::intrusive_ptr<Entry> e = it->second;
  const at::Tensor &q = THPVariable_Unpack(a[0]), &k = THPVariable_Unpack(a[1]), &v = THPVariable_Unpack(a[2]);
  PyObject* decay_obj = a[4] == Py_None ? a[3] : a[4];
  const at::Tensor decay = e->device_decay ? THPVariable_Unpack(decay_obj) : at::Tensor();
  const at::Tensor s0 = a[8] == Py_None ? at::Tensor() : THPVariable_Unpack(a[8]);
  Operands x{&q, &k, &v, &decay, &s0, {}, {}, {}};
  const at::Tensor source = decay.defined() && decay.requires_grad() ? decay : at::Tensor();
  if (!(e->info ? run_with_history(e, x, source) : run(*e, x))) return Py_NewRef(g_miss);
  at::Tensor out = std::move(x.out), final = std::move(x.final);
  if (a[9] != Py_True) return THPVariable_Wrap(out);
  PyObject* pair = PyTuple_New(2);
  PyTuple_SET_ITEM(pair, 0, THPVariable_Wrap(out));
  PyTuple_SET_ITEM(pair, 1, wrap(final));
  return pair;
  END_HANDLE_TH_ERRORS
}

std::vector<int64_t> int_list(PyObject* seq) {
  std::vector<int64_t> r;
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (!fast) throw python_error();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i)
    r.push_back(PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i)));
  Py_DECREF(fast);
  if (PyErr_Occurred()) throw python_error();
  return r;
}

// register(args, spec) with args the call's 11 arguments (a tuple) and spec = (device, out_shape,
// out_dtype_example, need_state, state_shape, device_decay, temps, launches, keep_temp, owner,
// info): True if kept. launches: (function, grid, block, smem, n_head, words bytes, maps bytes,
// map sources, head) with head a sequence of (source, offset). info None: a call without
// autograd history.
PyObject* register_call(PyObject*, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(n == 2 && PyTuple_Check(a[0]) && PyTuple_GET_SIZE(a[0]) == 11 && PyTuple_Check(a[1]) &&
                  PyTuple_GET_SIZE(a[1]) == 11, "register(args, spec): bad arguments");
  Key key;
  if (g_launch == nullptr || !signature(&PyTuple_GET_ITEM(a[0], 0), key)) Py_RETURN_FALSE;
  PyObject* const* s = &PyTuple_GET_ITEM(a[1], 0);
  auto e = c10::make_intrusive<Entry>();
  e->device = (int)PyLong_AsLong(s[0]);
  e->out_shape = int_list(s[1]);
  e->out_dtype = THPVariable_Unpack(s[2]).scalar_type();
  e->need_state = PyObject_IsTrue(s[3]);
  e->state_shape = int_list(s[4]);
  e->device_decay = PyObject_IsTrue(s[5]);
  PyObject* temps = PySequence_Fast(s[6], "temps: a sequence of shapes");
  if (!temps) throw python_error();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(temps); ++i)
    e->temps.push_back(int_list(PySequence_Fast_GET_ITEM(temps, i)));
  Py_DECREF(temps);
  TORCH_CHECK(e->temps.size() <= 8, "register: at most 8 temporaries");
  PyObject* launches = PySequence_Fast(s[7], "launches: a sequence");
  if (!launches) throw python_error();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(launches); ++i) {
    PyObject* l = PySequence_Fast_GET_ITEM(launches, i);
    TORCH_CHECK(PyTuple_Check(l) && PyTuple_GET_SIZE(l) == 9, "register: a launch is a 9-tuple");
    Launch L;
    L.fn = PyLong_AsVoidPtr(PyTuple_GET_ITEM(l, 0));
    auto g = int_list(PyTuple_GET_ITEM(l, 1)), b = int_list(PyTuple_GET_ITEM(l, 2));
    TORCH_CHECK(g.size() == 3 && b.size() == 3, "register: grid and block have 3 sizes");
    for (int j = 0; j < 3; ++j) L.grid[j] = (unsigned)g[j], L.block[j] = (unsigned)b[j];
    L.smem = (unsigned)PyLong_AsLong(PyTuple_GET_ITEM(l, 3));
    L.n_head = (int)PyLong_AsLong(PyTuple_GET_ITEM(l, 4));
    PyObject* raw = PyTuple_GET_ITEM(l, 5);
    TORCH_CHECK(PyBytes_Check(raw) && PyBytes_GET_SIZE(raw) % 8 == 0 && PyBytes_GET_SIZE(raw) <= 8 * MAX_WORDS,
                "register: words are bytes, 8 a parameter, at most ", MAX_WORDS);
    L.words.resize((size_t)PyBytes_GET_SIZE(raw) / 8);
    std::memcpy(L.words.data(), PyBytes_AS_STRING(raw), (size_t)PyBytes_GET_SIZE(raw));
    PyObject* maps = PyTuple_GET_ITEM(l, 6);
    TORCH_CHECK(PyBytes_Check(maps) && PyBytes_GET_SIZE(maps) <= MAX_MAPS * MAP_BYTES, "register: maps are bytes");
    L.maps.assign(PyBytes_AS_STRING(maps), PyBytes_AS_STRING(maps) + PyBytes_GET_SIZE(maps));
    PyObject* msrc = PySequence_Fast(PyTuple_GET_ITEM(l, 7), "map sources: a sequence");
    if (!msrc) throw python_error();
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(msrc); ++j) {
      auto src = int_list(PySequence_Fast_GET_ITEM(msrc, j));
      TORCH_CHECK(src.size() == 2, "register: a map source is (pointer slot, delta)");
      L.map_sources.emplace_back((int)src[0], src[1]);
    }
    Py_DECREF(msrc);
    TORCH_CHECK(L.map_sources.empty() || g_replace != nullptr, "register: maps to move but no cuTensorMapReplaceAddress");
    TORCH_CHECK(L.map_sources.size() * MAP_BYTES <= L.maps.size(), "register: more map sources than maps");
    PyObject* head = PySequence_Fast(PyTuple_GET_ITEM(l, 8), "head: a sequence");
    if (!head) throw python_error();
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(head); ++j) {
      auto slot = int_list(PySequence_Fast_GET_ITEM(head, j));
      TORCH_CHECK(slot.size() == 2 && slot[0] >= 0 && slot[0] < SRC_TEMP0 + (int64_t)e->temps.size(),
                  "register: a head slot is (source, offset)");
      L.head.emplace_back((int)slot[0], slot[1]);
    }
    Py_DECREF(head);
    TORCH_CHECK((int)L.head.size() == L.n_head && L.n_head <= (int)L.words.size(), "register: head size");
    for (const auto& src : L.map_sources) TORCH_CHECK(src.first >= 0 && src.first < L.n_head, "register: map source");
    e->launches.push_back(std::move(L));
  }
  Py_DECREF(launches);
  e->keep_temp = (int)PyLong_AsLong(s[8]);
  TORCH_CHECK(e->keep_temp < (int)e->temps.size(), "register: keep_temp");
  e->owner = Py_NewRef(s[9]);
  e->info = s[10] == Py_None ? nullptr : Py_NewRef(s[10]);
  if (PyErr_Occurred()) throw python_error();
  if (g_entries.size() >= MAX_ENTRIES) g_entries.clear();
  g_entries[key.bytes] = e;
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// init(launch_address, replace_address, backward, answers, plan, decay, miss): the addresses of
// cuLaunchKernel and cuTensorMapReplaceAddress (0: none), the Python backward of a node, the
// modules whose state a plan depends on, the miss sentinel.
PyObject* init(PyObject*, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(n == 7, "init: seven arguments");
  g_entries.clear();
  g_launch = reinterpret_cast<LaunchFn>(PyLong_AsVoidPtr(a[0]));
  g_replace = reinterpret_cast<ReplaceFn>(PyLong_AsVoidPtr(a[1]));
  PyObject** slots[] = {&g_backward, &g_answers, &g_plan, &g_decay, &g_miss};
  for (int i = 0; i < 5; ++i) Py_XSETREF(*slots[i], Py_NewRef(a[i + 2]));
  Py_XSETREF(g_overrides, PyObject_GetAttr(g_plan, s_overrides));
  if (!g_overrides) throw python_error();
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* clear(PyObject*, PyObject* const*, Py_ssize_t) {
  g_entries.clear();
  Py_RETURN_NONE;
}

PyObject* size(PyObject*, PyObject* const*, Py_ssize_t) { return PyLong_FromSize_t(g_entries.size()); }

PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)())call, METH_FASTCALL, "The cached call, or the miss sentinel."},
    {"register", (PyCFunction)(void (*)())register_call, METH_FASTCALL, "Keep a checked, planned call."},
    {"init", (PyCFunction)(void (*)())init, METH_FASTCALL, "Set the launch function and the Python hooks."},
    {"clear", (PyCFunction)(void (*)())clear, METH_FASTCALL, "Forget every call."},
    {"size", (PyCFunction)(void (*)())size, METH_FASTCALL, "How many calls are kept."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "rtk_compiled_call", "rtkernels' compiled entry of cached calls.",
                      -1, methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_rtk_compiled_call() {
  s_generation = PyUnicode_InternFromString("_generation");
  s_forced = PyUnicode_InternFromString("_forced");
  s_overrides = PyUnicode_InternFromString("overrides");
  s_strict = PyUnicode_InternFromString("_strict");
  return PyModule_Create(&module);
}

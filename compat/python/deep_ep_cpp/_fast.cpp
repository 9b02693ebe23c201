// deepep-nccl's compiled host path (built on first use by _fast.py): per call it allocates the
// outputs through torch's C++ API, fills the C ABI's argument structs and calls it, in one Python
// call, with the waits of DeepEP's stream protocol (_fast_streams.h). The ctypes path does the same
// in about 1.3-2x the host time (bench/bench_ll_host.py, bench/bench_normal.py's host rows). The
// ops: _fast_ll.h (low-latency), _fast_normal.h (layout, normal dispatch and combine),
// _fast_internode.h (internode dispatch and combine); _fast_direct.h: the ops' direct entries, which
// sync() binds as the Buffer's methods of DeepEP's names (no Python between the caller and C++).
#include "_fast_internode.h"
#include "_fast_ll.h"
#include "_fast_normal.h"

#include <initializer_list>
#include <utility>

namespace {

template <typename Ops>
using DirectEntry = std::pair<const char*, py::object (Ops::*)(const py::args&, const py::kwargs&)>;

// Defines the direct entries (_fast_direct.h) of `cls`; returns their names (what sync() binds).
template <typename Ops>
py::tuple def_direct(py::class_<Ops>& cls, std::initializer_list<DirectEntry<Ops>> entries) {
  py::list names;
  for (const auto& [name, entry] : entries) {
    cls.def(name, entry, "DeepEP's Buffer method of that name (the fast case; anything else: the Buffer class's)");
    names.append(name);
  }
  return py::tuple(names);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace deepep_fast;
  m.doc() = "deepep-nccl's compiled host path (see _fast.py)";
  m.attr("DISPATCH_ARGS_BYTES") = py::int_(sizeof(DeepepLowLatencyDispatchArgs));
  m.attr("COMBINE_ARGS_BYTES") = py::int_(sizeof(DeepepLowLatencyCombineArgs));
  m.attr("BAD_INPUT") = py::int_(kBadInput);
  m.attr("DRIVER_ERROR") = py::int_(kDriverError);
  m.attr("ORDER_BEFORE") = py::int_(kOrderBefore);
  m.attr("ORDER_AFTER") = py::int_(kOrderAfter);
  m.attr("CUDA_STREAM_LEGACY") = py::int_(kCudaStreamLegacy);
  py::class_<StreamOrder>(m, "StreamOrder").def(py::init<int>()).def("usable", &StreamOrder::usable);
  m.attr("NEW_SHAPE") = py::int_(kNewShape);
  m.attr("MAX_DISPATCH_SHAPES") = py::int_(kMaxDispatchShapes);
  py::class_<LlOps> ll_ops(m, "LlOps");
  ll_ops.def(py::init<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, int, py::object>())
      .def("add_dispatch_shape", &LlOps::add_dispatch_shape)
      .def("dispatch", &LlOps::dispatch)
      .def("combine", &LlOps::combine)
      .def("clean", &LlOps::clean)
      .def("next_combine_buffer", &LlOps::next_combine_buffer)
      .def("bind_buffer", &LlOps::bind_buffer);
  m.attr("LL_DIRECT_ENTRIES") = def_direct<LlOps>(
      ll_ops, {{kLowLatencyDispatch, &LlOps::low_latency_dispatch}, {kLlDispatch, &LlOps::ll_dispatch},
               {kLowLatencyCombine, &LlOps::low_latency_combine}, {kLlCombine, &LlOps::ll_combine}});
  m.def("set_python_helpers", &set_python_helpers, py::arg("raise_status"), py::arg("raise_driver_error"),
        py::arg("config_type"), py::arg("event_handle_type"));
  m.def("current_stream_event", &current_stream_event,
        "torch.cuda.Event() recorded on the current stream, as EventHandle() makes it (after set_python_helpers)");
  LlDispatchHook::add_to(m, PYBIND11_TOSTRING(TORCH_EXTENSION_NAME) ".LlDispatchHook");
  LlCombineHook::add_to(m, PYBIND11_TOSTRING(TORCH_EXTENSION_NAME) ".LlCombineHook");
  py::class_<NormalOps> normal_ops(m, "NormalOps");
  normal_ops
      .def(py::init<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                    int64_t, int>())
      .def("layout", &NormalOps::layout)
      .def("dispatch", &NormalOps::dispatch)
      .def("combine", &NormalOps::combine)
      .def("bind_buffer", &NormalOps::bind_buffer);
  m.attr("NORMAL_DIRECT_ENTRIES") = def_direct<NormalOps>(
      normal_ops, {{kGetDispatchLayout, &NormalOps::get_dispatch_layout},
                   {kIntranodeDispatch, &NormalOps::intranode_dispatch},
                   {kIntranodeCombine, &NormalOps::intranode_combine}});
  py::class_<InternodeOps>(m, "InternodeOps")
      .def(py::init<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t, int>())
      .def("dispatch", &InternodeOps::dispatch)
      .def("combine", &InternodeOps::combine);
}

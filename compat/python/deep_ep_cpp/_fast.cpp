// deepep-nccl's compiled host path (built on first use by _fast.py): per call it allocates the
// outputs through torch's C++ API, fills the C ABI's argument structs and calls it, in one Python
// call, with the waits of DeepEP's stream protocol (_fast_streams.h). The ctypes path does the same
// in about 1.3-2x the host time (bench/bench_ll_host.py, bench/bench_normal.py's host rows). The
// ops: _fast_ll.h (low-latency), _fast_normal.h (layout, normal dispatch and combine),
// _fast_internode.h (internode dispatch and combine).
#include "_fast_internode.h"
#include "_fast_ll.h"
#include "_fast_normal.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace deepep_fast;
  m.doc() = "deepep-nccl's compiled host path (see _fast.py)";
  m.attr("DISPATCH_ARGS_BYTES") = py::int_(sizeof(DeepepLowLatencyDispatchArgs));
  m.attr("COMBINE_ARGS_BYTES") = py::int_(sizeof(DeepepLowLatencyCombineArgs));
  m.attr("BAD_INPUT") = py::int_(kBadInput);
  m.attr("DRIVER_ERROR") = py::int_(kDriverError);
  m.attr("ORDER_BEFORE") = py::int_(kOrderBefore);
  m.attr("ORDER_AFTER") = py::int_(kOrderAfter);
  py::class_<StreamOrder>(m, "StreamOrder").def(py::init<int>()).def("usable", &StreamOrder::usable);
  m.attr("NEW_SHAPE") = py::int_(kNewShape);
  m.attr("MAX_DISPATCH_SHAPES") = py::int_(kMaxDispatchShapes);
  py::class_<LlOps>(m, "LlOps")
      .def(py::init<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, int, py::object>())
      .def("add_dispatch_shape", &LlOps::add_dispatch_shape)
      .def("dispatch", &LlOps::dispatch)
      .def("combine", &LlOps::combine)
      .def("clean", &LlOps::clean)
      .def("next_combine_buffer", &LlOps::next_combine_buffer);
  m.def("set_status_raiser", &set_status_raiser);
  LlDispatchHook::add_to(m, PYBIND11_TOSTRING(TORCH_EXTENSION_NAME) ".LlDispatchHook");
  LlCombineHook::add_to(m, PYBIND11_TOSTRING(TORCH_EXTENSION_NAME) ".LlCombineHook");
  py::class_<NormalOps>(m, "NormalOps")
      .def(py::init<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                    int64_t, int>())
      .def("layout", &NormalOps::layout)
      .def("dispatch", &NormalOps::dispatch)
      .def("combine", &NormalOps::combine);
  py::class_<InternodeOps>(m, "InternodeOps")
      .def(py::init<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t, int>())
      .def("dispatch", &InternodeOps::dispatch)
      .def("combine", &InternodeOps::combine);
}

"""DeepEP's Config, its buffer-size hints and the tuned default tables, all from the C ABI."""
from ctypes import addressof, byref, c_int64

from ._lib import CONFIG_COMBINE, CONFIG_DISPATCH, INT64, DeepepConfig, check, int_arg, lib

_CONFIG_KINDS = {"dispatch": CONFIG_DISPATCH, "combine": CONFIG_COMBINE}


class Config:
    """`deep_ep_cpp.Config`: chunking of the normal kernels. Invalid values raise RuntimeError.

    The fields are readable here (DeepEP binds no getters); rdma recv is rounded up to a
    multiple of rdma send, as in DeepEP.
    """

    # _address: _c's, which the compiled path's direct entries read (one attribute, no ctypes call).
    __slots__ = ("_c", "_address")

    def __init__(
        self,
        num_sms=20,
        num_max_nvl_chunked_send_tokens=6,
        num_max_nvl_chunked_recv_tokens=256,
        num_max_rdma_chunked_send_tokens=6,
        num_max_rdma_chunked_recv_tokens=256,
    ):
        self._c = DeepepConfig()
        self._address = addressof(self._c)
        check(
            lib.deepep_config_init(
                byref(self._c),
                int_arg("num_sms", num_sms),
                int_arg("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens),
                int_arg("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens),
                int_arg("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens),
                int_arg("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens),
            )
        )

    @classmethod
    def _from_c(cls, c):
        config = cls.__new__(cls)
        config._c = c
        config._address = addressof(c)
        return config

    num_sms = property(lambda self: self._c.num_sms)
    num_max_nvl_chunked_send_tokens = property(lambda self: self._c.num_max_nvl_chunked_send_tokens)
    num_max_nvl_chunked_recv_tokens = property(lambda self: self._c.num_max_nvl_chunked_recv_tokens)
    num_max_rdma_chunked_send_tokens = property(lambda self: self._c.num_max_rdma_chunked_send_tokens)
    num_max_rdma_chunked_recv_tokens = property(lambda self: self._c.num_max_rdma_chunked_recv_tokens)

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        out = c_int64()
        check(lib.deepep_config_nvl_buffer_size_hint(byref(self._c), int_arg("hidden_bytes", hidden_bytes, INT64),
                                                      int_arg("num_ranks", num_ranks), byref(out)))
        return out.value

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        out = c_int64()
        check(lib.deepep_config_rdma_buffer_size_hint(byref(self._c), int_arg("hidden_bytes", hidden_bytes, INT64),
                                                       int_arg("num_ranks", num_ranks), byref(out)))
        return out.value

    def __repr__(self):
        c = self._c
        return (
            f"Config(num_sms={c.num_sms}, "
            f"num_max_nvl_chunked_send_tokens={c.num_max_nvl_chunked_send_tokens}, "
            f"num_max_nvl_chunked_recv_tokens={c.num_max_nvl_chunked_recv_tokens}, "
            f"num_max_rdma_chunked_send_tokens={c.num_max_rdma_chunked_send_tokens}, "
            f"num_max_rdma_chunked_recv_tokens={c.num_max_rdma_chunked_recv_tokens})"
        )


def get_default_config(kind, num_ranks, num_sms):
    """DeepEP's tuned `Buffer.get_dispatch_config` / `get_combine_config` table entry.

    kind is 'dispatch' or 'combine'; an unsupported num_ranks raises RuntimeError.
    """
    if kind not in _CONFIG_KINDS:
        raise ValueError(f"kind must be 'dispatch' or 'combine', got {kind!r}")
    c = DeepepConfig()
    check(lib.deepep_config_default(byref(c), _CONFIG_KINDS[kind], int_arg("num_ranks", num_ranks),
                                    int_arg("num_sms", num_sms)))
    return Config._from_c(c)


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
    out = c_int64()
    check(
        lib.deepep_low_latency_rdma_size_hint(
            int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, INT64),
            int_arg("hidden", hidden, INT64), int_arg("num_ranks", num_ranks), int_arg("num_experts", num_experts),
            byref(out)
        )
    )
    return out.value

//! C ABI: DeepEP's Config, tuned tables and buffer-size hints (no GPU needed).
use std::os::raw::c_int;

use super::{ffi, out_ref};
use crate::config::{self, ConfigKind, DeepepConfig};
use crate::error::{DeepepStatus, Error};

/// Which tuned table `deepep_config_default` reads.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeepepConfigKind {
    DEEPEP_CONFIG_DISPATCH = 0,
    DEEPEP_CONFIG_COMBINE = 1,
}

impl DeepepConfigKind {
    /// Every kind (named as in C, so `{:?}` prints the C name).
    pub(crate) const ALL: [Self; 2] = [Self::DEEPEP_CONFIG_DISPATCH, Self::DEEPEP_CONFIG_COMBINE];
}

/// `Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)` with DeepEP's checks;
/// rdma_recv is rounded up to a multiple of rdma_send.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_config_init(
    out: *mut DeepepConfig,
    num_sms: c_int,
    num_max_nvl_chunked_send_tokens: c_int,
    num_max_nvl_chunked_recv_tokens: c_int,
    num_max_rdma_chunked_send_tokens: c_int,
    num_max_rdma_chunked_recv_tokens: c_int,
) -> DeepepStatus {
    ffi(|| {
        *out_ref("out", out)? = DeepepConfig::new(
            num_sms,
            num_max_nvl_chunked_send_tokens,
            num_max_nvl_chunked_recv_tokens,
            num_max_rdma_chunked_send_tokens,
            num_max_rdma_chunked_recv_tokens,
        )?;
        Ok(())
    })
}

/// `Buffer.get_dispatch_config(num_ranks)` / `get_combine_config(num_ranks)` for `num_sms`.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_config_default(out: *mut DeepepConfig, kind: c_int, num_ranks: c_int, num_sms: c_int) -> DeepepStatus {
    ffi(|| {
        let kind = match kind {
            k if k == DeepepConfigKind::DEEPEP_CONFIG_DISPATCH as c_int => ConfigKind::Dispatch,
            k if k == DeepepConfigKind::DEEPEP_CONFIG_COMBINE as c_int => ConfigKind::Combine,
            other => return Err(Error::invalid(format!("kind must be DEEPEP_CONFIG_DISPATCH (0) or DEEPEP_CONFIG_COMBINE (1), got {other}"))),
        };
        *out_ref("out", out)? = config::default_config(kind, num_ranks, num_sms)?;
        Ok(())
    })
}

fn config_ref<'a>(cfg: *const DeepepConfig) -> Result<&'a DeepepConfig, Error> {
    // SAFETY: callers pass a valid config or NULL; NULL is rejected.
    unsafe { cfg.as_ref() }.ok_or_else(|| Error::invalid("config must not be NULL"))
}

/// `Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)`.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_config_nvl_buffer_size_hint(cfg: *const DeepepConfig, hidden_bytes: i64, num_ranks: c_int, out: *mut i64) -> DeepepStatus {
    ffi(|| {
        *out_ref("out", out)? = config_ref(cfg)?.nvl_buffer_size_hint(hidden_bytes, num_ranks)?;
        Ok(())
    })
}

/// `Config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks)`.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_config_rdma_buffer_size_hint(cfg: *const DeepepConfig, hidden_bytes: i64, num_ranks: c_int, out: *mut i64) -> DeepepStatus {
    ffi(|| {
        *out_ref("out", out)? = config_ref(cfg)?.rdma_buffer_size_hint(hidden_bytes, num_ranks)?;
        Ok(())
    })
}

/// `get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)`.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_low_latency_rdma_size_hint(
    num_max_dispatch_tokens_per_rank: i64,
    hidden: i64,
    num_ranks: c_int,
    num_experts: c_int,
    out: *mut i64,
) -> DeepepStatus {
    ffi(|| {
        *out_ref("out", out)? = config::low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)?;
        Ok(())
    })
}

/// DeepEP's Buffer constructor checks, without creating anything.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_check_buffer_args(rank: c_int, num_ranks: c_int, num_nvl_bytes: i64, num_rdma_bytes: i64, low_latency_mode: bool) -> DeepepStatus {
    ffi(|| config::check_buffer_args(rank, num_ranks, num_nvl_bytes, num_rdma_bytes, low_latency_mode))
}

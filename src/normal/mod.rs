//! Normal (high-throughput) mode within one NVLink domain: the checks both ops
//! share (ranks, config, NVL budget), and the ops themselves
//! in [`dispatch`] and [`combine`].
pub mod combine;
pub mod dispatch;

use std::os::raw::c_void;

use crate::buffer::Buffer;
use crate::config::DeepepConfig;
use crate::cuda;
use crate::ensure_arg;
use crate::error::Result;
use crate::kernels;
use crate::tensor::{check, check_shape, DeepepDtype::*, DeepepTensor};

/// Channels and ring size one op runs with, from its `Config`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelPlan {
    pub num_channels: i32,
    pub ring_tokens: i32,
}

/// DeepEP's rules for a normal-mode `Config` plus this device's limits.
pub fn channel_plan(config: &DeepepConfig, num_device_sms: i32) -> Result<ChannelPlan> {
    let sms = config.num_sms;
    ensure_arg!(sms > 0 && sms % 2 == 0, "config.num_sms must be a positive even number (one channel is 2 SMs), got {sms}");
    ensure_arg!(sms <= num_device_sms, "config.num_sms ({sms}) exceeds the {num_device_sms} SMs of this GPU");
    ensure_arg!(
        sms / 2 <= kernels::MAX_CHANNELS,
        "config.num_sms ({sms}) gives more than {} channels",
        kernels::MAX_CHANNELS
    );
    let ring = config.num_max_nvl_chunked_recv_tokens;
    ensure_arg!(ring > 0, "config.num_max_nvl_chunked_recv_tokens must be positive, got {ring}");
    Ok(ChannelPlan { num_channels: sms / 2, ring_tokens: ring })
}

/// Normal mode runs within one LSA team of at most 8 ranks, as DeepEP's intranode kernels.
pub fn check_ranks(num_ranks: i32) -> Result<()> {
    ensure_arg!(
        num_ranks <= kernels::MAX_NVL_RANKS,
        "intranode dispatch/combine supports up to {} ranks, the buffer has {num_ranks}",
        kernels::MAX_NVL_RANKS
    );
    Ok(())
}

/// Every (channel, peer) ring plus its consumed words must fit the NVL region.
pub fn check_nvl_budget(num_nvl_bytes: i64, op: &str, plan: ChannelPlan, num_ranks: i32, slot_bytes: i64) -> Result<()> {
    // The ring size comes from the caller's config, the slot from its hidden size and top-k.
    let needed = (plan.num_channels as i64)
        .checked_mul(num_ranks as i64)
        .and_then(|n| n.checked_mul(plan.ring_tokens as i64))
        .and_then(|n| n.checked_mul(slot_bytes.checked_add(8)?));
    let Some(needed) = needed else {
        return Err(crate::error::Error::invalid(format!(
            "this {op} needs more bytes than a 64-bit size holds: {} channels x {num_ranks} ranks x {} tokens \
             (config.num_max_nvl_chunked_recv_tokens) x {slot_bytes} B per token",
            plan.num_channels, plan.ring_tokens
        )));
    };
    ensure_arg!(
        needed <= num_nvl_bytes,
        "num_nvl_bytes ({num_nvl_bytes}) is too small for this {op}: {} channels x {num_ranks} ranks x {} tokens \
         (config.num_max_nvl_chunked_recv_tokens) x {} B per token need {needed} B; size the buffer with \
         Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)",
        plan.num_channels,
        plan.ring_tokens,
        slot_bytes + 8
    );
    Ok(())
}

/// Shrink mode: copies the normal kernels' cumulative dropped-row counters into an int64
/// [DROPPED_KINDS] device tensor, in `stream` order (docs/normal_shrink.md: dispatch rows left
/// empty, dispatch tokens not sent, combine contributions left out, combine rows not sent).
pub fn query_dropped(buffer: &Buffer, dropped: &DeepepTensor, stream: *mut c_void) -> Result<()> {
    ensure_arg!(buffer.args.enable_shrink, "dropped-row counters exist only with enable_shrink=True");
    let out = check("dropped", Some(dropped), &[DEEPEP_DTYPE_INT64], 1)?;
    check_shape("dropped", &out, &[kernels::DROPPED_KINDS as i64])?;
    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        cuda::copy_device_async(out.ptr(), res.normal_dropped().cast(), 8 * kernels::DROPPED_KINDS, stream)
    })
}

/// Shared by both ops: validated config, ranks and budget for `slot_bytes`.
fn plan_for(buffer: &Buffer, config: &DeepepConfig, op: &str, slot_bytes: i64) -> Result<ChannelPlan> {
    check_ranks(buffer.layout.num_ranks)?;
    ensure_arg!(
        buffer.lsa_size == buffer.layout.num_ranks,
        "intranode {op} needs all {} ranks in one NVLink domain; this buffer spans nodes ({} reachable by NVLink)",
        buffer.layout.num_ranks,
        buffer.lsa_size
    );
    let plan = channel_plan(config, buffer.num_device_sms())?;
    ensure_arg!(
        slot_bytes <= i32::MAX as i64,
        "x: a {op} ring slot of {slot_bytes} bytes per token (its hidden size, scales and top-k) is more than the \
         kernels' 32-bit slot size holds"
    );
    check_nvl_budget(buffer.args.num_nvl_bytes, op, plan, buffer.layout.num_ranks, slot_bytes)?;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(num_sms: i32, recv: i32) -> DeepepConfig {
        DeepepConfig::new(num_sms, 6, recv, 6, 128).unwrap()
    }

    #[test]
    fn channel_plan_follows_config_and_device() {
        assert_eq!(channel_plan(&config(24, 256), 132).unwrap(), ChannelPlan { num_channels: 12, ring_tokens: 256 });
        let odd = channel_plan(&config(23, 256), 132).unwrap_err();
        assert!(odd.message.contains("config.num_sms must be a positive even number"), "{}", odd.message);
        let big = channel_plan(&config(200, 256), 132).unwrap_err();
        assert!(big.message.contains("exceeds the 132 SMs"), "{}", big.message);
    }

    #[test]
    fn hint_sized_buffer_fits_and_small_buffer_names_num_nvl_bytes() {
        // DeepEP's hint for hidden 7168 BF16, 4 ranks, 24 SMs: the dispatch ring with
        // top-8 and 56 scales must fit.
        let cfg = config(24, 256);
        let hint = cfg.nvl_buffer_size_hint(7168 * 2, 4).unwrap();
        let plan = channel_plan(&cfg, 132).unwrap();
        let slot = kernels::dispatch_slot_bytes(7168 * 2, 128, 128);
        check_nvl_budget(hint, "dispatch", plan, 4, slot).unwrap();
        let err = check_nvl_budget(1 << 20, "dispatch", plan, 4, slot).unwrap_err();
        assert!(err.message.starts_with("num_nvl_bytes (1048576) is too small for this dispatch"), "{}", err.message);
    }

    #[test]
    fn a_ring_past_64_bits_is_an_error_naming_the_config() {
        let plan = ChannelPlan { num_channels: 64, ring_tokens: i32::MAX };
        let err = check_nvl_budget(i64::MAX, "dispatch", plan, 8, i32::MAX as i64 * 4).unwrap_err();
        assert!(err.message.starts_with("this dispatch needs more bytes than a 64-bit size holds"), "{}", err.message);
        assert!(err.message.contains("config.num_max_nvl_chunked_recv_tokens"), "{}", err.message);
        assert!(check_nvl_budget(i64::MAX, "combine", plan, 8, i64::MAX).is_err(), "slot_bytes + 8 overflows");
    }

    #[test]
    fn flag_generations_are_above_every_int32_payload_and_distinct() {
        // Slots carry int32 ids, indices and counts below 2^30 (and -1): a flag's high word must
        // be none of them (review F2), and ops less than 2^30 apart must not share one.
        let epochs = (0..1u32 << 22).chain(u32::MAX - (1 << 12)..=u32::MAX);
        let mut generations: Vec<u32> = epochs.map(kernels::normal_flag_generation).collect();
        for &g in &generations {
            assert!((1 << 30..1 << 31).contains(&g), "generation {g:#x} is in int32 payload's range or negative");
        }
        let n = generations.len();
        generations.sort_unstable();
        generations.dedup();
        assert_eq!(generations.len(), n, "two epochs share a generation");
    }

    #[test]
    fn dropped_counters_need_shrink_and_an_int64_vector_of_four() {
        use crate::buffer::BufferArgs;
        use crate::error::DeepepStatus;
        let buffer = |enable_shrink| {
            let args = BufferArgs {
                rank: 0,
                num_ranks: 2,
                num_nvl_bytes: 1 << 30,
                num_rdma_bytes: 0,
                low_latency_mode: false,
                explicitly_destroy: false,
                enable_shrink,
            };
            Buffer::without_resources(args, 132)
        };
        let mut storage = [0i64; 4];
        let data = storage.as_mut_ptr().cast();
        let vector = |dtype, n| crate::tensor::vector_at(data, dtype, n);
        let null = std::ptr::null_mut();
        let plain = query_dropped(&buffer(false), &vector(DEEPEP_DTYPE_INT64, 4), null).unwrap_err();
        assert!(plain.message.contains("enable_shrink=True"), "{}", plain.message);
        let shrink = buffer(true);
        let dtype = query_dropped(&shrink, &vector(DEEPEP_DTYPE_INT32, 4), null).unwrap_err();
        assert!(dtype.message.contains("dropped"), "{}", dtype.message);
        let shape = query_dropped(&shrink, &vector(DEEPEP_DTYPE_INT64, 3), null).unwrap_err();
        assert!(shape.message.contains("dropped"), "{}", shape.message);
        // Valid arguments reach the resources, which this buffer has none of.
        let valid = query_dropped(&shrink, &vector(DEEPEP_DTYPE_INT64, 4), null).unwrap_err();
        assert_eq!(valid.status, DeepepStatus::DEEPEP_ERROR_NOT_AVAILABLE, "{}", valid.message);
    }

    #[test]
    fn more_than_eight_ranks_is_rejected() {
        assert!(check_ranks(8).is_ok());
        assert!(check_ranks(16).unwrap_err().message.contains("up to 8 ranks"));
    }
}

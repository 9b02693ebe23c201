//! DeepEP's `Config`, its buffer-size hints, the default tuned tables, and the
//! constructor checks of `deep_ep::Buffer`. Formulas follow DeepEP V1 exactly:
//! existing users size their buffers with them.
use crate::ensure_arg;
use crate::error::Result;

/// GPUs per NVLink domain in DeepEP's topology (`NUM_MAX_NVL_PEERS`).
pub(crate) const NUM_MAX_NVL_PEERS: i32 = crate::capi::DEEPEP_NUM_MAX_NVL_PEERS;
/// Nodes for the normal internode kernels (`NUM_MAX_RDMA_PEERS`).
pub(crate) const NUM_MAX_RDMA_PEERS: i32 = 20;
/// `num_nvl_bytes` / `num_rdma_bytes` must be multiples of this.
pub(crate) const NUM_BUFFER_ALIGNMENT_BYTES: i64 = 128;
const NUM_MAX_TOPK: i64 = 128;
const NUM_MAX_SCALES: i64 = 128;
/// sizeof(topk_idx_t): DeepEP's default build uses int64.
const TOPK_IDX_BYTES: i64 = 8;
/// Per-token source metadata in the NVL buffer (present in NVSHMEM-enabled builds).
const SOURCE_META_BYTES: i64 = 8;

/// Mirrors `deep_ep::Config`. Construct with [`DeepepConfig::new`] so the
/// checks and the RDMA rounding are applied.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeepepConfig {
    pub num_sms: i32,
    pub num_max_nvl_chunked_send_tokens: i32,
    pub num_max_nvl_chunked_recv_tokens: i32,
    pub num_max_rdma_chunked_send_tokens: i32,
    pub num_max_rdma_chunked_recv_tokens: i32,
}

fn align_up(x: i64, a: i64) -> i64 {
    (x + a - 1) / a * a
}

impl DeepepConfig {
    pub fn new(num_sms: i32, nvl_send: i32, nvl_recv: i32, rdma_send: i32, rdma_recv: i32) -> Result<Self> {
        ensure_arg!(num_sms >= 0, "Config: num_sms must be >= 0, got {num_sms}");
        ensure_arg!(
            nvl_send > 0 && nvl_recv > 0,
            "Config: NVL chunk sizes must be positive, got send={nvl_send} recv={nvl_recv}"
        );
        ensure_arg!(
            nvl_send < nvl_recv,
            "Config: num_max_nvl_chunked_send_tokens ({nvl_send}) must be < num_max_nvl_chunked_recv_tokens ({nvl_recv})"
        );
        ensure_arg!(
            rdma_send > 0 && rdma_recv > 0,
            "Config: RDMA chunk sizes must be positive, got send={rdma_send} recv={rdma_recv}"
        );
        // DeepEP rounds the stored recv size up, but checks the caller's value.
        ensure_arg!(
            rdma_send < rdma_recv,
            "Config: num_max_rdma_chunked_send_tokens ({rdma_send}) must be < num_max_rdma_chunked_recv_tokens ({rdma_recv})"
        );
        ensure_arg!(
            rdma_send <= rdma_recv / 2,
            "Config: num_max_rdma_chunked_send_tokens ({rdma_send}) must be <= num_max_rdma_chunked_recv_tokens / 2 ({})",
            rdma_recv / 2
        );
        Ok(Self {
            num_sms,
            num_max_nvl_chunked_send_tokens: nvl_send,
            num_max_nvl_chunked_recv_tokens: nvl_recv,
            num_max_rdma_chunked_send_tokens: rdma_send,
            num_max_rdma_chunked_recv_tokens: align_up(rdma_recv as i64, rdma_send as i64) as i32,
        })
    }

    fn check_rank_topology(&self, num_ranks: i32) -> Result<()> {
        ensure_arg!(num_ranks > 0, "num_ranks must be positive, got {num_ranks}");
        ensure_arg!(
            num_ranks < NUM_MAX_NVL_PEERS || num_ranks % NUM_MAX_NVL_PEERS == 0,
            "num_ranks must be < {NUM_MAX_NVL_PEERS} or a multiple of {NUM_MAX_NVL_PEERS}, got {num_ranks}"
        );
        Ok(())
    }

    /// `Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)`.
    pub fn nvl_buffer_size_hint(&self, hidden_bytes: i64, num_ranks: i32) -> Result<i64> {
        ensure_arg!(hidden_bytes > 0, "hidden_bytes must be positive, got {hidden_bytes}");
        self.check_rank_topology(num_ranks)?;
        ensure_arg!(
            num_ranks <= NUM_MAX_NVL_PEERS || self.num_sms % 2 == 0,
            "num_sms must be even when num_ranks > {NUM_MAX_NVL_PEERS}, got {}",
            self.num_sms
        );
        let rdma_ranks = (num_ranks / NUM_MAX_NVL_PEERS).max(1) as i64;
        let nvl_ranks = num_ranks.min(NUM_MAX_NVL_PEERS) as i64;
        let channels = (self.num_sms / 2) as i64;
        let tokens = self.num_max_nvl_chunked_recv_tokens as i64;
        let slots = channels * nvl_ranks * tokens;
        let bytes = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
            + slots * hidden_bytes
            + slots * SOURCE_META_BYTES
            + slots * NUM_MAX_TOPK * TOPK_IDX_BYTES
            + slots * NUM_MAX_TOPK * 4
            + slots * NUM_MAX_SCALES * 4;
        Ok(align_up(bytes, NUM_BUFFER_ALIGNMENT_BYTES))
    }

    /// `Config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks)`; 0 within one node.
    pub fn rdma_buffer_size_hint(&self, hidden_bytes: i64, num_ranks: i32) -> Result<i64> {
        ensure_arg!(hidden_bytes > 0, "hidden_bytes must be positive, got {hidden_bytes}");
        self.check_rank_topology(num_ranks)?;
        if num_ranks <= NUM_MAX_NVL_PEERS {
            return Ok(0);
        }
        let rdma_ranks = (num_ranks / NUM_MAX_NVL_PEERS) as i64;
        let channels = (self.num_sms / 2) as i64;
        let tokens = self.num_max_rdma_chunked_recv_tokens as i64;
        let per_token = hidden_bytes + SOURCE_META_BYTES + NUM_MAX_TOPK * TOPK_IDX_BYTES + NUM_MAX_TOPK * 4
            + NUM_MAX_SCALES * 4
            + 16;
        let bytes = channels * rdma_ranks * (NUM_MAX_NVL_PEERS as i64 * 2 + 2) * 2 * 4
            + 2 * channels * rdma_ranks * tokens * per_token;
        Ok(align_up(bytes, NUM_BUFFER_ALIGNMENT_BYTES))
    }
}

/// Which of DeepEP's tuned tables to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigKind {
    Dispatch,
    Combine,
}

/// `Buffer.get_dispatch_config(num_ranks)` / `Buffer.get_combine_config(num_ranks)`.
pub fn default_config(kind: ConfigKind, num_ranks: i32, num_sms: i32) -> Result<DeepepConfig> {
    // (num_ranks, dispatch (nvl_send, nvl_recv, rdma_send, rdma_recv), combine (...))
    const TABLE: [(i32, [i32; 4], [i32; 4]); 12] = [
        (2, [24, 256, 6, 128], [10, 256, 6, 128]),
        (4, [6, 256, 6, 128], [9, 256, 6, 128]),
        (8, [6, 256, 6, 128], [4, 256, 6, 128]),
        (16, [36, 288, 20, 128], [4, 288, 12, 128]),
        (24, [32, 288, 8, 128], [1, 288, 8, 128]),
        (32, [32, 288, 8, 128], [1, 288, 8, 128]),
        (48, [32, 288, 8, 128], [1, 288, 8, 128]),
        (64, [32, 288, 8, 128], [1, 288, 8, 128]),
        (96, [20, 480, 12, 128], [1, 480, 8, 128]),
        (128, [20, 560, 12, 128], [1, 560, 8, 128]),
        (144, [32, 720, 12, 128], [2, 720, 8, 128]),
        (160, [28, 720, 12, 128], [2, 720, 8, 128]),
    ];
    let Some((_, dispatch, combine)) = TABLE.iter().find(|(r, _, _)| *r == num_ranks) else {
        return Err(crate::error::Error::invalid(format!(
            "Unsupported number of EP ranks: {num_ranks} (tuned configs exist for {:?})",
            TABLE.iter().map(|t| t.0).collect::<Vec<_>>()
        )));
    };
    let v = if kind == ConfigKind::Dispatch { dispatch } else { combine };
    DeepepConfig::new(num_sms, v[0], v[1], v[2], v[3])
}

/// `Buffer.get_low_latency_rdma_size_hint(M, hidden, num_ranks, num_experts)`.
/// DeepEP's formula does not use `num_ranks`; it is still validated.
pub fn low_latency_rdma_size_hint(
    num_max_dispatch_tokens_per_rank: i64,
    hidden: i64,
    num_ranks: i32,
    num_experts: i32,
) -> Result<i64> {
    ensure_arg!(
        num_max_dispatch_tokens_per_rank > 0,
        "num_max_dispatch_tokens_per_rank must be positive, got {num_max_dispatch_tokens_per_rank}"
    );
    ensure_arg!(hidden > 0, "hidden must be positive, got {hidden}");
    ensure_arg!(num_ranks > 0, "num_ranks must be positive, got {num_ranks}");
    ensure_arg!(num_experts > 0, "num_experts must be positive, got {num_experts}");
    let m = num_max_dispatch_tokens_per_rank;
    let e = num_experts as i64;
    let scales = hidden / 128;
    let dispatch_msg = 16 + (hidden * 2).max(hidden + scales * 4);
    let combine_msg = scales * 4 + hidden * 2;
    let send = (m * dispatch_msg).max(e * m * combine_msg);
    let recv = (e * m * dispatch_msg).max(e * m * combine_msg);
    let signal = align_up(e * 4, 128);
    let total = 2 * signal + 2 * send + 2 * recv;
    Ok((total + NUM_BUFFER_ALIGNMENT_BYTES) / NUM_BUFFER_ALIGNMENT_BYTES * NUM_BUFFER_ALIGNMENT_BYTES)
}

/// Constructor checks of `deep_ep::Buffer` (csrc/deep_ep.cpp), with messages
/// that name the argument and the limit.
pub fn check_buffer_args(rank: i32, num_ranks: i32, num_nvl_bytes: i64, num_rdma_bytes: i64, low_latency_mode: bool) -> Result<()> {
    ensure_arg!(num_nvl_bytes >= 0, "num_nvl_bytes must be >= 0, got {num_nvl_bytes}");
    ensure_arg!(num_rdma_bytes >= 0, "num_rdma_bytes must be >= 0, got {num_rdma_bytes}");
    ensure_arg!(
        num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0,
        "num_nvl_bytes ({num_nvl_bytes}) must be a multiple of {NUM_BUFFER_ALIGNMENT_BYTES}"
    );
    ensure_arg!(
        num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0,
        "num_rdma_bytes ({num_rdma_bytes}) must be a multiple of {NUM_BUFFER_ALIGNMENT_BYTES}"
    );
    let int_max = i32::MAX as i64;
    ensure_arg!(
        num_nvl_bytes <= int_max || num_rdma_bytes == 0,
        "num_nvl_bytes ({num_nvl_bytes}) must be <= INT_MAX ({int_max}) when num_rdma_bytes > 0"
    );
    ensure_arg!(
        num_rdma_bytes <= int_max || low_latency_mode,
        "num_rdma_bytes ({num_rdma_bytes}) must be <= INT_MAX ({int_max}) outside low-latency mode"
    );
    ensure_arg!(
        num_nvl_bytes / 16 < int_max && num_rdma_bytes / 16 < int_max,
        "buffer sizes divided by 16 must be < INT_MAX (num_nvl_bytes={num_nvl_bytes}, num_rdma_bytes={num_rdma_bytes})"
    );
    ensure_arg!(num_ranks > 0, "num_ranks must be positive, got {num_ranks}");
    ensure_arg!(0 <= rank && rank < num_ranks, "rank must be in [0, num_ranks={num_ranks}), got {rank}");
    let max_ranks = NUM_MAX_NVL_PEERS * NUM_MAX_RDMA_PEERS;
    ensure_arg!(
        num_ranks <= max_ranks || low_latency_mode,
        "num_ranks ({num_ranks}) must be <= {max_ranks} outside low-latency mode"
    );
    ensure_arg!(
        num_ranks < NUM_MAX_NVL_PEERS || num_ranks % NUM_MAX_NVL_PEERS == 0,
        "num_ranks ({num_ranks}) must be < {NUM_MAX_NVL_PEERS} or a multiple of {NUM_MAX_NVL_PEERS}"
    );
    ensure_arg!(
        num_rdma_bytes == 0 || num_ranks > NUM_MAX_NVL_PEERS || low_latency_mode,
        "num_rdma_bytes ({num_rdma_bytes}) > 0 requires num_ranks > {NUM_MAX_NVL_PEERS} or low_latency_mode"
    );
    Ok(())
}

/// Rank bookkeeping DeepEP derives from (rank, num_ranks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankLayout {
    pub rank: i32,
    pub num_ranks: i32,
}

impl RankLayout {
    pub fn rdma_rank(&self) -> i32 {
        self.rank / NUM_MAX_NVL_PEERS
    }
    pub fn nvl_rank(&self) -> i32 {
        self.rank % NUM_MAX_NVL_PEERS
    }
    pub fn num_rdma_ranks(&self) -> i32 {
        (self.num_ranks / NUM_MAX_NVL_PEERS).max(1)
    }
    pub fn num_nvl_ranks(&self) -> i32 {
        self.num_ranks.min(NUM_MAX_NVL_PEERS)
    }
    /// `get_root_rdma_rank(global)`: `global ? nvl_rank : 0`.
    pub fn root_rdma_rank(&self, global: bool) -> i32 {
        if global {
            self.nvl_rank()
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max_hint(num_ranks: i32, hidden_bytes: i64) -> (i64, i64) {
        let mut nvl = 0;
        let mut rdma = 0;
        for kind in [ConfigKind::Dispatch, ConfigKind::Combine] {
            let c = default_config(kind, num_ranks, 20).unwrap();
            nvl = nvl.max(c.nvl_buffer_size_hint(hidden_bytes, num_ranks).unwrap());
            rdma = rdma.max(c.rdma_buffer_size_hint(hidden_bytes, num_ranks).unwrap());
        }
        (nvl, rdma)
    }

    #[test]
    fn size_hints_match_deepep_worked_values() {
        // hidden 7168 BF16, num_sms 20 (deepep-buffer-api.md §2 worked examples).
        let expected = [
            (2, 83_927_552, 0),
            (4, 167_854_976, 0),
            (8, 335_709_824, 0),
            (16, 377_673_984, 91_887_744),
            (32, 377_675_264, 168_023_680),
            (64, 377_677_824, 336_047_360),
            (128, 734_372_864, 693_096_960),
            (160, 944_193_024, 866_371_200),
        ];
        for (ranks, nvl, rdma) in expected {
            assert_eq!(max_hint(ranks, 14336), (nvl, rdma), "EP{ranks}");
        }
    }

    #[test]
    fn low_latency_hint_matches_worked_values() {
        assert_eq!(low_latency_rdma_size_hint(128, 7168, 8, 288).unwrap(), 2_146_961_792);
        assert_eq!(low_latency_rdma_size_hint(128, 7168, 8, 256).unwrap(), 1_908_410_496);
        assert_eq!(low_latency_rdma_size_hint(16, 5120, 8, 256).unwrap(), 170_395_776);
        assert_eq!(low_latency_rdma_size_hint(256, 7168, 8, 256).unwrap(), 3_816_818_816);
    }

    #[test]
    fn config_rounds_rdma_recv_and_validates() {
        let c = DeepepConfig::new(20, 6, 256, 20, 128).unwrap();
        assert_eq!(c.num_max_rdma_chunked_recv_tokens, 140);
        assert!(DeepepConfig::new(-2, 6, 256, 6, 128).unwrap_err().message.contains("num_sms"));
        assert!(DeepepConfig::new(20, 256, 256, 6, 128).unwrap_err().message.contains("nvl_chunked_send"));
        assert!(DeepepConfig::new(20, 6, 256, 0, 128).unwrap_err().message.contains("RDMA chunk"));
        // 6 <= 11/2 fails on the caller's value even though 11 rounds up to 12.
        assert!(DeepepConfig::new(20, 6, 256, 6, 11).is_err());
    }

    #[test]
    fn default_config_rejects_unknown_rank_counts() {
        let err = default_config(ConfigKind::Dispatch, 6, 20).unwrap_err();
        assert!(err.message.contains("Unsupported number of EP ranks: 6"), "{}", err.message);
        assert_eq!(default_config(ConfigKind::Combine, 8, 24).unwrap().num_max_nvl_chunked_send_tokens, 4);
    }

    #[test]
    fn hints_reject_bad_topology() {
        let c = default_config(ConfigKind::Dispatch, 16, 20).unwrap();
        assert!(c.nvl_buffer_size_hint(14336, 12).unwrap_err().message.contains("multiple of 8"));
        let odd = DeepepConfig::new(21, 6, 256, 6, 128).unwrap();
        assert!(odd.nvl_buffer_size_hint(14336, 16).unwrap_err().message.contains("even"));
    }

    #[test]
    fn buffer_args_follow_deepep_asserts() {
        assert!(check_buffer_args(0, 4, 1 << 30, 0, false).is_ok());
        let e = check_buffer_args(0, 4, 1000, 0, false).unwrap_err();
        assert!(e.message.contains("num_nvl_bytes (1000) must be a multiple of 128"), "{}", e.message);
        assert!(check_buffer_args(4, 4, 0, 0, false).unwrap_err().message.contains("rank must be in"));
        assert!(check_buffer_args(0, 12, 0, 0, false).unwrap_err().message.contains("multiple of 8"));
        assert!(check_buffer_args(0, 4, 0, 1 << 20, false).unwrap_err().message.contains("low_latency_mode"));
        assert!(check_buffer_args(0, 4, 0, 1 << 20, true).is_ok());
        assert!(check_buffer_args(0, 168, 0, 0, false).unwrap_err().message.contains("<= 160"));
        assert!(check_buffer_args(0, 4, 2_000_000_000, 0, false).is_ok());
    }

    #[test]
    fn rank_layout_derivations() {
        let l = RankLayout { rank: 13, num_ranks: 16 };
        assert_eq!((l.rdma_rank(), l.nvl_rank(), l.num_rdma_ranks(), l.num_nvl_ranks()), (1, 5, 2, 8));
        assert_eq!((l.root_rdma_rank(true), l.root_rdma_rank(false)), (5, 0));
        let small = RankLayout { rank: 3, num_ranks: 4 };
        assert_eq!((small.num_rdma_ranks(), small.num_nvl_ranks()), (1, 4));
    }
}

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
        let rdma_recv_rounded = align_up(rdma_recv as i64, rdma_send as i64);
        ensure_arg!(
            rdma_recv_rounded <= i32::MAX as i64,
            "Config: num_max_rdma_chunked_recv_tokens ({rdma_recv}) rounded up to a multiple of \
             num_max_rdma_chunked_send_tokens ({rdma_send}) is {rdma_recv_rounded}, more than an int32 holds"
        );
        Ok(Self {
            num_sms,
            num_max_nvl_chunked_send_tokens: nvl_send,
            num_max_nvl_chunked_recv_tokens: nvl_recv,
            num_max_rdma_chunked_send_tokens: rdma_send,
            num_max_rdma_chunked_recv_tokens: rdma_recv_rounded as i32,
        })
    }

    /// A config from a caller (a C struct) is one [`DeepepConfig::new`] accepts: the same checks,
    /// the stored RDMA receive size a multiple of the send size.
    pub fn check(&self) -> Result<()> {
        let again = Self::new(
            self.num_sms,
            self.num_max_nvl_chunked_send_tokens,
            self.num_max_nvl_chunked_recv_tokens,
            self.num_max_rdma_chunked_send_tokens,
            self.num_max_rdma_chunked_recv_tokens,
        )?;
        ensure_arg!(
            again == *self,
            "Config: num_max_rdma_chunked_recv_tokens ({}) must be a multiple of num_max_rdma_chunked_send_tokens \
             ({}); build configs with deepep_config_init",
            self.num_max_rdma_chunked_recv_tokens,
            self.num_max_rdma_chunked_send_tokens
        );
        Ok(())
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
        self.check()?;
        self.check_rank_topology(num_ranks)?;
        ensure_arg!(
            num_ranks <= NUM_MAX_NVL_PEERS || self.num_sms % 2 == 0,
            "num_sms must be even when num_ranks > {NUM_MAX_NVL_PEERS}, got {}",
            self.num_sms
        );
        let rdma_ranks = (num_ranks / NUM_MAX_NVL_PEERS).max(1) as i128;
        let nvl_ranks = num_ranks.min(NUM_MAX_NVL_PEERS) as i128;
        let channels = (self.num_sms / 2) as i128;
        let tokens = self.num_max_nvl_chunked_recv_tokens as i128;
        let per_slot = hidden_bytes as i128
            + (SOURCE_META_BYTES + NUM_MAX_TOPK * TOPK_IDX_BYTES + NUM_MAX_TOPK * 4 + NUM_MAX_SCALES * 4) as i128;
        let bytes = (|| {
            let slots = channels.checked_mul(nvl_ranks)?.checked_mul(tokens)?;
            (channels * nvl_ranks * (2 * rdma_ranks + 3) * 4).checked_add(slots.checked_mul(per_slot)?)
        })();
        fit_hint("Config.get_nvl_buffer_size_hint", bytes, hidden_bytes, num_ranks)
    }

    /// `Config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks)`; 0 within one node.
    pub fn rdma_buffer_size_hint(&self, hidden_bytes: i64, num_ranks: i32) -> Result<i64> {
        ensure_arg!(hidden_bytes > 0, "hidden_bytes must be positive, got {hidden_bytes}");
        self.check()?;
        self.check_rank_topology(num_ranks)?;
        if num_ranks <= NUM_MAX_NVL_PEERS {
            return Ok(0);
        }
        let rdma_ranks = (num_ranks / NUM_MAX_NVL_PEERS) as i128;
        let channels = (self.num_sms / 2) as i128;
        let tokens = self.num_max_rdma_chunked_recv_tokens as i128;
        let per_token = hidden_bytes as i128
            + (SOURCE_META_BYTES + NUM_MAX_TOPK * TOPK_IDX_BYTES + NUM_MAX_TOPK * 4 + NUM_MAX_SCALES * 4 + 16) as i128;
        let bytes = (|| {
            let data = (2 * channels * rdma_ranks).checked_mul(tokens)?.checked_mul(per_token)?;
            (channels * rdma_ranks * (NUM_MAX_NVL_PEERS as i128 * 2 + 2) * 2 * 4).checked_add(data)
        })();
        fit_hint("Config.get_rdma_buffer_size_hint", bytes, hidden_bytes, num_ranks)
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
    // In i128 with checked products: M x H x E of i64 inputs can pass even i128.
    let (m, h, e) = (num_max_dispatch_tokens_per_rank as i128, hidden as i128, num_experts as i128);
    let a = NUM_BUFFER_ALIGNMENT_BYTES as i128;
    let hint = (|| {
        let scales = h / 128;
        let dispatch_msg = 16 + (h * 2).max(h + scales * 4);
        let combine_msg = scales * 4 + h * 2;
        let em = e.checked_mul(m)?;
        let send = m.checked_mul(dispatch_msg)?.max(em.checked_mul(combine_msg)?);
        let recv = em.checked_mul(dispatch_msg)?.max(em.checked_mul(combine_msg)?);
        let signal = (e * 4 + 127) / 128 * 128;
        let total = (2 * signal).checked_add(send.checked_mul(2)?)?.checked_add(recv.checked_mul(2)?)?;
        // DeepEP adds a whole alignment unit even to an aligned total; kept for identical hints.
        i64::try_from((total + a) / a * a).ok()
    })();
    hint.ok_or_else(|| {
        crate::error::Error::invalid(format!(
            "get_low_latency_rdma_size_hint({num_max_dispatch_tokens_per_rank}, {hidden}, {num_ranks}, {num_experts}) \
             needs more bytes than a 64-bit size holds"
        ))
    })
}

/// A size hint in bytes (None: past i128), aligned as DeepEP aligns it, or an error naming the
/// hint and its arguments when it does not fit an i64.
fn fit_hint(what: &str, bytes: Option<i128>, hidden_bytes: i64, num_ranks: i32) -> Result<i64> {
    let a = NUM_BUFFER_ALIGNMENT_BYTES as i128;
    bytes.and_then(|b| i64::try_from((b + a - 1) / a * a).ok()).ok_or_else(|| {
        crate::error::Error::invalid(format!(
            "{what}(hidden_bytes={hidden_bytes}, num_ranks={num_ranks}) needs more bytes than a 64-bit size holds"
        ))
    })
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
    // DeepEP's nodes are 8 GPUs; virtual nodes (DEEPEP_VIRTUAL_NODE_SIZE below num_ranks) make
    // internode normal mode, which uses the RDMA region, possible with fewer ranks.
    ensure_arg!(
        num_rdma_bytes == 0 || num_ranks > NUM_MAX_NVL_PEERS || low_latency_mode || crate::env::virtual_nodes(num_ranks),
        "num_rdma_bytes ({num_rdma_bytes}) > 0 requires num_ranks > {NUM_MAX_NVL_PEERS} or low_latency_mode"
    );
    Ok(())
}

/// Rank bookkeeping DeepEP derives from (rank, num_ranks), with the buffer's node size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankLayout {
    pub rank: i32,
    pub num_ranks: i32,
    /// GPUs per (virtual) node of the buffer: the LSA team or DEEPEP_VIRTUAL_NODE_SIZE;
    /// num_ranks when the buffer lies within one node.
    pub node_size: i32,
}

impl RankLayout {
    /// A buffer within one node (and a buffer not yet created): DeepEP's answers.
    pub fn one_node(rank: i32, num_ranks: i32) -> Self {
        Self { rank, num_ranks, node_size: num_ranks }
    }
    /// Whether the buffer spans (virtual) nodes: internode normal mode.
    pub fn spans_nodes(&self) -> bool {
        self.node_size < self.num_ranks
    }
    /// GPUs per node as the rdma queries count them: the node size across nodes; within one
    /// node DeepEP's 8 (so a 16-rank single-node LL buffer answers as DeepEP does).
    pub fn gpus_per_node(&self) -> i32 {
        if self.spans_nodes() {
            self.node_size
        } else {
            NUM_MAX_NVL_PEERS
        }
    }
    pub fn rdma_rank(&self) -> i32 {
        self.rank / self.gpus_per_node()
    }
    pub fn nvl_rank(&self) -> i32 {
        self.rank % self.gpus_per_node()
    }
    pub fn num_rdma_ranks(&self) -> i32 {
        (self.num_ranks / self.gpus_per_node()).max(1)
    }
    pub fn num_nvl_ranks(&self) -> i32 {
        self.num_ranks.min(self.gpus_per_node())
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

    /// The fuzzer's findings (fuzz/corpus/*/regression_*): each was a wrapped value or an
    /// overflow panic; each is now an error naming what does not fit.
    #[test]
    fn sizes_that_do_not_fit_are_errors_not_wrapped_values() {
        let err = DeepepConfig::new(218955789, 1610, 3583, 3337, 2147483647).unwrap_err();
        assert!(err.message.contains("more than an int32 holds"), "{}", err.message);
        let hand_filled = DeepepConfig {
            num_sms: -4,
            num_max_nvl_chunked_send_tokens: 8,
            num_max_nvl_chunked_recv_tokens: 1289,
            num_max_rdma_chunked_send_tokens: 21755825,
            num_max_rdma_chunked_recv_tokens: 0,
        };
        assert!(hand_filled.nvl_buffer_size_hint(2, 8).unwrap_err().message.contains("num_sms must be >= 0"));
        let unrounded = DeepepConfig { num_max_rdma_chunked_recv_tokens: 129, ..default_config(ConfigKind::Dispatch, 8, 20).unwrap() };
        assert!(unrounded.rdma_buffer_size_hint(2, 16).unwrap_err().message.contains("must be a multiple"));
        let c = default_config(ConfigKind::Dispatch, 128, 3737).unwrap();
        let err = c.nvl_buffer_size_hint(7196434303387885278, 2).unwrap_err();
        assert!(err.message.contains("get_nvl_buffer_size_hint(hidden_bytes=7196434303387885278, num_ranks=2)"), "{}", err.message);
        assert!(c.rdma_buffer_size_hint(i64::MAX, 128).unwrap_err().message.contains("64-bit"));
        let err = low_latency_rdma_size_hint(1 << 31, 1 << 31, 160, 160).unwrap_err();
        assert!(err.message.contains("more bytes than a 64-bit size holds"), "{}", err.message);
        // The hints themselves are unchanged where they fit (DeepEP's values).
        assert_eq!(low_latency_rdma_size_hint(128, 7168, 2, 288).unwrap() % NUM_BUFFER_ALIGNMENT_BYTES, 0);
    }

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
        let l = RankLayout::one_node(13, 16);
        assert_eq!((l.rdma_rank(), l.nvl_rank(), l.num_rdma_ranks(), l.num_nvl_ranks()), (1, 5, 2, 8));
        assert_eq!((l.root_rdma_rank(true), l.root_rdma_rank(false)), (5, 0));
        let small = RankLayout::one_node(3, 4);
        assert_eq!((small.num_rdma_ranks(), small.num_nvl_ranks()), (1, 4));
        // Across nodes the node size replaces DeepEP's 8: 2 GPUs as 2 nodes of 1, 12 as 3 x 4.
        let virt = RankLayout { rank: 1, num_ranks: 2, node_size: 1 };
        assert!(virt.spans_nodes());
        assert_eq!((virt.rdma_rank(), virt.nvl_rank(), virt.num_rdma_ranks(), virt.num_nvl_ranks()), (1, 0, 2, 1));
        let twelve = RankLayout { rank: 9, num_ranks: 12, node_size: 4 };
        assert_eq!((twelve.rdma_rank(), twelve.root_rdma_rank(true), twelve.num_rdma_ranks()), (2, 1, 3));
        assert!(!RankLayout::one_node(13, 16).spans_nodes());
    }
}

//! The messages of what the kernels record in host-mapped memory: bad input they found (the
//! fault record) and a bounded wait that expired (the stall record).
use crate::error::{DeepepStatus, Error};
use crate::kernels::{self, FaultRecord, StallRecord};
use std::sync::atomic::{fence, Ordering};

/// The fault a kernel published at `record` (the host view of the host-mapped record), if any;
/// frees the record for the next one. Cleared before `released` is bumped: a kernel claims the
/// record only once `released` has caught up with its fault_lock (kernels/bounded_wait.cuh,
/// record_fault_at), so its writes never meet the clear.
///
/// # Safety
/// `record` points to a live, aligned record that only kernels' record_fault_at and this
/// function write.
pub(crate) unsafe fn take_fault(record: *mut FaultRecord) -> Option<FaultRecord> {
    // SAFETY: the caller's.
    unsafe {
        // The flag first: the kernel writes it last.
        if std::ptr::addr_of!((*record).flag).read_volatile() != 1 {
            return None;
        }
        fence(Ordering::Acquire);
        let fault = record.read_volatile();
        record.write_volatile(FaultRecord { released: fault.released, ..FaultRecord::default() });
        fence(Ordering::Release);
        std::ptr::addr_of_mut!((*record).released).write_volatile(fault.released.wrapping_add(1));
        Some(fault)
    }
}

/// Turns a fault the GPU recorded into an error naming the argument and the limit.
pub(crate) fn fault_error(f: &FaultRecord) -> Error {
    // A negative code wraps to no known code.
    let message = match f.code as kernels::DeepepFaultCode {
        kernels::DEEPEP_FAULT_TOPK_OUT_OF_RANGE => format!(
            "topk_idx holds {} at flat index {}; entries must be -1 or an expert id in [0, {})",
            f.b, f.a, f.c
        ),
        kernels::DEEPEP_FAULT_RANK_COUNT => format!(
            "num_tokens_per_rank[{}] is {} but is_token_in_rank selects {} tokens for rank {}; \
             pass the outputs of one get_dispatch_layout call",
            f.a, f.b, f.c, f.a
        ),
        kernels::DEEPEP_FAULT_RDMA_RANK_COUNT => format!(
            "num_tokens_per_rdma_rank[{}] is {} but is_token_in_rank selects {} tokens for node {}; \
             pass the outputs of one get_dispatch_layout call",
            f.a, f.b, f.c, f.a
        ),
        kernels::DEEPEP_FAULT_WORST_TOO_SMALL => format!(
            "num_worst_tokens ({}) is smaller than the {} tokens this rank received; rows past it were dropped",
            f.a, f.b
        ),
        kernels::DEEPEP_FAULT_DISPATCH_HANDLE => bad_entry("dispatch", f),
        kernels::DEEPEP_FAULT_COMBINE_HANDLE => bad_entry("combine", f),
        kernels::DEEPEP_FAULT_LL_COMBINE_HANDLE => bad_entry("low_latency_combine", f),
        kernels::DEEPEP_FAULT_LL_SAME_HALF => format!(
            "rank {}: two low-latency sends in a row used buffer half {} (the half alternates on the host and is \
             fixed when a CUDA graph is captured: a graph replayed back to back must hold an even number of \
             low_latency_dispatch / low_latency_combine calls); the second op's data may be torn, and \
             clean_low_latency_buffer puts the halves back in step",
            f.b, f.a
        ),
        kernels::DEEPEP_FAULT_SHRINK_UNWRITTEN => format!(
            "internode dispatch (shrink): recv row {} (source rank {}, channel {}) was left unwritten although its \
             forwarder is live (a fault of the shrink protocol, not of the input); its receiver group took {} slots, \
             {} of them rows it could not place, its end markers emptied {} rows, its final slot total was {} \
             (started at that plus the rows emptied)",
            f.a,
            (f.b >> 48) & 0xffff,
            (f.b >> 32) & 0xffff,
            (f.c >> 32) & 0xffff_ffff,
            (f.b >> 16) & 0xffff,
            f.b & 0xffff,
            f.c & 0xffff_ffff
        ),
        _ => format!("the GPU reported bad input (fault code {}, {} {} {})", f.code, f.a, f.b, f.c),
    };
    Error::invalid(message)
}

/// An index a kernel read from the handle (or a peer) out of range; the kernel skipped what it
/// would have addressed, so nothing outside the outputs was written.
fn bad_entry(op: &str, f: &FaultRecord) -> String {
    const PREFIX: &str = "prefixes must be non-decreasing from 0 and within the rows";
    const SENT: &str = "a cached dispatch's matrix must hold is_token_in_rank's token counts, inclusive over channels";
    const SUMS: &str = "a cached dispatch's sums must be what the counts the peers send add up to; combine's within the rows";
    const HEADS: &str = "non-negative heads must count 0, 1, 2, ... in each channel's (or block's) tokens";
    // A negative entry wraps to no known entry.
    let (entry, rule) = match f.a as kernels::DeepepHandleEntry {
        kernels::DEEPEP_HANDLE_RANK_PREFIX => ("the handle's rank_prefix_matrix", PREFIX),
        kernels::DEEPEP_HANDLE_CHANNEL_PREFIX => ("the handle's channel_prefix_matrix", PREFIX),
        kernels::DEEPEP_HANDLE_RECV_CHANNEL_PREFIX => {
            ("the handle's recv_channel_prefix_matrix (with rank_prefix_matrix)", PREFIX)
        }
        kernels::DEEPEP_HANDLE_SEND_HEAD => ("the handle's send_head", PREFIX),
        kernels::DEEPEP_HANDLE_PEER_COUNTS => {
            ("the counts a peer sent (its handle's channel_prefix_matrix when cached)", PREFIX)
        }
        kernels::DEEPEP_HANDLE_LL_LAYOUT_RANGE => (
            "the handle's layout_range (handle[1])",
            "an entry is (first row << 32) | rows, at most num_max_dispatch_tokens_per_rank rows inside the expert's",
        ),
        kernels::DEEPEP_HANDLE_LL_SRC_INFO => {
            ("the handle's src_info (handle[0])", "token indices are below num_max_dispatch_tokens_per_rank")
        }
        kernels::DEEPEP_HANDLE_RDMA_CHANNEL_PREFIX => ("the handle's rdma_channel_prefix_matrix (handle[1])", SENT),
        kernels::DEEPEP_HANDLE_GBL_CHANNEL_PREFIX => ("the handle's gbl_channel_prefix_matrix (handle[2])", SENT),
        kernels::DEEPEP_HANDLE_RECV_RDMA_CHANNEL_PREFIX => (
            "the handle's recv_rdma_channel_prefix_matrix (handle[3])",
            "prefixes must be non-decreasing from 0, each row ending at its step of recv_rdma_rank_prefix_sum",
        ),
        kernels::DEEPEP_HANDLE_RECV_RDMA_RANK_PREFIX => ("the handle's recv_rdma_rank_prefix_sum (handle[4])", SUMS),
        kernels::DEEPEP_HANDLE_RECV_GBL_CHANNEL_PREFIX => ("the handle's recv_gbl_channel_prefix_matrix (handle[5])", PREFIX),
        kernels::DEEPEP_HANDLE_RECV_GBL_RANK_PREFIX => ("the handle's recv_gbl_rank_prefix_sum (handle[6])", SUMS),
        kernels::DEEPEP_HANDLE_SRC_META => (
            "the handle's recv_src_meta (handle[7], read as int32 pairs: source node, NVLink mask)",
            "a row holds its source node and a mask of that node's GPUs that includes this one",
        ),
        kernels::DEEPEP_HANDLE_SEND_RDMA_HEAD => ("the handle's send_rdma_head (handle[8])", HEADS),
        kernels::DEEPEP_HANDLE_SEND_NVL_HEAD => ("the handle's send_nvl_head (handle[9])", HEADS),
        kernels::DEEPEP_HANDLE_IS_TOKEN_IN_RANK => (
            "the handle's is_token_in_rank (handle[4]) against its channel_prefix_matrix (handle[1])",
            "a channel's tokens marked for a rank must be the count channel_prefix_matrix gives it; flat index = rank * \
             channels + channel, the value is the marked count",
        ),
        _ => ("an index entry", PREFIX),
    };
    // A cached dispatch does not skip: it sends what is_token_in_rank selects and goes by the
    // counts the peers sent, having rewritten the entry from them.
    let rewritten = f.code as kernels::DeepepFaultCode == kernels::DEEPEP_FAULT_DISPATCH_HANDLE
        && matches!(
            f.a as kernels::DeepepHandleEntry,
            kernels::DEEPEP_HANDLE_RDMA_CHANNEL_PREFIX
                | kernels::DEEPEP_HANDLE_GBL_CHANNEL_PREFIX
                | kernels::DEEPEP_HANDLE_RECV_RDMA_RANK_PREFIX
                | kernels::DEEPEP_HANDLE_RECV_GBL_RANK_PREFIX
        );
    let after = if rewritten {
        "The dispatch went by is_token_in_rank and the counts the peers sent, and rewrote the handle's entries from them"
    } else if f.a as kernels::DeepepHandleEntry == kernels::DEEPEP_HANDLE_IS_TOKEN_IN_RANK {
        "That channel sent that rank no rows, so its wait for them ends at its timeout"
    } else {
        "Rows it addressed were skipped"
    };
    format!(
        "{op}: {entry} holds {} at flat index {}, out of range ({rule}); the handle is corrupted or from another \
         buffer or config. {after}",
        f.c, f.b
    )
}

/// An LL signal is ((clean generation << 32) | sends on that buffer half) ^ DEEPEP_LL_SIGNAL_KEY:
/// which op was awaited and which the peer last sent there.
fn ll_ops(record: &StallRecord) -> String {
    let op = |v: i64| {
        let seq = v as u64 ^ kernels::DEEPEP_LL_SIGNAL_KEY as u64;
        format!("op {} of generation {}", seq & 0xffff_ffff, seq >> 32)
    };
    format!(" ({} of this half awaited, {} last seen)", op(record.expected), op(record.seen))
}

/// Turns an expired GPU wait into the timeout error that makes the buffer unusable.
pub(crate) fn stall_error(record: &StallRecord, timeout_ns: u64) -> Error {
    let (peer, n) = (record.peer, record.counter);
    // A negative op wraps to no known op.
    let what = match record.op as kernels::DeepepWaitOp {
        kernels::DEEPEP_WAIT_OP_LSA_BARRIER => format!("rank {peer} never arrived at LSA barrier slot {n}"),
        kernels::DEEPEP_WAIT_OP_DISPATCH_SLOT => format!("rank {peer} never sent its dispatch data (channel {n})"),
        kernels::DEEPEP_WAIT_OP_DISPATCH_CONSUMED => format!("rank {peer} never freed a dispatch ring slot (channel {n})"),
        kernels::DEEPEP_WAIT_OP_COMBINE_SLOT => format!("rank {peer} never sent its combine data (channel {n})"),
        kernels::DEEPEP_WAIT_OP_COMBINE_CONSUMED => format!("rank {peer} never freed a combine ring slot (channel {n})"),
        kernels::DEEPEP_WAIT_OP_LL_DISPATCH => format!("rank {peer} never sent its low-latency dispatch{}", ll_ops(record)),
        kernels::DEEPEP_WAIT_OP_LL_COMBINE => format!("rank {peer} never sent its low-latency combine{}", ll_ops(record)),
        kernels::DEEPEP_WAIT_OP_LL_CLEAN => format!("rank {peer} never arrived at clean_low_latency_buffer's barrier"),
        kernels::DEEPEP_WAIT_OP_INTERNODE_NOTIFY => format!("rank {peer} never sent its internode notify counts"),
        kernels::DEEPEP_WAIT_OP_RDMA_TAIL => {
            format!("rank {peer} never sent its rows over the scale-out leg (internode, channel {n})")
        }
        kernels::DEEPEP_WAIT_OP_RDMA_HEAD => {
            format!("rank {peer} never freed scale-out ring slots (internode, channel {n})")
        }
        kernels::DEEPEP_WAIT_OP_NVL_SLOT => format!("rank {peer} never sent its rows over the NVLink leg (internode, channel {n})"),
        kernels::DEEPEP_WAIT_OP_NVL_CONSUMED => {
            format!("rank {peer} never freed an NVLink ring slot (internode, channel {n})")
        }
        _ => format!("rank {peer} stalled wait op {} counter {n}", record.op),
    };
    Error::new(
        DeepepStatus::DEEPEP_ERROR_TIMEOUT,
        format!(
            "GPU wait timed out on rank {} after {:.1} s: {what} (expected {}, saw {}). \
             The buffer is unusable; destroy it.",
            record.rank,
            timeout_ns as f64 / 1e9,
            record.expected,
            record.seen
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_name_the_argument() {
        let f = FaultRecord { flag: 1, code: kernels::DEEPEP_FAULT_TOPK_OUT_OF_RANGE as i32, a: 5, b: 300, c: 256, ..Default::default() };
        assert!(fault_error(&f).message.contains("topk_idx holds 300 at flat index 5"));
        let f = FaultRecord { flag: 1, code: kernels::DEEPEP_FAULT_RANK_COUNT as i32, a: 2, b: 10, c: 9, ..Default::default() };
        assert!(fault_error(&f).message.starts_with("num_tokens_per_rank[2] is 10"));
        let f = FaultRecord { flag: 1, code: kernels::DEEPEP_FAULT_RDMA_RANK_COUNT as i32, a: 1, b: 7, c: 6, ..Default::default() };
        assert!(fault_error(&f).message.starts_with("num_tokens_per_rdma_rank[1] is 7 but is_token_in_rank selects 6 tokens for node 1"));
        let f = FaultRecord {
            flag: 1,
            code: kernels::DEEPEP_FAULT_SHRINK_UNWRITTEN as i32,
            a: 133,
            b: 2 << 48 | 7 << 32 | 1 << 16 | 3,
            c: 40 << 32 | 38,
            ..Default::default()
        };
        let m = fault_error(&f).message;
        assert!(m.contains("recv row 133 (source rank 2, channel 7)"), "{m}");
        assert!(m.contains("took 40 slots, 1 of them rows it could not place, its end markers emptied 3 rows"), "{m}");
        assert!(m.contains("final slot total was 38"), "{m}");
        let f = FaultRecord {
            flag: 1,
            code: kernels::DEEPEP_FAULT_DISPATCH_HANDLE as i32,
            a: kernels::DEEPEP_HANDLE_RECV_CHANNEL_PREFIX as i64,
            b: 13,
            c: -1,
            ..Default::default()
        };
        let m = fault_error(&f).message;
        assert!(m.starts_with("dispatch: the handle's recv_channel_prefix_matrix"), "{m}");
        assert!(m.contains("holds -1 at flat index 13"), "{m}");
        let f = FaultRecord { code: kernels::DEEPEP_FAULT_COMBINE_HANDLE as i32, a: kernels::DEEPEP_HANDLE_SEND_HEAD as i64, ..f };
        assert!(fault_error(&f).message.starts_with("combine: the handle's send_head holds -1"));
        assert!(fault_error(&FaultRecord { a: -3, ..f }).message.starts_with("combine: an index entry holds"));
        // Internode entries name DeepEP's handle index; a cached dispatch rewrites what it checked.
        let f = FaultRecord { a: kernels::DEEPEP_HANDLE_SEND_RDMA_HEAD as i64, b: 6, c: 1 << 20, ..f };
        let m = fault_error(&f).message;
        assert!(m.starts_with("combine: the handle's send_rdma_head (handle[8]) holds 1048576 at flat index 6"), "{m}");
        assert!(m.ends_with("Rows it addressed were skipped"), "{m}");
        let f = FaultRecord { a: kernels::DEEPEP_HANDLE_SRC_META as i64, b: 0, c: 127, ..f };
        assert!(fault_error(&f).message.starts_with("combine: the handle's recv_src_meta (handle[7]"));
        let f = FaultRecord {
            code: kernels::DEEPEP_FAULT_DISPATCH_HANDLE as i32,
            a: kernels::DEEPEP_HANDLE_RECV_GBL_RANK_PREFIX as i64,
            b: 0,
            c: 1 << 20,
            ..f
        };
        let m = fault_error(&f).message;
        assert!(m.starts_with("dispatch: the handle's recv_gbl_rank_prefix_sum (handle[6]) holds 1048576"), "{m}");
        assert!(m.ends_with("rewrote the handle's entries from them"), "{m}");
        for entry in [kernels::DEEPEP_HANDLE_RDMA_CHANNEL_PREFIX, kernels::DEEPEP_HANDLE_GBL_CHANNEL_PREFIX] {
            let m = fault_error(&FaultRecord { a: entry as i64, ..f }).message;
            assert!(m.contains("_channel_prefix_matrix (handle[") && m.contains("is_token_in_rank's token counts"), "{m}");
        }
        for entry in [
            kernels::DEEPEP_HANDLE_RECV_RDMA_CHANNEL_PREFIX,
            kernels::DEEPEP_HANDLE_RECV_RDMA_RANK_PREFIX,
            kernels::DEEPEP_HANDLE_RECV_GBL_CHANNEL_PREFIX,
            kernels::DEEPEP_HANDLE_SEND_NVL_HEAD,
        ] {
            let m = fault_error(&FaultRecord { code: kernels::DEEPEP_FAULT_COMBINE_HANDLE as i32, a: entry as i64, ..f }).message;
            assert!(m.starts_with("combine: the handle's ") && m.contains("(handle["), "{m}");
        }
        let f = FaultRecord { flag: 1, code: kernels::DEEPEP_FAULT_LL_SAME_HALF as i32, a: 1, b: 3, c: 0, ..Default::default() };
        assert!(fault_error(&f).message.starts_with("rank 3: two low-latency sends in a row used buffer half 1"));
        let f = FaultRecord {
            flag: 1,
            code: kernels::DEEPEP_FAULT_LL_COMBINE_HANDLE as i32,
            a: kernels::DEEPEP_HANDLE_LL_SRC_INFO as i64,
            b: 70,
            c: 4096,
            ..Default::default()
        };
        let m = fault_error(&f).message;
        assert!(m.starts_with("low_latency_combine: the handle's src_info (handle[0]) holds 4096 at flat index 70"), "{m}");
        assert!(m.contains("below num_max_dispatch_tokens_per_rank"), "{m}");
    }

    /// take_fault against the kernels' claim (record_fault_at's, mirrored by `claim`): one fault
    /// at a time, and the record free again once the host took it.
    #[test]
    fn a_taken_fault_frees_the_record_for_the_next() {
        fn claim(record: &mut FaultRecord, lock: &mut u32, code: i32) -> bool {
            if *lock != record.released {
                return false;
            }
            *lock += 1;
            *record = FaultRecord { flag: 1, code, a: 1, b: 2, c: 3, ..*record };
            true
        }
        let (mut record, mut lock) = (FaultRecord::default(), 0u32);
        // SAFETY (every take_fault): a live local record.
        assert!(unsafe { take_fault(&mut record) }.is_none());
        assert!(claim(&mut record, &mut lock, 1));
        assert!(!claim(&mut record, &mut lock, 2), "a second fault claimed a record the host had not taken");
        let f = unsafe { take_fault(&mut record) }.unwrap();
        assert_eq!((f.flag, f.code, f.a, f.b, f.c), (1, 1, 1, 2, 3));
        assert_eq!((record.flag, record.code, record.a, record.b, record.c, record.released), (0, 0, 0, 0, 0, 1));
        assert!(unsafe { take_fault(&mut record) }.is_none());
        assert!(claim(&mut record, &mut lock, 2), "the record stayed claimed after the host took its fault");
        assert_eq!(unsafe { take_fault(&mut record) }.map(|f| f.code), Some(2));
        assert_eq!((lock, record.released), (2, 2));
    }

    #[test]
    fn internode_stalls_name_the_leg_and_the_channel() {
        let record = |op: kernels::DeepepWaitOp| StallRecord {
            flag: 1,
            rank: 1,
            peer: 0,
            op: op as i32,
            counter: 3,
            reserved: 0,
            expected: 5,
            seen: 4,
        };
        let text = |op| stall_error(&record(op), 1_000_000_000).message;
        assert!(text(kernels::DEEPEP_WAIT_OP_RDMA_TAIL).contains("rank 0 never sent its rows over the scale-out leg (internode, channel 3)"));
        assert!(text(kernels::DEEPEP_WAIT_OP_RDMA_HEAD).contains("never freed scale-out ring slots (internode, channel 3)"));
        assert!(text(kernels::DEEPEP_WAIT_OP_NVL_SLOT).contains("over the NVLink leg (internode, channel 3)"));
        assert!(text(kernels::DEEPEP_WAIT_OP_NVL_CONSUMED).contains("never freed an NVLink ring slot"));
        let notify = text(kernels::DEEPEP_WAIT_OP_INTERNODE_NOTIFY);
        assert!(notify.starts_with("GPU wait timed out on rank 1 after 1.0 s: rank 0 never sent its internode notify counts"), "{notify}");
    }

    #[test]
    fn stalls_name_the_peer_and_the_wait() {
        let record = StallRecord {
            flag: 1,
            rank: 3,
            peer: 5,
            op: kernels::DEEPEP_WAIT_OP_DISPATCH_SLOT as i32,
            counter: 7,
            reserved: 0,
            expected: 2,
            seen: 1,
        };
        let err = stall_error(&record, 100_000_000_000);
        assert_eq!(err.status, DeepepStatus::DEEPEP_ERROR_TIMEOUT);
        assert_eq!(
            err.message,
            "GPU wait timed out on rank 3 after 100.0 s: rank 5 never sent its dispatch data (channel 7) \
             (expected 2, saw 1). The buffer is unusable; destroy it."
        );
        let unknown = stall_error(&StallRecord { op: -4, ..record }, 1_500_000_000);
        assert!(unknown.message.contains("after 1.5 s: rank 5 stalled wait op -4 counter 7"), "{}", unknown.message);
        // An LL signal: (clean generation << 32) | sends on the half.
        let signal = |seq: u64| (seq ^ kernels::DEEPEP_LL_SIGNAL_KEY as u64) as i64;
        let ll = StallRecord {
            op: kernels::DEEPEP_WAIT_OP_LL_DISPATCH as i32,
            expected: signal((2 << 32) | 5),
            seen: signal(4),
            ..record
        };
        assert!(
            stall_error(&ll, 1_000_000_000).message.contains(
                "rank 5 never sent its low-latency dispatch (op 5 of generation 2 of this half awaited, \
                 op 4 of generation 0 last seen)"
            ),
            "{}",
            stall_error(&ll, 1_000_000_000).message
        );
    }
}

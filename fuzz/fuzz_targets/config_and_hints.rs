//! Config construction, the tuned defaults, the buffer-size hints and the buffer/LL checks
//! through the C ABI with arbitrary (edge-biased) ints: never INTERNAL (a caught panic or a
//! fired overflow check), and every size that comes back is >= 0, aligned and at least an
//! obvious lower bound computed in i128 (a smaller value is a wrapped one).
#![no_main]
use deepep_nccl::capi::*;
use deepep_nccl::config::DeepepConfig;
use fuzz_common::*;
use libfuzzer_sys::fuzz_target;

const ZERO: DeepepConfig = DeepepConfig {
    num_sms: 0,
    num_max_nvl_chunked_send_tokens: 0,
    num_max_nvl_chunked_recv_tokens: 0,
    num_max_rdma_chunked_send_tokens: 0,
    num_max_rdma_chunked_recv_tokens: 0,
};

/// What a config that passed the C ABI's checks must look like.
fn check_config(c: &DeepepConfig, want_rdma_recv_at_least: i32) {
    assert!(c.num_sms >= 0, "{c:?}");
    assert!(0 < c.num_max_nvl_chunked_send_tokens && c.num_max_nvl_chunked_send_tokens < c.num_max_nvl_chunked_recv_tokens, "{c:?}");
    let (s, r) = (c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens);
    // The rounded-up recv size must not wrap past i32::MAX into a negative/smaller value.
    assert!(s > 0 && r >= want_rdma_recv_at_least && r % s == 0, "rdma recv rounded to {r} (send {s}, asked {want_rdma_recv_at_least}): wrapped; {c:?}");
}

fn hints(u: &mut Unstructured, c: &DeepepConfig, validated: bool) {
    let hidden_bytes = i64_edge(u);
    let ranks = i32_edge(u);
    let ctx = format!("{c:?} hidden_bytes={hidden_bytes} num_ranks={ranks} validated={validated}");
    trace(&ctx);
    let mut nvl = -7i64;
    let nvl_ok = ok_or_invalid(&format!("nvl hint {ctx}"), deepep_config_nvl_buffer_size_hint(c, hidden_bytes, ranks, &mut nvl));
    let mut rdma = -7i64;
    let rdma_ok = ok_or_invalid(&format!("rdma hint {ctx}"), deepep_config_rdma_buffer_size_hint(c, hidden_bytes, ranks, &mut rdma));
    let channels = (c.num_sms / 2) as i128;
        if nvl_ok {
        let nvl_ranks = ranks.min(8) as i128;
        let lower = prod(&[channels, nvl_ranks, c.num_max_nvl_chunked_recv_tokens as i128, hidden_bytes as i128]);
        assert!(nvl >= 0 && nvl % 128 == 0 && nvl as i128 >= lower, "nvl hint {nvl} < {lower}: wrapped; {ctx}");
        // Monotonic in hidden_bytes.
        if let Some(h2) = hidden_bytes.checked_add(1 + (hidden_bytes & 0xff)) {
            let mut nvl2 = -7i64;
            if ok_or_invalid(&format!("nvl hint h2={h2} {ctx}"), deepep_config_nvl_buffer_size_hint(c, h2, ranks, &mut nvl2)) {
                assert!(nvl2 >= nvl, "nvl hint not monotonic: {nvl2} at hidden_bytes={h2} < {nvl}; {ctx}");
            }
        }
    }
    if rdma_ok {
        let rdma_ranks = (ranks / 8) as i128;
        let lower = if ranks <= 8 { 0 } else { prod(&[2, channels, rdma_ranks, c.num_max_rdma_chunked_recv_tokens as i128, hidden_bytes as i128]) };
        assert!(rdma >= 0 && rdma % 128 == 0 && rdma as i128 >= lower, "rdma hint {rdma} < {lower}: wrapped; {ctx}");
        if ranks <= 8 {
            assert_eq!(rdma, 0, "within one node the rdma hint is 0; {ctx}");
        }
    }
}

fn ll(u: &mut Unstructured) {
    let (m, hidden, ranks, experts) = (i64_edge(u), i64_edge(u), i32_edge(u), i32_edge(u));
    let ctx = format!("M={m} hidden={hidden} num_ranks={ranks} num_experts={experts}");
    trace(&ctx);
    let mut hint = -7i64;
    let hint_ok = ok_or_invalid(&format!("ll hint {ctx}"), deepep_low_latency_rdma_size_hint(m, hidden, ranks, experts, &mut hint));
    if hint_ok {
        // recv alone is >= E * M * 2H bytes per half, two halves.
        let lower = prod(&[4, experts as i128, m as i128, hidden as i128]);
        assert!(hint > 0 && hint % 128 == 0 && hint as i128 >= lower, "ll hint {hint} < {lower}: wrapped; {ctx}");
    }
    if ok_or_invalid(&format!("ll check_shape {ctx}"), deepep_low_latency_check_shape(m, hidden, ranks, experts)) {
        // A shape the LL ops accept must have a size hint.
        assert!(hint_ok, "check_shape accepts but the hint refuses: {}; {ctx}", last_error());
    }
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    while !u.is_empty() {
        match u.int_in_range(0u8..=5).unwrap_or(0) {
            0 => {
                let a = [i32_edge(&mut u), i32_edge(&mut u), i32_edge(&mut u), i32_edge(&mut u), i32_edge(&mut u)];
                let mut c = ZERO;
                trace(&format!("config_init{a:?}"));
                if ok_or_invalid(&format!("config_init{a:?}"), deepep_config_init(&mut c, a[0], a[1], a[2], a[3], a[4])) {
                    check_config(&c, a[4]);
                    assert_eq!((c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens), (a[0], a[1], a[2]));
                    hints(&mut u, &c, true);
                }
                // NULL out is refused, not written.
                ok_or_invalid("config_init(NULL)", deepep_config_init(std::ptr::null_mut(), a[0], a[1], a[2], a[3], a[4]));
            }
            1 => {
                let (kind, ranks, sms) = (i32_edge(&mut u) % 3, i32_edge(&mut u), i32_edge(&mut u));
                let mut c = ZERO;
                trace(&format!("config_default({kind}, {ranks}, {sms})"));
                if ok_or_invalid(&format!("config_default({kind}, {ranks}, {sms})"), deepep_config_default(&mut c, kind, ranks, sms)) {
                    check_config(&c, 1);
                    hints(&mut u, &c, true);
                }
            }
            2 => {
                // A config the caller filled by hand: the hints must still refuse or give sane sizes.
                let c = DeepepConfig {
                    num_sms: i32_edge(&mut u),
                    num_max_nvl_chunked_send_tokens: i32_edge(&mut u),
                    num_max_nvl_chunked_recv_tokens: i32_edge(&mut u),
                    num_max_rdma_chunked_send_tokens: i32_edge(&mut u),
                    num_max_rdma_chunked_recv_tokens: i32_edge(&mut u),
                };
                hints(&mut u, &c, false);
            }
            3 => ll(&mut u),
            4 => {
                let (rank, ranks, nvl, rdma, llm) = (i32_edge(&mut u), i32_edge(&mut u), i64_edge(&mut u), i64_edge(&mut u), bool_(&mut u));
                trace(&format!("check_buffer_args({rank}, {ranks}, {nvl}, {rdma}, {llm})"));
                if ok_or_invalid(&format!("check_buffer_args({rank}, {ranks}, {nvl}, {rdma}, {llm})"), deepep_check_buffer_args(rank, ranks, nvl, rdma, llm)) {
                    assert!(nvl >= 0 && rdma >= 0 && nvl % 128 == 0 && rdma % 128 == 0 && 0 <= rank && rank < ranks);
                }
            }
            _ => {
                let mut out = 0i64;
                no_internal("hint(NULL cfg)", deepep_config_nvl_buffer_size_hint(std::ptr::null(), 1, 1, &mut out));
                no_internal("hint(NULL out)", deepep_config_rdma_buffer_size_hint(&ZERO, 1, 1, std::ptr::null_mut()));
                no_internal("ll hint(NULL out)", deepep_low_latency_rdma_size_hint(1, 128, 1, 1, std::ptr::null_mut()));
            }
        }
    }
});

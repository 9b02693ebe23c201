//! The pure geometry behind the `*_outputs` queries (no buffer, no GPU): arbitrary shapes give
//! an error or a description whose sizes hold together: no negative dim or stride, every
//! present output inside its allocation (offset + span <= allocation_elems, computed in i128),
//! outputs sharing an allocation disjoint, allocation bytes within i64, outer dims as asked.
#![no_main]
use deepep_nccl::layout::layout_outputs;
use deepep_nccl::ll::{self, LlShape};
use deepep_nccl::normal::{combine, dispatch};
use deepep_nccl::outputs::{DeepepOutputs, DEEPEP_MAX_OP_OUTPUTS};
use deepep_nccl::tensor::{DeepepDtype, DeepepTensor};
use fuzz_common::*;
use libfuzzer_sys::fuzz_target;

fn dtype(u: &mut Unstructured) -> DeepepDtype {
    DeepepDtype::from_code(u.int_in_range(1i32..=8).unwrap_or(1)).expect("1..=8 are dtypes")
}

/// Elements from the view's start to one past its last element (0 when empty), exact.
fn span(t: &DeepepTensor) -> i128 {
    let n = t.ndim as usize;
    if t.shape[..n].iter().any(|d| *d == 0) {
        return 0;
    }
    t.shape[..n].iter().zip(&t.strides[..n]).fold(1i128, |a, (d, s)| a.saturating_add(prod(&[*d as i128 - 1, *s as i128])))
}

fn check_tensor(t: &DeepepTensor, ctx: &str) -> i128 {
    let n = t.ndim as usize;
    assert!(n <= 4 && t.data.is_null(), "{ctx}: {t:?}");
    assert!(t.shape[..n].iter().all(|d| *d >= 0) && t.strides[..n].iter().all(|s| *s >= 0), "{ctx}: negative dim/stride {t:?}");
    let size = DeepepDtype::from_code(t.dtype).unwrap_or_else(|| panic!("{ctx}: unknown dtype {t:?}")).size() as i128;
    let s = span(t);
    assert!(prod(&[s, size]) <= i64::MAX as i128, "{ctx}: span {s} elems overflows i64 bytes: {t:?}");
    s
}

fn check(o: &DeepepOutputs, ctx: &str) {
    let (count, nalloc) = (o.count as usize, o.num_allocations as usize);
    assert!(count <= DEEPEP_MAX_OP_OUTPUTS && nalloc <= count, "{ctx}: count {count} allocations {nalloc}");
    let mut ranges: Vec<(i32, i128, i128)> = Vec::new();
    for i in 0..count {
        let t = &o.tensors[i];
        if t.dtype == 0 {
            assert_eq!(o.allocation[i], -1, "{ctx}: absent output {i} has an allocation");
            continue;
        }
        let s = check_tensor(t, ctx);
        let g = o.allocation[i];
        assert!(0 <= g && (g as usize) < nalloc, "{ctx}: output {i} in allocation {g} of {nalloc}");
        let g = g as usize;
        assert_eq!(o.allocation_dtype[g], t.dtype, "{ctx}: output {i} dtype differs from its allocation's");
        let (off, elems) = (o.offset[i] as i128, o.allocation_elems[g] as i128);
        let size = DeepepDtype::from_code(t.dtype).unwrap().size() as i128;
        assert!(off >= 0 && off.saturating_add(s) <= elems, "{ctx}: output {i} [{off}, {}) outside allocation {g} of {elems} elems", off.saturating_add(s));
        assert!(prod(&[elems, size]) <= i64::MAX as i128, "{ctx}: allocation {g} of {elems} elems overflows i64 bytes");
        if s > 0 {
            for &(h, a, b) in &ranges {
                assert!(h != g as i32 || off >= b || off.saturating_add(s) <= a, "{ctx}: output {i} overlaps [{a}, {b}) in allocation {g}");
            }
            ranges.push((g as i32, off, off.saturating_add(s)));
        }
    }
}

/// Runs a geometry call, traced (see [`trace`]).
fn call<T>(ctx: &str, f: impl FnOnce() -> T) -> Option<T> {
    trace(ctx);
    Some(f())
}

fn dim0(o: &DeepepOutputs, i: usize) -> i64 {
    o.tensors[i].shape[0]
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    while !u.is_empty() {
        match u.int_in_range(0u8..=5).unwrap_or(0) {
            0 => {
                let (r, t, e) = (i32_edge(&mut u), i64_edge(&mut u), i32_edge(&mut u));
                let ctx = format!("layout_outputs({r}, {t}, {e})");
                if let Some(Ok(o)) = call(&ctx, || layout_outputs(r, t, e)) {
                    check(&o, &ctx);
                    assert_eq!((dim0(&o, 0), dim0(&o, 2), dim0(&o, 3)), (r as i64, e as i64, t));
                }
            }
            1 => {
                let (r, t, c, cached) = (i64_edge(&mut u), i64_edge(&mut u), i64_edge(&mut u), bool_(&mut u));
                let ctx = format!("handle_outputs({r}, {t}, {c}, {cached})");
                if let Some(Ok(o)) = call(&ctx, || dispatch::handle_outputs(r, t, c, cached)) {
                    check(&o, &ctx);
                    assert_eq!(dim0(&o, 3), t);
                }
            }
            2 => {
                let (cached, worst, recv) = (bool_(&mut u), i32_edge(&mut u), i32_edge(&mut u));
                let rows = match dispatch::num_recv_rows(cached, worst, recv) {
                    Ok(n) => n,
                    Err(_) => i64_edge(&mut u),
                };
                let x = (dtype(&mut u), i64_edge(&mut u));
                let scales = if bool_(&mut u) { Some((dtype(&mut u), i64_edge(&mut u))) } else { None };
                let topk = if bool_(&mut u) { Some((dtype(&mut u), i64_edge(&mut u))) } else { None };
                let ctx = format!("recv_outputs({rows}, {x:?}, {scales:?}, {topk:?})");
                if let Some(Ok(o)) = call(&ctx, || dispatch::recv_outputs(rows, x, scales, topk)) {
                    check(&o, &ctx);
                    for i in 0..o.count as usize {
                        assert!(o.tensors[i].dtype == 0 || dim0(&o, i) == rows, "{ctx}: output {i} rows");
                    }
                }
            }
            3 => {
                let (t, h, d) = (i64_edge(&mut u), i64_edge(&mut u), dtype(&mut u));
                let k = if bool_(&mut u) { Some(i64_edge(&mut u)) } else { None };
                let ctx = format!("combine_outputs({t}, {h}, {d:?}, {k:?})");
                if let Some(Ok(o)) = call(&ctx, || combine::combine_outputs(t, h, d, k)) {
                    check(&o, &ctx);
                    assert_eq!(dim0(&o, 0), t);
                }
            }
            4 => {
                // num_ranks comes from a live buffer (>= 1); LlShape::new divides by it.
                let (m, h, e, r) = (i64_edge(&mut u), i64_edge(&mut u), i64_edge(&mut u), i64_edge(&mut u).max(1));
                let (fp8, ue) = (bool_(&mut u), bool_(&mut u));
                let ctx = format!("LlShape::new({m}, {h}, {e}, {r}) fp8={fp8} ue8m0={ue}");
                if let Some(Ok(shape)) = call(&ctx, || LlShape::new(m, h, e, r)) {
                    assert!(shape.local_experts() >= 1 && shape.rows() >= 1, "{ctx}");
                    if let Some(Ok(o)) = call(&ctx, || ll::dispatch::outputs(shape, fp8, ue)) {
                        check(&o, &ctx);
                        assert_eq!(o.tensors[0].shape[..3], [shape.local_experts(), shape.rows(), h], "{ctx}");
                    }
                    if let Some(t) = call(&ctx, || ll::control::combine_view(shape)) {
                        check_tensor(&t, &ctx);
                    }
                }
            }
            _ => {
                let (t, h) = (i64_edge(&mut u), i64_edge(&mut u));
                let ctx = format!("ll::combine::outputs({t}, {h})");
                if let Some(Ok(o)) = call(&ctx, || ll::combine::outputs(t, h)) {
                    check(&o, &ctx);
                    assert_eq!(dim0(&o, 0), t);
                }
            }
        }
    }
});

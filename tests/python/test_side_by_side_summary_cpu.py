"""bench/side_by_side_summary.py reads DeepEP's own tests' figures from their logs (lines as
DeepEP 567632d prints them), for ours and V1, and leaves out what a log lacks."""
import importlib.util
import json
import os

BENCH = os.path.join(os.path.dirname(__file__), '..', '..', 'bench')
spec = importlib.util.spec_from_file_location('side_by_side_summary', os.path.join(BENCH, 'side_by_side_summary.py'))
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)

INTRANODE = """[config] num_tokens=4096, hidden=7168, num_topk=8
[tuning] SMs 24, NVL chunk 4: 380.11 GB/s (NVL), 158.02 us
[tuning] Best dispatch (FP8): SMs 24, NVL chunk 30, 421.56 GB/s (NVL), t: 143.12 us
[tuning] Best dispatch (BF16): SMs 24, NVL chunk 14, 509.25 GB/s (NVL), t: 229.77 us
[tuning] Best combine: SMs 24, NVL chunk 1: 527.98 GB/s (NVL), t: 221.62 us
"""
LOW_LATENCY = """[rank 1] Dispatch + combine bandwidth: 267.32 GB/s, avg_t=82.48 us, min_t=69.70 us, max_t=134.05 us
[rank 0] Dispatch + combine bandwidth: 272.16 GB/s, avg_t=81.01 us, min_t=69.98 us, max_t=124.42 us
[rank 1] Dispatch bandwidth: 454.73 GB/s, avg_t=16.52 us | Combine bandwidth: 459.57 GB/s, avg_t=31.63 us
[rank 0] Dispatch bandwidth: 460.59 GB/s, avg_t=16.31 us | Combine bandwidth: 469.06 GB/s, avg_t=30.99 us
[rank 0] Dispatch send/recv time: 8.07 + 7.41 us | Combine send/recv time: 25.35 + 9.37 us
"""


def test_reads_each_package_and_rank_0(tmp_path):
    (tmp_path / 'ours_test_intranode.log').write_text(INTRANODE)
    (tmp_path / 'ours_test_low_latency.log').write_text(LOW_LATENCY)
    (tmp_path / 'v1_test_intranode.log').write_text(INTRANODE.replace('421.56', '246.39'))
    rows = summary.deepep_test_rows(str(tmp_path))
    ours, v1 = summary.OURS, summary.V1
    assert rows[('test_intranode', 'HT FP8 dispatch, tuned best', 'GB/s')] == {ours: 421.56, v1: 246.39}
    assert rows[('test_intranode', 'HT BF16 dispatch, tuned best', 'us')] == {ours: 229.77, v1: 229.77}
    assert rows[('test_intranode', 'HT combine, tuned best', 'GB/s')][ours] == 527.98
    # rank 0's lines, not rank 1's printed before them; V1 has no low-latency log: no V1 entry
    assert rows[('test_low_latency', 'LL dispatch + combine, plain, avg', 'us')] == {ours: 81.01}
    assert rows[('test_low_latency', 'LL dispatch + combine, plain, min', 'us')] == {ours: 69.98}
    assert rows[('test_low_latency', 'LL dispatch, kineto', 'us')] == {ours: 16.31}
    assert rows[('test_low_latency', 'LL combine, kineto', 'us')] == {ours: 30.99}
    assert rows[('test_low_latency', 'LL combine hook send', 'us')] == {ours: 25.35}
    assert rows[('test_low_latency', 'LL combine hook recv', 'us')] == {ours: 9.37}


def test_no_logs_no_rows(tmp_path):
    assert summary.deepep_test_rows(str(tmp_path)) == {}


def _ll_host(path, dispatch_us):
    """A bench_ll_host.py JSON with one row: plain LL dispatch at T=128 (two ranks, best rounds)."""
    host_path = summary.V1 if summary.V1 in path.name else 'compiled'  # as bench_ll_host.py names them
    row = {'op': 'dispatch', 'num_tokens': 128, 'deepep_defaults': False, 'host_path': host_path,
           'host_us': [[dispatch_us + 3.0, dispatch_us], [dispatch_us + 2.0, dispatch_us + 1.0]]}
    path.write_text(json.dumps({'results': [row]}))


def test_host_rows_keep_each_packages_better_placement(tmp_path):
    key = ('LL dispatch', 128, 'plain')
    _ll_host(tmp_path / 'bench_ll_host_deepep-nccl.json', 30.0)  # ours first: rank mean 30.5
    _ll_host(tmp_path / 'bench_ll_host_deepep_v1.json', 20.0)
    _ll_host(tmp_path / 'bench_ll_host_deepep_v1_again.json', 24.0)
    assert summary.host_rows(str(tmp_path))[key] == {'compiled': 30.5, summary.V1: 20.5}
    _ll_host(tmp_path / 'bench_ll_host_deepep-nccl_again.json', 18.0)  # ours again, last: better
    assert summary.host_rows(str(tmp_path))[key] == {'compiled': 18.5, summary.V1: 20.5}


def _normal_rows(path, e2e_us, kernel_us, chunk):
    """A bench_normal.py JSON with one row: BF16 non-cached dispatch at 24 SMs, T=128."""
    row = {'op': 'dispatch_noncached', 'dtype': 'bf16', 'num_sms': 24, 'num_tokens': 128, 'e2e_us': e2e_us,
           'kernel_us': kernel_us, 'nvl_chunk': chunk}
    path.write_text(json.dumps({'rows': [row]}))


def test_gpu_rows_keep_each_figures_better_placement(tmp_path):
    key = ('dispatch_noncached', 'bf16', 24, 128)
    _normal_rows(tmp_path / 'bench_normal_deepep-nccl.json', 85.0, 66.6, 24)  # a late rank in the kernels
    _normal_rows(tmp_path / 'bench_normal_deepep_v1.json', 79.7, 57.6, 6)
    assert summary.gpu_rows(str(tmp_path))[key] == {
        summary.OURS: {'e2e_us': 85.0, 'kernel_us': 66.6, 'nvl_chunk': 24},
        summary.V1: {'e2e_us': 79.7, 'kernel_us': 57.6, 'nvl_chunk': 6}}
    _normal_rows(tmp_path / 'bench_normal_deepep-nccl_again.json', 89.9, 48.4, 12)
    _normal_rows(tmp_path / 'bench_normal_deepep_v1_again.json', 71.1, 60.1, 12)
    assert summary.gpu_rows(str(tmp_path))[key] == {
        summary.OURS: {'e2e_us': 85.0, 'kernel_us': 48.4, 'nvl_chunk': 24},
        summary.V1: {'e2e_us': 71.1, 'kernel_us': 57.6, 'nvl_chunk': 12}}

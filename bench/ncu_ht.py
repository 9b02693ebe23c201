"""Nsight Compute of the HT kernels (normal mode, 2 ranks): where dispatch_kernel and combine_kernel
spend their time (issue stalls, NVLink bytes, HBM and LSU load). bench/RESULTS.md "Where the HT
kernel time goes" is its reading.

Rank 0 runs under ncu and starts rank 1 as a child outside it (ncu's environment stripped), so
the profiled kernel always has a live peer; ncu replays the whole application once per pass
(`--replay-mode application`: kernel replay would rerun one rank's kernel without its peer). The
profiled launches are the PROFILED-th cached dispatch (BF16, or FP8 with --dtype fp8) and combine of a warm loop, T=4096, on
bench_normal.py's inputs and configs (hidden 7168, top-8 of 256 experts). Under ncu the peer runs ahead (the profiled rank starts each
kernel late), so its times are longer than unprofiled ones: read shapes, not times.

Run: python bench/ncu_ht.py --out DIR [--sms 24] [--dtype bf16|fp8] [--sections ...]   (about 4-5 minutes: 30-40
passes of ~7 s). Writes DIR/ht.ncu-rep, DIR/ht_details.txt and DIR/ht_raw.csv and prints the
details. GPU suite step: profile_ht (runs only when SUITE_STEPS names it)."""
import argparse
import os
import shutil
import subprocess
import sys

NUM_TOKENS = 4096  # per rank; hidden, experts and top-k are bench_normal's
WARM_CALLS = 12  # cached dispatch + combine pairs after the first (non-cached) dispatch
PROFILED = 8  # which pair ncu profiles (1-based), well after warm-up
DEFAULT_SECTIONS = ('SpeedOfLight', 'WarpStateStats', 'SchedulerStats', 'Nvlink', 'MemoryWorkloadAnalysis',
                    'LaunchStats', 'Occupancy')
CHILD_RANK = 'DEEPEP_NCU_HT_RANK'  # set in each rank's environment: the rank runs the op loop


def ncu_skip():
    """Launches of dispatch_kernel|combine_kernel before the PROFILED-th pair: the non-cached
    dispatch, then (dispatch, combine) per loop step."""
    return 1 + 2 * (PROFILED - 1)


def run_ncu(args):
    ncu = shutil.which('ncu')
    if ncu is None:
        sys.exit('ncu_ht: ncu not found on PATH')
    os.makedirs(args.out, exist_ok=True)
    listed = subprocess.run([ncu, '--list-sections'], capture_output=True, text=True).stdout
    sections = [s for s in args.sections if any(line.split()[:1] == [s] for line in listed.splitlines())]
    missing = sorted(set(args.sections) - set(sections))
    if missing:
        print(f'ncu_ht: this ncu has no section {", ".join(missing)}; profiling without', flush=True)
    report = os.path.join(args.out, 'ht')
    env = dict(os.environ, **{CHILD_RANK: '0'})
    cmd = [ncu, '--target-processes', 'application-only', '--clock-control', 'none', '--replay-mode', 'application',
           '--app-replay-match', 'grid', '-k', 'regex:dispatch_kernel|combine_kernel', '--launch-skip',
           str(ncu_skip()), '--launch-count', '2', *[a for s in sections for a in ('--section', s)], '-o', report, '-f',
           sys.executable, os.path.abspath(__file__), '--sms', str(args.sms), '--port', str(args.port), '--dtype', args.dtype]
    print(' '.join(cmd), flush=True)
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        sys.exit(f'ncu_ht: ncu exited {done.returncode}')
    for page, name, extra in (('details', 'ht_details.txt', ['--print-units', 'base']), ('raw', 'ht_raw.csv', ['--csv'])):
        with open(os.path.join(args.out, name), 'w') as f:
            subprocess.run([ncu, '-i', report + '.ncu-rep', '--page', page, *extra], stdout=f, check=True)
    with open(os.path.join(args.out, 'ht_details.txt')) as f:
        print(f.read(), flush=True)


def run_rank(rank, args):
    """One rank of the profiled application; rank 0 starts rank 1 outside ncu and waits for it."""
    import torch
    import torch.distributed as dist

    import deep_ep
    from bench_normal import Inputs, Point, cached_configs

    child = None
    if rank == 0:
        # Without ncu's injection variables the child is not profiled (and never serialised by ncu).
        env = {k: v for k, v in os.environ.items() if not any(s in k for s in ('INJECTION', 'NSIGHT', 'NV_COMPUTE'))}
        env[CHILD_RANK] = '1'
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), '--sms', str(args.sms),
                                  '--port', str(args.port), '--dtype', args.dtype], env=env)
    torch.cuda.set_device(rank)
    dist.init_process_group('nccl', init_method=f'tcp://127.0.0.1:{args.port}', rank=rank, world_size=2,
                            device_id=torch.device('cuda', rank))
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0, explicitly_destroy=True)
    inp = Inputs(buf, NUM_TOKENS, rank)  # bench_normal's tokens, routing and layout
    point = Point(buf, inp, args.sms)  # its first (non-cached) BF16 dispatch: the handle
    dispatch_config, combine_config = cached_configs(args.sms)
    x, recv_x, handle = inp.x_fp8 if args.dtype == 'fp8' else inp.x, point.recv_x, point.handle
    for _ in range(WARM_CALLS):
        buf.dispatch(x, handle=handle, config=dispatch_config)
        buf.combine(recv_x, handle, config=combine_config)
    torch.cuda.synchronize()
    # The teardown is collective: both ranks here, before rank 0 blocks in child.wait() (a teardown
    # at exit would leave rank 1 waiting out the GPU timeout in every ncu pass).
    buf.destroy()
    dist.barrier()
    dist.destroy_process_group()
    if child is not None and child.wait() != 0:
        sys.exit(f'ncu_ht: rank 1 exited {child.returncode}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', help='where the report goes (runs ncu; without: one rank of the application)')
    parser.add_argument('--sms', type=int, default=24)
    parser.add_argument('--port', type=int, default=29541)
    parser.add_argument('--dtype', choices=('bf16', 'fp8'), default='bf16',
                        help="the profiled dispatch's x: BF16, or FP8 e4m3 with column-major scales (DeepEP's test)")
    parser.add_argument('--sections', nargs='+', default=list(DEFAULT_SECTIONS))
    args = parser.parse_args()
    assert 0 < PROFILED <= WARM_CALLS
    rank = os.environ.get(CHILD_RANK)
    if rank is None:
        if not args.out:
            parser.error('--out is required (the ranks are started by ncu)')
        run_ncu(args)
    else:
        run_rank(int(rank), args)


if __name__ == '__main__':
    main()

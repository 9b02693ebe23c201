"""The summary of bench/side_by_side.sh: ours vs DeepEP V1 per op, from the JSON that its steps wrote.

Reads DIR/{bench_normal,bench_ll_host,eager_profile}_<package>.json (bench_normal and bench_ll_host
also DIR/<tool>_<package>_again.json, their second placement, where present), the logs of DeepEP's own tests
DIR/{ours,v1}_test_{intranode,low_latency}.log (any may be missing: its rows are left out) and
DIR/steps.tsv (step, seconds, status); prints markdown tables and writes them as JSON.

Run: python bench/side_by_side_summary.py DIR [--json PATH]
"""
import argparse
import json
import os
import re

OURS, V1 = 'deepep-nccl', 'deepep_v1'
MODES = {False: 'plain', True: 'DeepEP defaults'}


def load(directory, tool, package):
    path = os.path.join(directory, f'{tool}_{package}.json')
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_text(path):
    """The file's text, or '' where it is missing."""
    if not os.path.isfile(path):
        return ''
    with open(path) as f:
        return f.read()


def mean(values):
    return sum(values) / len(values)


def cell(v):
    return '-' if v is None else f'{v:.1f}'


def ratio(a, b):
    return '-' if a is None or not b else f'{a / b:.2f}'


def smaller(a, b):
    """The smaller of two figures, either of which may be missing (None): a package's better placement."""
    return b if a is None or (b is not None and b < a) else a


def host_rows(directory):
    """{(op, T, mode): {column: us}}, columns 'compiled' / 'ctypes' (ours) and 'deepep_v1': the best
    round's us per call, rank average; where a tool also ran again in the other order
    (TOOL_<package>_again.json), the better of the package's two placements."""
    table = {}

    def put(key, column, us):
        cols = table.setdefault(key, {})
        cols[column] = smaller(cols.get(column), us)

    for package in (OURS, V1):
        for run in (package, f'{package}_again'):
            normal = load(directory, 'bench_normal', run)
            for r in (normal or {}).get('host_overhead', []):
                for key, mode in (('plain', False), ('deepep_defaults', True)):
                    put((f'normal {r["op"]}', r['num_tokens'], MODES[mode]), r['path'], r[key]['launch_us'])
            ll = load(directory, 'bench_ll_host', run)
            for r in (ll or {}).get('results', []):
                put((f'LL {r["op"]}', r['num_tokens'], MODES[r['deepep_defaults']]), r['host_path'],
                    mean([best for _, best in r['host_us']]))
    return table


def gpu_rows(directory):
    """{(op, dtype, SMs, T): {package: {e2e_us, kernel_us, nvl_chunk}}} of bench_normal's rows; where it
    also ran again in the other order, each figure the better of the package's two placements (a
    single rank's late arrival moves a whole T=128 row), nvl_chunk that of the better e2e."""
    table = {}
    for package in (OURS, V1):
        for run in (package, f'{package}_again'):
            for r in (load(directory, 'bench_normal', run) or {}).get('rows', []):
                by = table.setdefault((r['op'], r['dtype'], r['num_sms'], r['num_tokens']), {})
                best = by.setdefault(package, {'e2e_us': None, 'kernel_us': None, 'nvl_chunk': None})
                if smaller(best['e2e_us'], r.get('e2e_us')) != best['e2e_us']:
                    best['e2e_us'], best['nvl_chunk'] = r['e2e_us'], r.get('nvl_chunk')
                best['kernel_us'] = smaller(best['kernel_us'], r.get('kernel_us'))
    return table


# DeepEP's tests print these lines (test_low_latency.py once per rank: rank 0's are taken).
NUMBER = r'([0-9.]+)'


def tuned_best(printed, metric):
    """test_intranode's `[tuning] Best <printed>:` line: its GB/s and time."""
    pattern = r'\[tuning\] Best ' + re.escape(printed) + r':.*?' + NUMBER + r' GB/s.*?t: ' + NUMBER + ' us'
    return 'test_intranode', pattern, (metric, 'GB/s'), (metric, 'us')


DEEPEP_TEST_LINES = (
    tuned_best('dispatch (FP8)', 'HT FP8 dispatch, tuned best'),
    tuned_best('dispatch (BF16)', 'HT BF16 dispatch, tuned best'),
    tuned_best('combine', 'HT combine, tuned best'),
    ('test_low_latency', r'\[rank 0\] Dispatch \+ combine bandwidth:.*?avg_t=' + NUMBER + r' us, min_t=' + NUMBER,
     ('LL dispatch + combine, plain, avg', 'us'), ('LL dispatch + combine, plain, min', 'us')),
    ('test_low_latency', r'\[rank 0\] Dispatch bandwidth:.*?avg_t=' + NUMBER + r' us \| Combine bandwidth:.*?avg_t='
     + NUMBER, ('LL dispatch, kineto', 'us'), ('LL combine, kineto', 'us')),
    ('test_low_latency', r'\[rank 0\] Dispatch send/recv time: ' + NUMBER + r' \+ ' + NUMBER
     + r' us \| Combine send/recv time: ' + NUMBER + r' \+ ' + NUMBER,
     ('LL dispatch hook send', 'us'), ('LL dispatch hook recv', 'us'), ('LL combine hook send', 'us'),
     ('LL combine hook recv', 'us')),
)


def deepep_test_rows(directory):
    """{(test, metric, unit): {package: value}} from the first match of each line in each test's log."""
    table = {}
    for package, prefix in ((OURS, 'ours'), (V1, 'v1')):
        logs = {}
        for test, pattern, *fields in DEEPEP_TEST_LINES:
            if test not in logs:
                logs[test] = read_text(os.path.join(directory, f'{prefix}_{test}.log'))
            found = re.search(pattern, logs[test])
            for (metric, unit), value in zip(fields, found.groups() if found else ()):
                table.setdefault((test, metric, unit), {})[package] = float(value)
    return table


def eager_rows(directory):
    """{(part, metric): {package: us}}: rank averages of eager_profile's summaries."""
    table = {}
    for package in (OURS, V1):
        for part, ranks in (load(directory, 'eager_profile', package) or {}).get('parts', {}).items():
            for metric in ('wall_us', 'host_span_us', 'gpu_busy_us', 'gpu_idle_us'):
                table.setdefault((part, metric), {})[package] = mean([r[metric] for r in ranks])
            table.setdefault((part, 'GPU idle gaps'), {})[package] = mean([len(r['gaps']) for r in ranks])
            for i, call in enumerate(ranks[0]['calls']):
                table.setdefault((part, f'host us: {call["name"]}'), {})[package] = \
                    mean([r['calls'][i]['host_us'] for r in ranks])
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('dir')
    parser.add_argument('--json', default=None)
    args = parser.parse_args()
    out = {}

    steps_path = os.path.join(args.dir, 'steps.tsv')
    if os.path.isfile(steps_path):
        with open(steps_path) as f:
            steps = [line.rstrip('\n').split('\t') for line in f if line.strip()]
        print('| step | seconds | status |\n| --- | --- | --- |')
        for name, seconds, status in steps:
            print(f'| {name} | {seconds} | {status} |')
        out['steps'] = steps

    tests = deepep_test_rows(args.dir)
    if tests:
        print("\nDeepEP's own tests (tests/test_intranode.py: 24 SMs, tuned best; tests/test_low_latency.py: rank 0)")
        print('| test | metric | unit | ours | DeepEP V1 | ours/V1 |\n| --- | --- | --- | --- | --- | --- |')
        out['deepep_tests'] = []
        for (test, metric, unit), by in tests.items():
            print(f'| {test} | {metric} | {unit} | {cell(by.get(OURS))} | {cell(by.get(V1))} | '
                  f'{ratio(by.get(OURS), by.get(V1))} |')
            out['deepep_tests'].append({'test': test, 'metric': metric, 'unit': unit, **by})

    host = host_rows(args.dir)
    if host:
        print('\nHost time per call, us (best round of both placements, rank average; bench_normal.py: 24 SMs, N back-to-back calls, '
              'launch time; bench_ll_host.py: 200 calls a round). "ours/V1" takes our compiled path where it ran.')
        print('| op | T | defaults | ours compiled | ours ctypes | DeepEP V1 | ours/V1 |\n| --- | --- | --- | --- | --- | --- | --- |')
        out['host'] = []
        for (op, T, mode), cols in host.items():
            ours = cols.get('compiled', cols.get('ctypes'))
            print(f'| {op} | {T} | {mode} | {cell(cols.get("compiled"))} | {cell(cols.get("ctypes"))} | '
                  f'{cell(cols.get(V1))} | {ratio(ours, cols.get(V1))} |')
            out['host'].append({'op': op, 'num_tokens': T, 'defaults': mode, **cols})

    gpu = gpu_rows(args.dir)
    if gpu:
        print('\nNormal mode, us per call (bench_normal.py, rank average, better of both placements where it ran twice): '
              'e2e = DeepEP\'s bench (CUDA events), kern = sum of the kernels (kineto); chunk = the best NVL chunk of its sweep')
        print('| op | dtype | SMs | T | ours e2e | V1 e2e | ours/V1 | ours kern | V1 kern | chunk ours / V1 |\n'
              '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |')
        out['gpu'] = []
        for (op, dtype, sms, T), by in sorted(gpu.items(), key=lambda kv: (kv[0][3], kv[0][0], kv[0][1])):
            o, v = by.get(OURS, {}), by.get(V1, {})
            print(f'| {op} | {dtype} | {sms} | {T} | {cell(o.get("e2e_us"))} | {cell(v.get("e2e_us"))} | '
                  f'{ratio(o.get("e2e_us"), v.get("e2e_us"))} | {cell(o.get("kernel_us"))} | '
                  f'{cell(v.get("kernel_us"))} | {o.get("nvl_chunk", "-")} / {v.get("nvl_chunk", "-")} |')
            out['gpu'].append({'op': op, 'dtype': dtype, 'num_sms': sms, 'num_tokens': T,
                               **by})

    eager = eager_rows(args.dir)
    if eager:
        print('\nEager step (eager_profile.py, one plain step after warm-up, rank average, us; wall = first call '
              'start -> last GPU activity end)')
        print('| part | metric | ours | DeepEP V1 | ours/V1 |\n| --- | --- | --- | --- | --- |')
        out['eager'] = []
        for (part, metric), by in eager.items():
            print(f'| {part} | {metric} | {cell(by.get(OURS))} | {cell(by.get(V1))} | {ratio(by.get(OURS), by.get(V1))} |')
            out['eager'].append({'part': part, 'metric': metric, **by})

    if args.json:
        with open(args.json, 'w') as f:
            json.dump(out, f, indent=1)


if __name__ == '__main__':
    main()

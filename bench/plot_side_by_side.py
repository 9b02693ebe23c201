"""Plots side_by_side.sh's side_by_side.json: ours beside DeepEP V1 from the same run, panels:
DeepEP's own tests (test_intranode's tuned GB/s, test_low_latency's us), host time per call
(compiled path, plain, T=128), normal-mode e2e and kernel time at T=128 and T=4096 (24 SMs), and
the eager step (wall, host span). Bars missing from the JSON (a step that did not run) are left out.

Usage: python bench/plot_side_by_side.py side_by_side.json out.png   (needs only matplotlib)
"""
import json
import sys

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

OURS, V1 = 'deepep-nccl', 'deepep_v1'
COLORS = {OURS: 'C0', V1: 'C7'}
HOST_TOKENS = 128


def bars(ax, labels, ours, v1, title, unit):
    xs = range(len(labels))
    width = 0.4
    ax.bar([x - width / 2 for x in xs], ours, width, color=COLORS[OURS], label='deepep-nccl')
    ax.bar([x + width / 2 for x in xs], v1, width, color=COLORS[V1], label='DeepEP V1')
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=35, ha='right', fontsize=7)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis='y', alpha=0.3)


def host_rows(data):
    rows = [r for r in data.get('host', []) if r.get('num_tokens') == HOST_TOKENS and r.get('defaults') == 'plain'
            and r.get('compiled') is not None and r.get('deepep_v1') is not None and 'yardstick' not in r['op']]
    return [r['op'].replace('normal ', '') for r in rows], [r['compiled'] for r in rows], [r['deepep_v1'] for r in rows]


def gpu_rows(data, key):
    rows = [r for r in data.get('gpu', []) if OURS in r and V1 in r]
    labels = [f"{r['op']} {r['dtype']} T={r['num_tokens']}" for r in rows]
    return labels, [r[OURS][key] for r in rows], [r[V1][key] for r in rows]


def deepep_test_rows(data, test, unit):
    rows = [r for r in data.get('deepep_tests', []) if r['test'] == test and r['unit'] == unit and OURS in r and V1 in r]
    return [r['metric'] for r in rows], [r[OURS] for r in rows], [r[V1] for r in rows]


def main(path, out):
    with open(path) as f:
        data = json.load(f)
    panels = [("DeepEP's test_intranode.py, 24 SMs (higher is better)", 'GB/s',
               deepep_test_rows(data, 'test_intranode', 'GB/s')),
              ("DeepEP's test_low_latency.py, rank 0", 'us', deepep_test_rows(data, 'test_low_latency', 'us')),
              ('host time per call, compiled path, plain, T=128', 'us', host_rows(data)),
              ('normal mode at 24 SMs, end to end', 'us', gpu_rows(data, 'e2e_us')),
              ('normal mode at 24 SMs, kernels', 'us', gpu_rows(data, 'kernel_us'))]
    eager = [r for r in data.get('eager', []) if r.get('metric') in ('wall_us', 'host_span_us')]
    if eager:
        panels.append(('eager step (one plain dispatch + combine)', 'us',
                       ([f"{r['part']} {r['metric']}" for r in eager], [r[OURS] for r in eager],
                        [r[V1] for r in eager])))
    panels = [p for p in panels if p[2][0]]
    if not panels:
        sys.exit(f'{path}: no rows with both packages')
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.5 * rows), squeeze=False)
    for ax, (title, unit, (labels, ours, v1)) in zip(axes.flat, panels):
        bars(ax, labels, ours, v1, title, unit)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == '__main__':
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])

"""Plots bench_internode.py's JSON: GB/s vs SMs (DeepEP's counting: received bytes / time) of
internode dispatch and combine (solid) beside the intranode op of the same ranks (dashed), one
panel per world size (2 nodes of world / 2), with the goal of issue "Internode normal mode"
(internode >= 0.8x intranode) as a dotted line.

Usage: python bench/plot_internode.py results.json out.png   (needs only matplotlib)
"""
import json
import sys

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

GOAL = 0.8
OPS = (('dispatch', 'C0'), ('combine', 'C2'))


def panel(ax, run, shape):
    rows = sorted(run['results'], key=lambda r: r['num_sms'])
    sms = [r['num_sms'] for r in rows]
    for op, color in OPS:
        inter = [r['internode'][f'{op}_gbps'] for r in rows]
        intra = [r['intranode'][f'{op}_gbps'] for r in rows]
        ax.plot(sms, inter, 'o-', color=color, label=f'internode {op}')
        ax.plot(sms, intra, 's--', color=color, alpha=0.6, label=f'intranode {op}')
        ax.plot(sms, [GOAL * v for v in intra], ':', color=color, alpha=0.6, label=f'{GOAL}x intranode {op}')
    tokens = rows[0]['num_tokens'] if rows else 0
    ax.set_title(f"{run['world']} ranks as {run['nodes']} nodes of {run['node_size']}: T={tokens}, "
                 f"H={shape['hidden']}, top-{shape['topk']} of {shape['experts']}")
    ax.set_xlabel('SMs')
    ax.set_ylabel('GB/s (received bytes / time)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def main(path, out):
    with open(path) as f:
        data = json.load(f)
    runs = data['runs']
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, run in zip(axes[0], runs):
        panel(ax, run, data['shape'])
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == '__main__':
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])

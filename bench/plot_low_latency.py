"""Plots bench_low_latency.py's JSON: latency vs tokens per rank (log x, log y) for our LL dispatch
and combine kernels (kineto; hook-mode send+recv dotted), dispatch + combine end to end (CUDA-graph
replay solid, plain calls dashed) and the NCCL all-to-all dispatcher of the same run, with the
reference figures of baselines.md at 128 tokens/rank (DeepEP V1, DeepEP V2 kernel + follow-up
kernel, NCCL EP) and the goal lines.

Usage: python bench/plot_low_latency.py results.json out.png   (needs only matplotlib; run it
offline on the JSON the GPU machine wrote)
"""
import json
import sys

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

# Used when the JSON has no 'reference' (same figures as bench_low_latency.REFERENCE).
DEFAULT_REFERENCE = {
    'num_tokens': 128,
    'deepep_v1': {'dispatch_us': 32, 'combine_us': 57, 'e2e_us': 94.8},
    'deepep_v2': {'dispatch_us': [21.2, 3.5], 'combine_us': [25.8, 6.5]},
    'nccl_ep': {'dispatch_us': 37, 'combine_us': 61},
    'goal': {'dispatch_us': 18, 'combine_us': 24, 'e2e_us': 50},
}
COLORS = {'dispatch': 'C0', 'combine': 'C1', 'e2e': 'C2'}
SERIES = (  # (row op, label, color, style)
    ('dispatch', 'dispatch kernel (kineto)', COLORS['dispatch'], 'o-'),
    ('combine', 'combine kernel (kineto)', COLORS['combine'], 'o-'),
    ('dispatch_hook', 'dispatch send+recv, hook mode', COLORS['dispatch'], '.:'),
    ('combine_hook', 'combine send+recv, hook mode', COLORS['combine'], '.:'),
    ('graph_e2e', 'dispatch+combine, CUDA-graph replay (events)', COLORS['e2e'], 's-'),
    ('e2e', 'dispatch+combine, plain calls (events)', COLORS['e2e'], 's--'),
    ('a2a_dispatch', 'NCCL a2a dispatch, BF16 (this run, events)', 'dimgray', 'x--'),
    ('a2a_combine', 'NCCL a2a combine, BF16 (this run, events)', 'saddlebrown', 'x--'),
)


def total(v):
    return sum(v) if isinstance(v, (list, tuple)) else v


def main():
    if len(sys.argv) != 3:
        sys.exit('usage: python bench/plot_low_latency.py results.json out.png')
    with open(sys.argv[1]) as f:
        data = json.load(f)
    points = sorted(data.get('points', []), key=lambda p: p['num_tokens'])
    ref = data.get('reference') or DEFAULT_REFERENCE
    tokens = [p['num_tokens'] for p in points]

    fig, ax = plt.subplots(figsize=(11, 7))
    for op, label, color, style in SERIES:
        pts = [(p['num_tokens'], p['rows'][op]) for p in points if op in p.get('rows', {})]
        if not pts:
            continue
        xs = [t for t, _ in pts]
        ys = [r['us'] for _, r in pts]
        lo = [r['us'] - r['us_min'] for _, r in pts]
        hi = [r['us_max'] - r['us'] for _, r in pts]
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, color=color, label=label, markersize=5, capsize=2,
                    linewidth=1.2 if ':' in style else 1.6, alpha=0.7 if ':' in style else 1.0)

    # Reference markers at the reference T, spread apart along x.
    t_ref = ref.get('num_tokens', 128)
    kw = dict(linestyle='none', markeredgecolor='black', zorder=5)
    v1, v2, ep = ref.get('deepep_v1', {}), ref.get('deepep_v2', {}), ref.get('nccl_ep', {})
    for key, color in (('dispatch_us', COLORS['dispatch']), ('combine_us', COLORS['combine']), ('e2e_us', COLORS['e2e'])):
        if key in v1:
            ax.plot([t_ref / 1.1], [v1[key]], marker='*', markersize=15, color=color, **kw)
    for key, color, shift in (('dispatch_us', COLORS['dispatch'], 1.07), ('combine_us', COLORS['combine'], 1.15)):
        v = v2.get(key)
        if v is not None:
            x = t_ref * shift
            if isinstance(v, (list, tuple)):  # main kernel, then with its follow-up kernel
                ax.plot([x, x], [v[0], total(v)], color=color, linewidth=2, zorder=4)
                ax.plot([x], [v[0]], marker='_', markersize=12, markeredgewidth=2, color=color, zorder=5)
            ax.plot([x], [total(v)], marker='P', markersize=10, color=color, **kw)
        if key in ep:
            ax.plot([t_ref * 1.24], [ep[key]], marker='D', markersize=7, color=color, **kw)

    goal = ref.get('goal', {})
    for key, name in (('dispatch_us', 'dispatch'), ('combine_us', 'combine'), ('e2e_us', 'e2e')):
        if key in goal:
            ax.axhline(goal[key], color=COLORS[name], linestyle=(0, (1, 3)), linewidth=1.2,
                       label=f'goal: {name} {goal[key]:g} us')

    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    if tokens:
        ticks = sorted(set(tokens) | {t_ref})
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
    lo, hi = ax.get_ylim()
    yticks = [t for t in (1, 2, 5, 10, 20, 30, 50, 100, 200, 300, 500, 1000, 2000, 5000, 10000) if lo <= t <= hi]
    ax.set_yticks(yticks)
    ax.set_yticklabels([str(t) for t in yticks])
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel('tokens per rank')
    ax.set_ylabel('us (rank average; bars: min-max over ranks)')
    ax.grid(True, which='both', alpha=0.3)

    extra = [Line2D([], [], marker='*', markersize=13, color='white', markerfacecolor='lightgray', markeredgecolor='black',
                    linestyle='none', label='DeepEP V1 (kineto; e2e: events), 288 experts'),
             Line2D([], [], marker='P', markersize=9, color='white', markerfacecolor='lightgray', markeredgecolor='black',
                    linestyle='none', label='DeepEP V2 kernel + follow-up kernel (bar from kernel alone), 256 experts'),
             Line2D([], [], marker='D', markersize=7, color='white', markerfacecolor='lightgray', markeredgecolor='black',
                    linestyle='none', label='NCCL EP LL kernel, BF16 dispatch, 256 experts')]
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i].startswith('goal'))  # goal lines last
    handles, labels = [handles[i] for i in order], [labels[i] for i in order]
    fig.legend(handles + extra, labels + [h.get_label() for h in extra], loc='lower center', ncol=2, fontsize=8,
               frameon=False)
    m, shape, settings = data.get('machine', {}), data.get('shape', {}), data.get('settings', {})
    fig.suptitle(f'deepep-nccl low-latency mode: {m.get("world_size", "?")}x {m.get("gpu", "?")} '
                 f'({m.get("num_sms", "?")} SMs), torch {m.get("torch", "?")}, NCCL {m.get("nccl_torch", "?")}\n'
                 f'hidden {shape.get("hidden", "?")}, top-{shape.get("num_topk", "?")} of {shape.get("num_experts", "?")} '
                 f'experts, FP8 dispatch, BF16 combine; M = {settings.get("m_rule", "?")}\n'
                 f'blue: dispatch, orange: combine, green: end to end; markers at {t_ref} tokens/rank: '
                 f'shared/reference/baselines.md (same machine type, other runs)', fontsize=9)
    fig.tight_layout(rect=(0, 0.17, 1, 0.93))
    fig.savefig(sys.argv[2], dpi=130)
    print(f'wrote {sys.argv[2]}')


if __name__ == '__main__':
    main()

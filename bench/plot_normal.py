"""Plots bench_normal.py's JSON: GB/s vs SMs at 4096 tokens/rank, and GB/s vs tokens/rank at
24 SMs, for BF16 dispatch, FP8 dispatch and combine (kernel: solid, end to end: dashed), with
the NCCL all-to-all dispatcher of the same run and the reference figures of baselines.md.

Usage: python bench/plot_normal.py results.json out.png   (needs only matplotlib)
"""
import json
import sys

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

SERIES = (('dispatch', 'bf16', 'BF16 dispatch', 'C0'),
          ('dispatch', 'fp8', 'FP8 dispatch', 'C1'),
          ('combine', 'bf16', 'combine', 'C2'))
NONCACHED = (('dispatch_noncached', 'bf16', 'BF16 dispatch, non-cached', 'C0'),
             ('dispatch_noncached', 'fp8', 'FP8 dispatch, non-cached', 'C1'))
A2A = (('nccl_a2a_dispatch', 'NCCL a2a dispatch (this run)', 'dimgray'),
       ('nccl_a2a_combine', 'NCCL a2a combine (this run)', 'saddlebrown'))
REF_T, REF_SMS = 4096, 24


def points(rows, op, dtype, x, fixed_key, fixed_value, key):
    pts = sorted((r[x], r.get(key)) for r in rows
                 if r['op'] == op and r['dtype'] == dtype and r[fixed_key] == fixed_value and r.get(key))
    return [p[0] for p in pts], [p[1] for p in pts]


def ours(ax, rows, x, fixed_key, fixed_value):
    for op, dtype, label, color in SERIES:
        for key, style, what in (('kernel_gbps', 'o-', 'kernel'), ('e2e_gbps', 's--', 'e2e')):
            xs, ys = points(rows, op, dtype, x, fixed_key, fixed_value, key)
            if xs:
                ax.plot(xs, ys, style, color=color, label=f'{label}, {what}', markersize=5)
    for op, dtype, label, color in NONCACHED:
        xs, ys = points(rows, op, dtype, x, fixed_key, fixed_value, 'e2e_gbps')
        if xs:
            ax.plot(xs, ys, 'v:', color=color, alpha=0.6, label=f'{label}, e2e', markersize=4)


def references(ax, ref, x_v1_v2, x_nccl_ep, show_deepep, shift):
    """DeepEP V1 (*, e2e), V2 (P kernel, X with follow-up kernel) at 24 SMs and NCCL EP (D, kernel
    range) at 16 SMs, all at 4096 tokens/rank, colored by op; shift(x, k) spreads markers that
    share an x apart (k = -1, 0, 1)."""
    v1, v2, ep = ref.get('deepep_v1'), ref.get('deepep_v2'), ref.get('nccl_ep')
    kw = dict(markeredgecolor='black', linestyle='none', zorder=5)
    if show_deepep and v1:
        for key, color in (('dispatch_bf16', 'C0'), ('dispatch_fp8', 'C1'), ('combine_bf16', 'C2')):
            ax.plot([shift(x_v1_v2, -1)], [v1[key]['gbps']], marker='*', markersize=14, color=color, **kw)
    if show_deepep and v2:
        for key, color in (('dispatch_fp8', 'C1'), ('combine_bf16', 'C2')):
            ax.plot([shift(x_v1_v2, 0)], [v2[key]['kernel_gbps']], marker='P', markersize=10, color=color, **kw)
            ax.plot([shift(x_v1_v2, 0)], [v2[key]['with_followup_gbps']], marker='X', markersize=10, color=color, **kw)
    if x_nccl_ep is not None and ep:
        for key, color in (('dispatch_bf16', 'C0'), ('combine_bf16', 'C2')):
            lo, hi = ep[key]['kernel_gbps']
            ax.errorbar([shift(x_nccl_ep, 1 if x_nccl_ep == x_v1_v2 else 0)], [(lo + hi) / 2], yerr=[[(hi - lo) / 2], [(hi - lo) / 2]], marker='D',
                        markersize=7, color=color, capsize=3, **kw)
    if ref.get('logical_ceiling_gbps'):
        ax.axhline(ref['logical_ceiling_gbps'], color='black', linestyle=':', linewidth=0.8,
                   label=f'logical NVLink ceiling (~{ref["logical_ceiling_gbps"]} GB/s)')


def reference_legend_handles():
    kw = dict(color='white', markeredgecolor='black', markerfacecolor='lightgray', linestyle='none')
    return [Line2D([], [], marker='*', markersize=13, label='DeepEP V1, 24 SMs, e2e (baselines.md)', **kw),
            Line2D([], [], marker='P', markersize=9, label='DeepEP V2, 24 SMs, kernel', **kw),
            Line2D([], [], marker='X', markersize=9, label='DeepEP V2, 24 SMs, with follow-up kernel', **kw),
            Line2D([], [], marker='D', markersize=7, label='NCCL EP, 16 SMs, kernel (range)', **kw)]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    with open(sys.argv[1]) as f:
        data = json.load(f)
    rows, base, ref = data.get('rows', []), data.get('baseline_rows', []), data.get('reference', {})
    tokens = sorted({r['num_tokens'] for r in rows} | {r['num_tokens'] for r in base})
    sms = sorted({r['num_sms'] for r in rows})
    t_fix = REF_T if REF_T in tokens or not tokens else max(tokens)
    s_fix = REF_SMS if REF_SMS in sms or not sms else max(sms)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6.5))

    # Panel 1: GB/s vs SMs at t_fix tokens/rank; the all-to-all uses no SM setting: lines across.
    ours(ax1, rows, 'num_sms', 'num_tokens', t_fix)
    for op, label, color in A2A:
        r = next((b for b in base if b['op'] == op and b['num_tokens'] == t_fix), None)
        if r is not None:
            ax1.axhline(r['e2e_gbps'], color=color, linestyle='--', linewidth=1, label=f'{label}, e2e')
            if r.get('kernel_gbps'):
                ax1.axhline(r['kernel_gbps'], color=color, linestyle='-', linewidth=1, label=f'{label}, kernel')
    references(ax1, ref, REF_SMS, 16, show_deepep=t_fix == REF_T, shift=lambda x, k: x + 0.5 * k)
    ax1.set_xlabel('SMs (Config.num_sms)')
    if sms:
        ax1.set_xticks(sorted(set(sms) | {16, 24}))
    ax1.set_title(f'GB/s vs SMs, {t_fix} tokens/rank')

    # Panel 2: GB/s vs tokens/rank at s_fix SMs.
    ours(ax2, rows, 'num_tokens', 'num_sms', s_fix)
    for op, label, color in A2A:
        pts = sorted((b['num_tokens'], b['e2e_gbps'], b.get('kernel_gbps')) for b in base if b['op'] == op)
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], 'x--', color=color, label=f'{label}, e2e')
            kern = [p for p in pts if p[2]]
            if kern:
                ax2.plot([p[0] for p in kern], [p[2] for p in kern], 'x-', color=color, label=f'{label}, kernel')
    references(ax2, ref, REF_T, REF_T, show_deepep=s_fix == REF_SMS, shift=lambda x, k: x * 1.08 ** k)
    ax2.set_xscale('log', base=2)
    if tokens:
        ax2.set_xticks(tokens)
        ax2.set_xticklabels([str(t) for t in tokens])
    ax2.set_xlabel('tokens per rank')
    ax2.set_title(f'GB/s vs tokens/rank, {s_fix} SMs (NCCL EP reference: 16 SMs)')

    for ax in (ax1, ax2):
        ax.set_ylabel('GB/s (received bytes / time, DeepEP counting)')
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)

    handles, labels = {}, []
    for ax in (ax1, ax2):
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    extra = reference_legend_handles()
    fig.legend([handles[lab] for lab in labels] + extra, labels + [h.get_label() for h in extra],
               loc='lower center', ncol=4, fontsize=8, frameon=False)
    m = data.get('machine', {})
    fig.suptitle(f'deepep-nccl normal mode: {m.get("world_size", "?")}x {m.get("gpu", "?")}, torch {m.get("torch", "?")}, '
                 f'NCCL {m.get("nccl_torch", "?")}; hidden {data.get("shape", {}).get("hidden", 7168)}, '
                 f'top-{data.get("shape", {}).get("num_topk", 8)} of {data.get("shape", {}).get("num_experts", 256)} '
                 f'experts. Reference markers: baselines.md (other runs, 4096 tokens/rank)', fontsize=10)
    fig.tight_layout(rect=(0, 0.2, 1, 0.95))
    fig.savefig(sys.argv[2], dpi=130)
    print(f'wrote {sys.argv[2]}')


if __name__ == '__main__':
    main()

#!/usr/bin/env python3
"""The micro-batch-order step of scripts/gpu-check, judged: the same
`strata finetune` run step-major and layer-major (strata.micro_batch_order)
must give the same parameters bit for bit, and layer-major should read less.

    compare_orders.py STEP_MAJOR_OUT LAYER_MAJOR_OUT

Each OUT is a run's --out folder (metrics.jsonl: one JSON object per step) with
its --export beside it as OUT-model. Prints one line — the figure gpu-check
reports: each order's median tokens/s and step time over the steps after the
first, their ratio, and whether the per-step losses and gradient
norms and the exported safetensors files are identical. Exits 1 when they are
not.
"""
import filecmp
import json
import os
import statistics
import sys


def run(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    timed = rows[1:] if len(rows) > 1 else rows
    return (statistics.median(r["tokens_per_s"] for r in timed), statistics.median(r["step_s"] for r in timed),
            [(r["loss"], r["grad_norm"]) for r in rows])


def main():
    step_major, layer_major = sys.argv[1], sys.argv[2]
    sm_rate, sm_step, sm_curve = run(step_major)
    lm_rate, lm_step, lm_curve = run(layer_major)
    files = sorted(f for f in os.listdir(step_major + "-model") if f.endswith(".safetensors"))
    exports_same = bool(files) and all(
        os.path.exists(os.path.join(layer_major + "-model", f)) and
        filecmp.cmp(os.path.join(step_major + "-model", f), os.path.join(layer_major + "-model", f), shallow=False)
        for f in files)
    curves_same = sm_curve == lm_curve
    print(f"step-major {sm_rate:.0f}, layer-major {lm_rate:.0f} tokens/s = {lm_rate / sm_rate:.2f}x; "
          f"{sm_step:.2f} vs {lm_step:.2f} s/step; {len(sm_curve)} steps' losses and gradient norms "
          f"{'identical' if curves_same else 'DIFFER'}; exports {'identical' if exports_same else 'DIFFER'}")
    return 0 if curves_same and exports_same else 1


if __name__ == "__main__":
    sys.exit(main())

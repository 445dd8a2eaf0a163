#!/usr/bin/env python3
"""Per-step busy time of each thread of a strata trace, and the NVMe bytes it moved.

    python3 bench/strata-train/trace_per_step.py TRACE.rank0.json

For every "zero step" and "resident step" span of a strata-train --trace,
or "step" span of a strata finetune --trace (rank 0's file; the first
finetune step, which records the operator trace, is left out), sums each
track's spans inside it (clipped to the step), and prints the medians over
the steps: the step, the compute stream's ops, each track's total (the
training loop's too: its waits, "join the update" among them) and its
largest span kinds, then the NVMe bytes of the I/O requests started in the
step by what they moved (optimizer state, gradient, parameters). Standard
library only. bench/PERFORMANCE.md's "default model's ZeRO-3 NVMe step
against its bound" table and the trace figures of "The update overlapping
the next forward" are this script's output.
"""
import collections
import json
import statistics
import sys

OPS = {"linear_forward", "linear_backward", "cross_entropy", "attention_forward", "attention_backward",
       "rmsnorm_forward", "rmsnorm_backward", "rope_forward", "rope_backward", "swiglu_forward",
       "swiglu_backward", "add", "embedding_forward", "embedding_backward", "count_targets"}


def main():
    trace = json.load(open(sys.argv[1]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    tracks = collections.defaultdict(list)
    for e in spans:
        tracks[names.get((e["pid"], e["tid"]), str(e["tid"]))].append(e)

    def busy(track, lo, hi, kinds=None):
        total, by_kind = 0.0, collections.Counter()
        for e in tracks[track]:
            if kinds is not None and e["name"] not in kinds:
                continue
            a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
            if b > a:
                total += b - a
                by_kind[e["name"]] += b - a
        return total / 1e3, by_kind

    for step in ("zero step", "resident step", "step"):
        windows = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == step and e.get("cat") == "phase"]
        if step == "step":
            windows = windows[1:]  # finetune's first step records the operator trace
        if not windows:
            continue
        print(f"{step}: {len(windows)} steps, median ms per step")
        print(f"  the step {statistics.median((hi - lo) / 1e3 for lo, hi in windows):.1f}")
        print(f"  compute-stream ops {statistics.median(busy('compute stream', lo, hi, OPS)[0] for lo, hi in windows):.1f}")
        for track in sorted(tracks):
            per_step = [busy(track, lo, hi) for lo, hi in windows]
            median = statistics.median(t for t, _ in per_step)
            if median <= 0:
                continue
            kinds = collections.Counter()
            for _, k in per_step:
                kinds.update(k)
            top = ", ".join(f"{k} {v / 1e3 / len(windows):.1f}" for k, v in kinds.most_common(4))
            print(f"  {track}: {median:.1f} ({top})")
        moved = [io_bytes(spans, lo, hi) for lo, hi in windows]
        for kind in sorted({k for m in moved for k in m}):
            print(f"  NVMe {kind}: {statistics.median(m.get(kind, 0) for m in moved) / 1e6:.1f} MB")


def io_bytes(spans, lo, hi):
    """Bytes of the I/O requests started in [lo, hi), by what their file holds and direction."""
    moved = collections.Counter()
    for e in spans:
        if e.get("cat") != "io" or not lo <= e["ts"] < hi:
            continue
        f = e.get("args", {}).get("file", "")
        what = "optimizer state" if "/optimizer_" in f else "gradient" if "/grad/" in f else \
            "parameters" if "/param/" in f else "other"
        moved[f"{what} {e['name']}"] += e.get("args", {}).get("bytes", 0)
    return moved


if __name__ == "__main__":
    main()

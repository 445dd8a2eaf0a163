#!/usr/bin/env python3
"""Per-step busy time of each thread of a strata trace, and the NVMe bytes it moved.

    python3 bench/strata-train/trace_per_step.py TRACE.rank0.json
    python3 bench/strata-train/trace_per_step.py TRACE.rank0.json --within NAME [--index N] [--min-ms T]

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

With --within, instead: every span of at least T ms (default 1) starting
inside the N-th span named NAME (default the third, 0-based 2: a step past
the first), in time order, as its start (ms from NAME's), duration, track,
name and what it names (sub-group, operator, bytes, file); then each I/O
worker's busy time inside that span and the NVMe bytes of the requests
started in it, by what they moved. The figures of "The update behind the
next forward, waiting less on the drive" and "The embedding's update and
the gathers off the drive" come from `--within "update overlapping the next
forward"` and `--within "optimizer step"`.
"""
import collections
import json
import statistics
import sys

OPS = {"linear_forward", "linear_backward", "cross_entropy", "attention_forward", "attention_backward",
       "rmsnorm_forward", "rmsnorm_backward", "rope_forward", "rope_backward", "swiglu_forward",
       "swiglu_backward", "add", "embedding_forward", "embedding_backward", "count_targets"}


def main():
    args = sys.argv[1:]
    trace = json.load(open(args[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    tracks = collections.defaultdict(list)
    for e in spans:
        tracks[names.get((e["pid"], e["tid"]), str(e["tid"]))].append(e)
    if "--within" in args:
        option = lambda flag, default: type(default)(args[args.index(flag) + 1]) if flag in args else default
        within(spans, names, tracks, args[args.index("--within") + 1], option("--index", 2), option("--min-ms", 1.0))
        return

    def busy(track, lo, hi, kinds=None):
        return track_busy(tracks, track, lo, hi, kinds)

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


def track_busy(tracks, track, lo, hi, kinds=None):
    """ms of track's spans (of kinds, if given) inside [lo, hi), in all and by span name (us)."""
    total, by_kind = 0.0, collections.Counter()
    for e in tracks[track]:
        if kinds is not None and e["name"] not in kinds:
            continue
        a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if b > a:
            total += b - a
            by_kind[e["name"]] += b - a
    return total / 1e3, by_kind


def within(spans, names, tracks, name, index, min_ms):
    """The spans of at least min_ms starting inside the index-th span called name,
    then the I/O workers' busy time inside it and the NVMe bytes of the requests started in it."""
    outer = sorted((e for e in spans if e["name"] == name), key=lambda e: e["ts"])
    if index >= len(outer):
        sys.exit(f"{len(outer)} spans named {name!r}, no index {index}")
    o = outer[index]
    print(f"{name} #{index}: {o['dur'] / 1e3:.1f} ms")
    for e in sorted(spans, key=lambda e: e["ts"]):
        if e is o or not o["ts"] <= e["ts"] < o["ts"] + o["dur"] or e["dur"] < min_ms * 1e3:
            continue
        a = e.get("args", {})
        what = " ".join(f"{k}={a[k] if k != 'file' else a[k].rsplit('/', 3)[-3:]}" for k in
                        ("sub_group", "op", "count", "bytes", "file") if k in a)
        print(f"  {(e['ts'] - o['ts']) / 1e3:8.1f} {e['dur'] / 1e3:8.1f}  {names.get((e['pid'], e['tid']), e['tid'])}: "
              f"{e['name']} {what}")
    lo, hi = o["ts"], o["ts"] + o["dur"]
    for track in sorted(t for t in tracks if t.startswith("io worker")):
        total, by_kind = track_busy(tracks, track, lo, hi)
        if total > 0:
            kinds = ", ".join(f"{k} {v / 1e3:.1f}" for k, v in by_kind.most_common())
            print(f"  {track} busy inside it: {total:.1f} ms ({kinds})")
    for kind, nbytes in sorted(io_bytes(spans, lo, hi).items()):
        print(f"  NVMe {kind} started inside it: {nbytes / 1e6:.1f} MB")


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

#!/usr/bin/env python3
"""One `strata finetune` of scripts/gpu-check, judged: its loss curve falls and
its export loads in the machine's own transformers as the same model.

    check_finetune.py METRICS_JSONL EXPORT_DIR TEXT_FILE SEQ

Reads OUT/metrics.jsonl (one JSON object per step: loss, tokens_per_s); the
loss falls when the mean of the last five steps is below 0.8 x the mean of the
first five. Loads EXPORT_DIR with AutoModelForCausalLM (every tensor used, none
missing) and computes its loss on the first SEQ bytes of TEXT_FILE (text is
trained as bytes, vocab 256). Prints one line — the figure gpu-check reports —
and exits 1 when the loss did not fall or the export did not load exactly.
"""
import json
import statistics
import sys


def main():
    metrics, export, text, seq = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
    if len(losses) < 10:
        print(f"only {len(losses)} steps with a loss in {metrics}")
        return 1
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    rates = [r["tokens_per_s"] for r in rows[1:] if isinstance(r.get("tokens_per_s"), (int, float))]
    rate = statistics.median(rates) if rates else float("nan")
    falling = last < 0.8 * first

    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    data = open(text, "rb").read()[:seq]
    ids = torch.tensor(list(data), dtype=torch.long)[None]
    with torch.no_grad():
        export_loss = model(input_ids=ids, labels=ids).loss.item()
    verdict = "falls" if falling else "does NOT fall"
    load = "loads exactly" if not problems else f"does NOT load exactly: {problems}"
    print(f"loss {first:.3f} -> {last:.3f} over {len(losses)} steps ({verdict}); median {rate:.0f} tokens/s; "
          f"export {load} in transformers {__import__('transformers').__version__} (loss {export_loss:.3f})")
    return 0 if falling and not problems else 1


if __name__ == "__main__":
    sys.exit(main())

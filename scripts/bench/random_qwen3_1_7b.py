#!/usr/bin/env python3
"""Writes a randomly initialised model with Qwen3-1.7B's shape (28 layers, hidden 2048, MLP 6144,
16 query and 8 key/value heads of 128, vocabulary 151936, tied embeddings) as a Hugging Face
directory in bf16, with the Qwen3 tokenizer from shared/data: for memory figures at the seeds' size
without the weights (no model hub here). Normal(0, 0.02) weights, norms at 1.

    ~/.cache/cotrain/bench-venv/bin/python scripts/bench/random_qwen3_1_7b.py OUT_DIR
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
    "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    c = CONFIG
    h, m, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    rand = lambda *s: (torch.randn(*s) * 0.02).to(torch.bfloat16)
    t = {"model.embed_tokens.weight": rand(c["vocab_size"], h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rand(q, h)
        t[p + "self_attn.k_proj.weight"] = rand(kv, h)
        t[p + "self_attn.v_proj.weight"] = rand(kv, h)
        t[p + "self_attn.o_proj.weight"] = rand(h, q)
        t[p + "self_attn.q_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        t[p + "self_attn.k_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        t[p + "mlp.gate_proj.weight"] = rand(m, h)
        t[p + "mlp.up_proj.weight"] = rand(m, h)
        t[p + "mlp.down_proj.weight"] = rand(h, m)
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    tok = Path(__file__).resolve().parents[2].parent / "shared/data/tokenizers/qwen3"
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(tok / f, out / f)
    print(f"{out}: {sum(x.numel() for x in t.values()) / 1e9:.3f}B parameters")


if __name__ == "__main__":
    main()

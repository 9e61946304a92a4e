#!/usr/bin/env python3
"""Tiny random Llama / Qwen2 / Qwen3 / Phi-3 checkpoints and their Hugging Face reference outputs.

Writes `model/tests/fixtures/tiny/<name>/` (config.json, model.safetensors or shards,
generation_config.json, reference.json) for the Rust model layer's parity tests. Everything is
seeded, so rerunning reproduces the same files on the same torch/transformers versions.

Transformers 5 writes RoPE settings as `rope_parameters`; checkpoints on the Hub (SmolLM2,
Qwen2.5, Qwen3, Llama 3) still carry `rope_theta` + `rope_scaling` and `torch_dtype`. The
configs are rewritten into that Hub form, then reloaded with transformers and the reference
values are computed from the reloaded model, so the files on disk are what was checked.

Phi-3's fixtures exercise what only it has: q/k/v and gate/up fused in the checkpoint, a sliding
window shorter than the test sequences (`phi3`), and LongRoPE with an attention factor, its short
factors for the two shorter cases and its long factors for the longest (`phi3_longrope`).

Run with the pyref environment (scripts/reference/setup-pyref.sh):
    python scripts/reference/make_tiny_models.py [--out model/tests/fixtures/tiny] [--only NAME ...]
"""

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SCHEMA_VERSION = 1
NEW_TOKENS = 12
SEQ_LENGTHS = (4, 11, 29)
# Input seeds are tried in turn until every greedy step of the f32 model wins by at least this
# much, so that the greedy continuations are not decided by rounding noise.
MIN_GREEDY_MARGIN = 0.02
ROOT = Path(__file__).resolve().parents[2]

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def specs():
    """(name, model class, config, seed) for every f32 fixture."""
    return [
        ("llama", LlamaForCausalLM,
         LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=False), 1),
        ("llama3_rope", LlamaForCausalLM,
         LlamaConfig(**COMMON, rope_theta=10000.0, rope_scaling=dict(LLAMA3_SCALING),
                     tie_word_embeddings=True), 2),
        ("qwen2", Qwen2ForCausalLM,
         Qwen2Config(**COMMON, rope_theta=10000.0, tie_word_embeddings=False,
                     use_sliding_window=False), 3),
        ("qwen2_linear_rope", Qwen2ForCausalLM,
         Qwen2Config(**COMMON, rope_theta=10000.0,
                     rope_scaling={"rope_type": "linear", "factor": 2.0},
                     tie_word_embeddings=False, use_sliding_window=False), 4),
        ("qwen3", Qwen3ForCausalLM,
         Qwen3Config(**COMMON, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True,
                     use_sliding_window=False), 5),
        # Phi-3-mini-4k's shape of config: plain RoPE, a sliding window (8 here, so every case
        # but the shortest prompt is longer than it), pad id inside the tiny vocabulary.
        ("phi3", Phi3ForCausalLM,
         Phi3Config(**COMMON, rope_theta=10000.0, sliding_window=8, pad_token_id=0,
                    tie_word_embeddings=False), 6),
        # Phi-3-mini-128k's: LongRoPE over an "original" context of 24 positions (cases of 4 and
        # 11 prompt tokens plus 12 new stay within it: short factors; the 29-token case does
        # not: long factors), factor 512 / 24 for the attention factor.
        ("phi3_longrope", Phi3ForCausalLM,
         Phi3Config(**COMMON, rope_theta=10000.0, original_max_position_embeddings=24,
                    rope_scaling={"rope_type": "longrope",
                                  "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                                  "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]},
                    pad_token_id=0, tie_word_embeddings=False), 7),
    ]


def init_weights(model, seed):
    """Non-trivial random weights: logits far from flat, biases and norm weights not 0/1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("q_norm.weight") or name.endswith("k_norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or name.startswith("lm_head"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def to_hub_config(path: Path):
    """Rewrite a transformers-5 config.json into the form Hub checkpoints use."""
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    theta = rope.pop("rope_theta")
    cfg["rope_theta"] = theta
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


def sig(x, digits=7):
    """Round a float to `digits` significant digits (below f32 noise, JSON stays small)."""
    if x == 0.0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits - 1}e}")


def rounded(t: torch.Tensor):
    """Nested lists of a float tensor, 7 significant digits."""
    if t.dim() == 0:
        return sig(float(t))
    return [rounded(row) for row in t] if t.dim() > 1 else [sig(float(v)) for v in t]


def input_sequences(seed):
    g = torch.Generator().manual_seed(seed)
    # ids 3.. so that none is bos/eos/pad; the first one starts with bos like a real prompt.
    seqs = [torch.randint(3, COMMON["vocab_size"], (n,), generator=g).tolist() for n in SEQ_LENGTHS]
    seqs[0][0] = COMMON["bos_token_id"]
    return seqs


@torch.no_grad()
def forward_logits(model, ids):
    out = model(torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def hidden_states(model, ids):
    """Embedding output, each decoder layer's output, and the final-norm output (recorded by hooks)."""
    acts = []
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, i, o: acts.append(o))]
    for layer in model.model.layers:
        hooks.append(layer.register_forward_hook(
            lambda m, i, o: acts.append(o[0] if isinstance(o, tuple) else o)))
    hooks.append(model.model.norm.register_forward_hook(lambda m, i, o: acts.append(o)))
    model(torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    return [a[0].float() for a in acts]


@torch.no_grad()
def greedy(model, ids, n):
    """Greedy decoding by full recomputation (no cache, no EOS stop): the ground truth."""
    seq = list(ids)
    margins = []
    for _ in range(n):
        logits = forward_logits(model, seq)[-1]
        top2 = torch.topk(logits, 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        seq.append(int(top2.indices[0]))
    return seq[len(ids):], margins


@torch.no_grad()
def hf_generate(model, ids, n):
    """transformers' own generate (with KV cache) as a cross-check of `greedy`."""
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
        pad_token_id=0, use_cache=True, top_k=None, top_p=None, temperature=None,
    )
    return out[0, len(ids):].tolist()


def config_summary(cfg):
    rp = dict(cfg.rope_parameters)
    return {
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rp.pop("rope_theta"),
        "rope_scaling": None if rp.get("rope_type", "default") == "default" else rp,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }


def pick_input_seed(model, seed):
    """First input seed (1000*seed, 1000*seed+1, ...) whose greedy continuations have clear margins."""
    for input_seed in range(1000 * seed, 1000 * seed + 50):
        if all(min(greedy(model, ids, NEW_TOKENS)[1]) >= MIN_GREEDY_MARGIN
               for ids in input_sequences(input_seed)):
            return input_seed
    raise RuntimeError(f"no input seed with greedy margins >= {MIN_GREEDY_MARGIN}")


def reference(model, family, input_seed, dtype_name, extra=None):
    seqs = input_sequences(input_seed)
    cases = []
    for ids in seqs:
        logits = forward_logits(model, ids)  # (L, V) float32
        logp = torch.log_softmax(logits.double(), dim=-1)
        token_logprobs = logp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
        entropy = -(logp.exp() * logp).sum(-1)
        new_ids, margins = greedy(model, ids, NEW_TOKENS)
        gen_ids = hf_generate(model, ids, NEW_TOKENS)
        if gen_ids != new_ids:
            print(f"  warning: generate() {gen_ids} != recomputed greedy {new_ids}")
        # Logits of the whole greedy sequence at its last position: what a KV-cached decoder
        # should have produced at the final step.
        full = forward_logits(model, ids + new_ids)
        cases.append({
            "input_ids": ids,
            "logits": rounded(logits),
            "token_logprobs": rounded(token_logprobs.float()),
            "entropy": rounded(entropy.float()),
            "logsumexp": rounded(torch.logsumexp(logits.double(), -1).float()),
            "greedy_new_ids": new_ids,
            "greedy_top2_margin": [sig(m) for m in margins],
            "greedy_hf_generate_agrees": gen_ids == new_ids,
            "greedy_sequence_last_logits": rounded(full[-1]),
        })
    hs = hidden_states(model, seqs[0])
    ref = {
        "schema_version": SCHEMA_VERSION,
        "family": family,
        "dtype": dtype_name,
        "config": config_summary(model.config),
        "input_seed": input_seed,
        "new_tokens": NEW_TOKENS,
        "generation": "greedy argmax, no EOS stopping, no cache (cross-checked with generate())",
        "cases": cases,
        "hidden_states_case0": {
            "names": ["embed_tokens"] + [f"layers.{i}" for i in range(model.config.num_hidden_layers)]
                     + ["norm"],
            "values": [rounded(h) for h in hs],
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    if extra:
        ref.update(extra)
    return ref


def save(model, out: Path, **kwargs):
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    to_hub_config(out / "config.json")


def reload(out: Path, dtype):
    m = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    m.eval()
    return m


def write_ref(out: Path, ref):
    (out / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")


def max_diff(a, b):
    return float((a - b).abs().max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "model/tests/fixtures/tiny")
    ap.add_argument("--only", nargs="*", help="write only these fixtures (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)

    for name, cls, cfg, seed in specs():
        if args.only and name not in args.only:
            continue
        cfg.dtype = torch.float32
        model = cls(cfg).eval()
        init_weights(model, seed)
        out = args.out / name
        save(model, out)
        loaded = reload(out, torch.float32)
        input_seed = pick_input_seed(loaded, seed)
        probe = input_sequences(input_seed)[2]
        d = max_diff(forward_logits(model, probe), forward_logits(loaded, probe))
        assert d == 0.0, f"{name}: reloaded model differs by {d}"
        family = cfg.model_type
        write_ref(out, reference(loaded, family, input_seed, "float32"))
        print(f"{name}: ok")

        if name == "qwen2":
            sharded = args.out / "qwen2_sharded"
            save(loaded, sharded, max_shard_size="150KB")
            shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
            assert len(shards) >= 2 and (sharded / "model.safetensors.index.json").exists(), shards
            m2 = reload(sharded, torch.float32)
            d = max_diff(forward_logits(loaded, probe), forward_logits(m2, probe))
            assert d == 0.0, f"qwen2_sharded differs by {d}"
            # Same weights as qwen2, so the same reference values.
            write_ref(sharded, reference(m2, family, input_seed, "float32",
                                         {"same_weights_as": "qwen2", "shards": shards}))
            print(f"qwen2_sharded: ok ({len(shards)} shards)")

        if name == "llama":
            bf = args.out / "llama_bf16"
            save(loaded.to(torch.bfloat16), bf)
            m_bf = reload(bf, torch.bfloat16)
            m_up = reload(bf, torch.float32)  # the same bf16 weights, computed in f32
            seqs = input_sequences(input_seed)
            ref = reference(m_bf, family, input_seed, "bfloat16")
            up_logits = [forward_logits(m_up, ids) for ids in seqs]
            f32_logits = [forward_logits(loaded, ids) for ids in seqs]
            for case, ul in zip(ref["cases"], up_logits):
                case["logits_f32_compute"] = rounded(ul)
            bf_logits = [forward_logits(m_bf, ids) for ids in seqs]
            ref["observed_max_abs_diff"] = {
                "bf16_compute_vs_f32_compute_same_weights":
                    sig(max(max_diff(a, b) for a, b in zip(bf_logits, up_logits)), 3),
                "f32_compute_bf16_weights_vs_f32_weights":
                    sig(max(max_diff(a, b) for a, b in zip(up_logits, f32_logits)), 3),
            }
            ref["note"] = ("weights are llama's rounded to bf16; `logits` computed in bf16 by torch "
                           "CPU kernels, `logits_f32_compute` with the bf16 weights upcast to f32; "
                           "all other per-case values come from the bf16 computation")
            write_ref(bf, ref)
            print(f"llama_bf16: ok {ref['observed_max_abs_diff']}")


if __name__ == "__main__":
    main()

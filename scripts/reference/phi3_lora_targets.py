#!/usr/bin/env python3
"""Which Phi-3 modules PEFT puts LoRA on when given MaPoRL's target list, the reference for
`model/tests/lora.rs::on_phi3_lora_targets_what_peft_targets`.

Phi-3 fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; PEFT matches target names as
module-name suffixes after a dot, so of MaPoRL's seven names only `o_proj` and `down_proj` reach
a module, and a list naming none of them is refused. Observed with peft 0.21.2, transformers 5.24:
    ['down_proj', 'o_proj']
    refused: Target modules {...} not found in the base model.

Run with the pyref environment (scripts/reference/setup-pyref.sh):
    python scripts/reference/phi3_lora_targets.py
"""

from pathlib import Path

import peft
from transformers import AutoModelForCausalLM

TINY = Path(__file__).resolve().parents[2] / "model/tests/fixtures/tiny/phi3"
MAPORL = ["up_proj", "down_proj", "gate_proj", "k_proj", "q_proj", "v_proj", "o_proj"]


def main():
    model = AutoModelForCausalLM.from_pretrained(TINY)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=MAPORL, task_type="CAUSAL_LM")
    adapted = peft.get_peft_model(model, cfg)
    print(sorted({n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in adapted.named_parameters() if "lora_A" in n}))
    try:
        peft.get_peft_model(AutoModelForCausalLM.from_pretrained(TINY), peft.LoraConfig(target_modules=["q_proj", "v_proj"]))
    except ValueError as e:
        print("refused:", e)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Reference chat-template renderings for cotrain's ChatTemplate (model/tests/chat_template.rs).

Renders each case with transformers' `apply_chat_template(..., tokenize=False)` and writes
model/tests/fixtures/chat_templates/reference.json:
  {template: {"source": str, "bos_token": str|null, "eos_token": str|null,
              "cases": [{"name", "messages", "add_generation_prompt", "extra", "expected"}]}}

Templates: SmolLM2-135M-Instruct (from the GGUF at $COTRAIN_DEFAULT_MODEL), Qwen3
(model/tests/fixtures/tokenizers/qwen3), Qwen2.5-Instruct (model/tests/fixtures/chat_templates).

Run with the reference env: ~/.cache/cotrain/pyref/bin/python scripts/reference/chat_templates.py
"""
import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "model/tests/fixtures"

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
USER1 = {"role": "user", "content": "What is 2 + 2?"}
ASSISTANT1 = {"role": "assistant", "content": "2 + 2 = 4."}
USER2 = {"role": "user", "content": "Now write \"hello\" in Python — with a ½ comment.\n\nThanks!"}
THINKING_ASSISTANT = {"role": "assistant", "content": "<think>\nAdd the numbers.\n</think>\n\n2 + 2 = 4."}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city — in °C",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. \"Zürich\""},
                           "days": {"type": "integer", "default": 1}},
            "required": ["city"],
        },
    },
}]

COMMON = [
    ("user_only", [USER1], False, {}),
    ("user_only_gen", [USER1], True, {}),
    ("system_user_gen", [SYSTEM, USER1], True, {}),
    ("system_user", [SYSTEM, USER1], False, {}),
    ("multi_turn_gen", [SYSTEM, USER1, ASSISTANT1, USER2], True, {}),
    ("multi_turn_no_system", [USER1, ASSISTANT1, USER2], True, {}),
    ("ends_with_assistant", [USER1, ASSISTANT1], False, {}),
]

QWEN_EXTRA = [
    ("thinking_off_gen", [USER1], True, {"enable_thinking": False}),
    ("thinking_on_gen", [USER1], True, {"enable_thinking": True}),
    ("thinking_off_system_multi", [SYSTEM, USER1, ASSISTANT1, USER2], True, {"enable_thinking": False}),
    ("thinking_history_stripped", [USER1, THINKING_ASSISTANT, USER2], True, {"enable_thinking": True}),
    ("thinking_last_assistant_kept", [USER1, THINKING_ASSISTANT], False, {}),
    ("tools_gen", [SYSTEM, USER1], True, {"tools": TOOLS}),
]

QWEN25_EXTRA = [
    ("tools_gen", [SYSTEM, USER1], True, {"tools": TOOLS}),
    ("tools_no_system", [USER1], True, {"tools": TOOLS}),
]


def render(tok, cases, chat_template=None):
    out = []
    for name, messages, gen, extra in cases:
        kwargs = dict(extra)
        tools = kwargs.pop("tools", None)
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen,
                                       chat_template=chat_template, **kwargs)
        out.append({"name": name, "messages": messages, "add_generation_prompt": gen,
                    "extra": extra, "expected": text})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=FIX / "chat_templates/reference.json")
    ap.add_argument("--model", type=Path, default=Path(os.environ.get(
        "COTRAIN_DEFAULT_MODEL", Path.home() / ".cache/cotrain/models/SmolLM2-135M-Instruct.Q4_1.gguf")))
    args = ap.parse_args()
    result = {}

    smol = AutoTokenizer.from_pretrained(str(args.model.parent), gguf_file=args.model.name)
    result["smollm2"] = {"source": smol.chat_template, "bos_token": smol.bos_token,
                         "eos_token": smol.eos_token, "cases": render(smol, COMMON)}

    qwen_dir = FIX / "tokenizers/qwen3"
    with tempfile.TemporaryDirectory() as tmp:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(qwen_dir / f, tmp)
        qwen = AutoTokenizer.from_pretrained(tmp)
    result["qwen3"] = {"source": qwen.chat_template, "bos_token": qwen.bos_token,
                       "eos_token": qwen.eos_token, "cases": render(qwen, COMMON + QWEN_EXTRA)}

    q25 = (FIX / "chat_templates/qwen2.5-instruct.jinja").read_text()
    result["qwen2.5"] = {"source": q25, "bos_token": qwen.bos_token, "eos_token": qwen.eos_token,
                         "cases": render(qwen, COMMON + QWEN25_EXTRA, chat_template=q25)}

    args.out.write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

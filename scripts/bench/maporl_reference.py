#!/usr/bin/env python3
"""One MaPoRL step the way MaPoRL's trainer does it (TRL PPOv2 style, transformers + PEFT), timed.

The reference side of `scripts/bench/maporl_step.sh`; the cotrain side is
`learner/examples/maporl_step_bench.rs`. Same model (SmolLM2-135M-Instruct from the GGUF, f32 on
the CPU, 2 threads), same questions (GSM8K train rows), same settings:

- (`--layout shared_by_turn`, MaPoRL's: one such model for all agents; `per_agent`: one per agent)
  the base with a PEFT LoRA model (r 8, alpha 16, dropout 0.05 switched off as TRL
  switches off every dropout, all 7 projections) holding two policy adapters, `turn0` and `later`
  (MaPoRL's collaboration_separation: "policy" for turn 0, "col" for later turns); the reference
  policy is that model with its adapter disabled; a separate value model (its own copy of the base,
  one LoRA adapter per trained turn, each with a frozen random bias-free linear value head on the
  last hidden state, as MaPoRL's value_t adapters and heads);
- turn 0: per agent one `generate` over the batch of questions (left padding), do_sample, temperature
  0.7, top_k 0, top_p 1, EOS disabled in the generation config (as MaPoRL does), so exactly
  max_output_length new tokens, with the generation scores kept; responses cut after the first EOS;
  turn 1: the discussion prompt (own history + the other agent's turn-0 answer and its score, chat
  template), generate again with the `later` adapter;
- scoring: last \\boxed{} integer against GSM8K's answer; invalid (too short or no box) -> -10; the
  training score of turn 1 is the mean over agents (rule_agent_share all);
- per agent, on the trained turn (turn 1; MaPoRL's shipped configs have task_training False): old
  log-probs from the generation scores (MaPoRL's trainer; `--old-logprobs forward` does a policy
  forward instead), reference log-probs (forward, adapter disabled, logits / temperature), values
  (value model on the turn-0 prompt + response: value_simplification), per-token rewards
  -kl_coef (lp - ref) + score on the last token, GAE gamma 1 lambda 0.95, advantage whitening;
- num_ppo_epochs x num_mini_batches: per micro-batch (per_device_train_batch_size rows) policy
  forward + value forward, loss = clipped policy loss + vf_coef * clipped value loss, backward;
  AdamW (lr 1e-5) steps once per mini-batch.

A warm-up step on questions 0..Q runs first (it also trains), then the step on Q..2Q is timed.
Progress on stderr; one JSON line on stdout.

`--model-dir DIR` loads a Hugging Face directory (config.json, weights, tokenizer) instead of the
GGUF, and `--device cuda` runs everything on the GPU (tensors are created there by default; each
phase's time is read after a synchronise): `scripts/device/check.sh`'s `maporl` step.
"""

import argparse
import contextlib
import copy
import gzip
import json
import math
import os
import re
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_GGUF = os.environ.get(
    "COTRAIN_DEFAULT_MODEL", os.path.expanduser("~/.cache/cotrain/models/SmolLM2-135M-Instruct.Q4_1.gguf")
)
INVALID_LOGPROB = 1.0

# configs/prompts/gsm8k.j2 and configs/prompts/discussion_followup.j2, as cotrain renders them.
QUESTION = (
    "Solve this math problem. Reason step by step, and give the final answer, an integer, in \\boxed{{}}.\n\n"
    "Problem: {question}"
)


def followup(others):
    """The turn t >= 1 user message: the other agents' previous answers and their scores."""
    text = "These are the solutions to the problem from other agents:\n"
    for k, (answer, score) in enumerate(others, 1):
        text += f"\nAgent {k} solution: {answer.strip()}\n"
        reading = (
            "likely wrong" if score < 0.3 else "might be wrong" if score < 0.6 else "seems right" if score < 0.8 else "likely right"
        )
        text += f"A verifier rates this solution {score:.2f} out of 1: it is {reading}.\n"
    text += (
        "\nUsing the other agents' solutions as additional information, give an updated answer to the problem, "
        "in the same answer format as before."
    )
    return text.strip()


def lscpu(key):
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}).stdout
    except OSError:
        return "unknown"
    for line in out.splitlines():
        k, _, v = line.partition(":")
        if k.strip() == key:
            return v.strip()
    return "unknown"


def sync():
    """Waits for the GPU's queued work, so that a phase's time includes it (no-op on the CPU)."""
    if torch.cuda.is_available() and torch.get_default_device().type == "cuda":
        torch.cuda.synchronize()


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def last_boxed(text):
    at = text.rfind("\\boxed{")
    if at < 0:
        return None
    depth, i = 1, at + len("\\boxed{")
    start = i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def to_int(s):
    s = s.replace(",", "").replace("$", "").strip()
    m = re.search(r"-?\d+(\.\d+)?", s)
    if not m:
        return None
    try:
        v = float(m.group(0))
    except ValueError:
        return None
    return int(v) if v == int(v) else None


def load_rows(path, n):
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append({"question": r["question"], "answer": to_int(r["answer"].split("####")[-1])})
            if len(rows) == n:
                break
    return rows


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x, mask, shift_mean=True):
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    # TRL's masked_var applies Bessel's correction.
    n = mask.sum()
    if n > 1:
        var = var * n / (n - 1)
    w = (x - mean) * torch.rsqrt(var + 1e-8)
    return w if shift_mean else w + mean


def disable_dropout(model):
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


class Agent:
    """A policy model (base + LoRA adapters `turn0` and `later`) and a value model (own base copy +
    one LoRA adapter `value_t` and one frozen random bias-free value head per trained turn t, as
    MaPoRL's `value_0..value_{T-1}` with heads its trainer never trains), one AdamW over everything
    trained. With `--layout shared_by_turn` (MaPoRL's) every agent is this one object."""

    def __init__(self, base, lora_cfg, lr, turns):
        from peft import get_peft_model

        self.policy = get_peft_model(copy.deepcopy(base), copy.deepcopy(lora_cfg), adapter_name="turn0")
        self.policy.add_adapter("later", copy.deepcopy(lora_cfg))
        self.value = get_peft_model(copy.deepcopy(base), copy.deepcopy(lora_cfg), adapter_name="value_1")
        for t in range(2, turns):
            self.value.add_adapter(f"value_{t}", copy.deepcopy(lora_cfg))
        self.heads = {t: nn.Linear(base.config.hidden_size, 1, bias=False).requires_grad_(False) for t in range(1, turns)}
        disable_dropout(self.policy)
        disable_dropout(self.value)
        self.policy.set_adapter("later")  # trained: `later`; `turn0` frozen (task_training False)
        params = [p for n, p in self.policy.named_parameters() if "lora_" in n and ".later." in n]
        params += [p for n, p in self.value.named_parameters() if "lora_" in n]
        for p in params:
            p.requires_grad_(True)  # PEFT's set_adapter leaves only the active adapter trainable
        self.optimizer = torch.optim.AdamW(params, lr=lr)

    def values(self, ids, mask, turn):
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        self.value.set_adapter(f"value_{turn}")
        for n, p in self.value.named_parameters():
            if "lora_" in n:
                p.requires_grad_(True)
        # MaPoRL calls the causal LM with output_hidden_states and reads the last hidden state.
        out = self.value(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True, return_dict=True)
        return self.heads[turn](out.hidden_states[-1]).squeeze(-1)


def lm_forward(model, ids, mask):
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True, return_dict=True).logits


def response_logprobs(logits, ctx, responses, temperature):
    logits = logits[:, ctx - 1 : -1] / (temperature + 1e-7)
    return torch.gather(F.log_softmax(logits, dim=-1), 2, responses.unsqueeze(-1)).squeeze(-1)


class Bench:
    def __init__(self, a):
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.a = a
        t = time.perf_counter()
        if a.model_dir:
            self.tok = AutoTokenizer.from_pretrained(a.model_dir)
            base = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).to(a.device)
        else:
            d, name = os.path.split(a.gguf)
            self.tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
            base = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).to(a.device)
        base.eval()
        base.generation_config.eos_token_id = None  # MaPoRL: generate exactly max_output_length tokens
        base.generation_config.pad_token_id = None
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.stops = sorted({i for i in [self.tok.eos_token_id, self.tok.convert_tokens_to_ids("<|im_end|>")] if i is not None and i >= 0})
        lora = LoraConfig(
            r=8,
            lora_alpha=16,
            lora_dropout=0.05,
            bias="none",
            task_type="CAUSAL_LM",
            target_modules=["up_proj", "down_proj", "gate_proj", "k_proj", "q_proj", "v_proj", "o_proj"],
        )
        torch.manual_seed(a.seed)
        if a.layout == "shared_by_turn":
            shared = Agent(base, lora, a.lr, a.turns)
            self.agents = [shared] * a.agents
        else:
            self.agents = [Agent(base, lora, a.lr, a.turns) for _ in range(a.agents)]
        del base
        log(f"reference: loaded in {time.perf_counter() - t:.1f} s; stop ids {self.stops}, pad {self.pad}")

    def encode(self, messages):
        return self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    def left_pad(self, seqs):
        n = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), n), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), n), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, n - len(s) :] = torch.tensor(s)
            mask[b, n - len(s) :] = 1
        return ids, mask

    def cut(self, responses):
        """TRL's truncate_response: everything after the first stop token becomes padding; also the
        response mask (1 through the first stop token) and each row's last kept index."""
        t = responses.shape[1]
        stop = torch.zeros_like(responses, dtype=torch.bool)
        for s in self.stops:
            stop |= responses == s
        first = torch.where(stop.any(1), stop.int().argmax(1), torch.full((responses.shape[0],), t - 1))
        idx = torch.arange(t).unsqueeze(0)
        keep = idx <= first.unsqueeze(1)
        return responses.masked_fill(~keep, self.pad), keep.long(), first

    def generate(self, agent, adapter, prompts):
        a = self.a
        ag = self.agents[agent]
        ag.policy.set_adapter(adapter)
        ag.policy.eval()
        ids, mask = self.left_pad(prompts)
        with torch.no_grad():
            out = ag.policy.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=a.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=a.tokens,
                eos_token_id=None,
                pad_token_id=self.pad,
                return_dict_in_generate=True,
                output_scores=True,
            )
        responses = out.sequences[:, ids.shape[1] :]
        scores = torch.stack(out.scores, 1)  # processed logits: / temperature
        lp = torch.gather(F.log_softmax(scores, dim=-1), 2, responses.unsqueeze(-1)).squeeze(-1)
        return ids, mask, responses, lp

    def score(self, text, n_tokens, turn, answer):
        boxed = last_boxed(text)
        if n_tokens < self.a.min_output_length or (turn >= 1 and boxed is None):
            return -10.0, False
        ok = boxed is not None and to_int(boxed) is not None and to_int(boxed) == answer
        return (1.0 if ok else 0.0), ok

    def step(self, rows):
        a = self.a
        times = {}
        n, q = a.agents, len(rows)
        t0 = time.perf_counter()
        # ---- rollout: turn by turn, agent by agent, a batch of the questions per generate ----------
        histories = [[[{"role": "user", "content": QUESTION.format(question=r["question"])}] for _ in range(n)] for r in rows]
        first_prompts = [[self.encode(histories[k][i]) for k in range(q)] for i in range(n)]
        turns = []  # turns[t][i] = dict of tensors for agent i at turn t
        for t in range(a.turns):
            this = []
            for i in range(n):
                if t == 0:
                    prompts = first_prompts[i]
                else:
                    prompts = []
                    for k in range(q):
                        prev = turns[t - 1]
                        others = [(prev[j]["texts"][k], max(prev[j]["scores"][k], 0.0)) for j in range(n) if j != i]
                        histories[k][i] = histories[k][i] + [{"role": "user", "content": followup(others)}]
                        prompts.append(self.encode(histories[k][i]))
                ids, mask, responses, lp = self.generate(i, "turn0" if t == 0 else "later", prompts)
                post, rmask, last = self.cut(responses)
                texts, scores, correct = [], [], []
                for k in range(q):
                    body = [x for x in post[k, : int(last[k]) + 1].tolist() if x not in self.stops]
                    text = self.tok.decode(body, skip_special_tokens=True)
                    s, ok = self.score(text, len(body), t, rows[k]["answer"])
                    texts.append(text)
                    scores.append(s)
                    correct.append(ok)
                this.append(dict(ids=ids, mask=mask, responses=post, rmask=rmask, last=last, lp=lp, texts=texts, scores=scores, correct=correct))
            for i in range(n):
                for k in range(q):
                    histories[k][i] = histories[k][i] + [{"role": "assistant", "content": this[i]["texts"][k]}]
            turns.append(this)
        sync()
        times["rollout"] = time.perf_counter() - t0

        # ---- PPO inputs of the trained turn(s): turn >= 1 ---------------------------------------------
        t1 = time.perf_counter()
        batches = []  # per (turn, agent)
        for t in range(1, a.turns):
            for i in range(n):
                g = turns[t][i]
                ag = self.agents[i]
                ctx = g["ids"].shape[1]
                qr = torch.cat([g["ids"], g["responses"]], 1)
                qr_mask = torch.cat([g["mask"], g["rmask"]], 1)
                pad_mask = g["rmask"] == 0
                with torch.no_grad():
                    ag.policy.eval()
                    ag.value.eval()
                    if a.old_logprobs == "forward":
                        ag.policy.set_adapter("later")
                        old = response_logprobs(lm_forward(ag.policy, qr, qr_mask), ctx, g["responses"], a.temperature)
                    else:
                        old = g["lp"]
                    with ag.policy.disable_adapter():
                        ref = response_logprobs(lm_forward(ag.policy, qr, qr_mask), ctx, g["responses"], a.temperature)
                    # value_simplification: the critic reads the turn-0 prompt + this response
                    f = turns[0][i]
                    vctx = f["ids"].shape[1]
                    v_ids = torch.cat([f["ids"], g["responses"]], 1)
                    v_mask = torch.cat([f["mask"], g["rmask"]], 1)
                    values = ag.values(v_ids, v_mask, t)[:, vctx - 1 : -1]
                old = old.masked_fill(pad_mask, INVALID_LOGPROB)
                ref = ref.masked_fill(pad_mask, INVALID_LOGPROB)
                values = values.masked_fill(pad_mask, 0.0)
                # training score R(t, i): turn t's scores shared by all agents (rule_agent_share all);
                # the last turn has no later turns to discount in.
                shaped = torch.tensor([sum(turns[t][j]["scores"][k] for j in range(n)) / n for k in range(q)])
                kl = old - ref
                rewards = (-a.kl_coef * kl).masked_fill(pad_mask, 0.0)
                rewards[torch.arange(q), g["last"]] += shaped
                # GAE, gamma 1, lambda 0.95
                T = rewards.shape[1]
                adv_rev, lastgaelam = [], torch.zeros(q)
                for s in reversed(range(T)):
                    nextv = values[:, s + 1] if s < T - 1 else torch.zeros(q)
                    delta = rewards[:, s] + a.gamma * nextv - values[:, s]
                    lastgaelam = delta + a.gamma * a.lam * lastgaelam
                    adv_rev.append(lastgaelam)
                adv = torch.stack(adv_rev[::-1], 1)
                returns = adv + values
                m = g["rmask"].float()
                adv = masked_whiten(adv, m).masked_fill(pad_mask, 0.0)
                batches.append(
                    dict(agent=i, turn=t, qr=qr, qr_mask=qr_mask, ctx=ctx, v_ids=v_ids, v_mask=v_mask, vctx=vctx, responses=g["responses"],
                         mask=m, old=old, values=values, returns=returns, adv=adv)
                )
        sync()
        times["ppo_prepare"] = time.perf_counter() - t1

        # ---- PPO epochs ---------------------------------------------------------------------------------
        t2 = time.perf_counter()
        mb_size = max(1, q // a.num_mini_batches)
        stats = {"pg_loss": 0.0, "vf_loss": 0.0, "n": 0}
        for _ in range(a.num_ppo_epochs):
            perm = torch.randperm(q).tolist()
            for start in range(0, q, mb_size):
                mb = perm[start : start + mb_size]
                for b in batches:  # every (turn, agent), as MaPoRL's loop does
                    ag = self.agents[b["agent"]]
                    ag.policy.set_adapter("later")
                    ag.policy.train()
                    ag.value.train()
                    for ms in range(0, len(mb), a.micro_batch):
                        mi = torch.tensor(mb[ms : ms + a.micro_batch])
                        mask = b["mask"][mi]
                        logits = lm_forward(ag.policy, b["qr"][mi], b["qr_mask"][mi])
                        new = response_logprobs(logits, b["ctx"], b["responses"][mi], a.temperature).masked_fill(mask == 0, INVALID_LOGPROB)
                        vpred = ag.values(b["v_ids"][mi], b["v_mask"][mi], b["turn"])[:, b["vctx"] - 1 : -1].masked_fill(mask == 0, 0.0)
                        old_v = b["values"][mi]
                        vclip = torch.clamp(vpred, old_v - a.cliprange_value, old_v + a.cliprange_value)
                        ret = b["returns"][mi]
                        vf = 0.5 * masked_mean(torch.max((vpred - ret) ** 2, (vclip - ret) ** 2), mask)
                        ratio = torch.exp(new - b["old"][mi])
                        adv = b["adv"][mi]
                        pg = masked_mean(torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - a.cliprange, 1 + a.cliprange)), mask)
                        loss = (pg + a.vf_coef * vf) / math.ceil(len(mb) / a.micro_batch)
                        loss.backward()
                        stats["pg_loss"] += float(pg)
                        stats["vf_loss"] += float(vf)
                        stats["n"] += 1
                    ag.optimizer.step()
                    ag.optimizer.zero_grad(set_to_none=True)
        sync()
        times["ppo_epochs"] = time.perf_counter() - t2
        times["update"] = times["ppo_prepare"] + times["ppo_epochs"]
        times["step"] = time.perf_counter() - t0
        acc = [sum(turns[t][i]["correct"][k] for i in range(n) for k in range(q)) / (n * q) for t in range(a.turns)]
        trained_tokens = int(sum(b["mask"].sum() for b in batches))
        return times, acc, trained_tokens, stats


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=DEFAULT_GGUF)
    p.add_argument("--model-dir", help="a Hugging Face model directory (config, weights, tokenizer) instead of --gguf")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--data", default=os.path.join(ROOT, "data/gsm8k/train.jsonl.gz"))
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--questions", type=int, default=32, help="questions per PPO update (MaPoRL: 1 x 4 x 8 = 32)")
    p.add_argument("--tokens", type=int, default=64, help="max_output_length")
    p.add_argument("--num-ppo-epochs", type=int, default=4)
    p.add_argument("--num-mini-batches", type=int, default=8)
    p.add_argument("--layout", choices=["shared_by_turn", "per_agent"], default="shared_by_turn",
                   help="shared_by_turn: one policy (adapters turn0/later) and one critic per turn for all agents (MaPoRL's); per_agent: one of each per agent")
    p.add_argument("--micro-batch", type=int, default=1, help="per_device_train_batch_size (rows per forward/backward)")
    p.add_argument("--old-logprobs", choices=["scores", "forward"], default="scores",
                   help="behaviour log-probs from generate's scores (MaPoRL's trainer) or from a policy forward")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--kl-coef", type=float, default=0.002)
    p.add_argument("--vf-coef", type=float, default=0.1)
    p.add_argument("--cliprange", type=float, default=0.2)
    p.add_argument("--cliprange-value", type=float, default=0.2)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--min-output-length", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    # Every tensor the step makes (padding, masks, indices, value heads) lands on the device.
    torch.set_default_device(a.device)
    torch.manual_seed(a.seed)
    rows = load_rows(a.data, 2 * a.questions)
    bench = Bench(a)
    results = []
    for s in range(2):
        part = rows[s * a.questions : (s + 1) * a.questions]
        times, acc, trained_tokens, stats = bench.step(part)
        log(
            f"reference step {s + 1} (rows {s * a.questions}..{(s + 1) * a.questions}): {times['step']:.1f} s = rollout {times['rollout']:.1f} "
            f"+ prepare {times['ppo_prepare']:.1f} + PPO epochs {times['ppo_epochs']:.1f}; accuracy per turn {acc}, "
            f"{trained_tokens} trained response tokens"
        )
        results.append((times, trained_tokens))
    times, trained_tokens = results[1]
    print(json.dumps({
        "impl": "reference",
        "cpu_model": lscpu("Model name"),
        "cpu_family": lscpu("CPU family"),
        "threads": torch.get_num_threads(),
        "device": a.device,
        "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else None,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "peft": __import__("peft").__version__,
        "agents": a.agents,
        "turns": a.turns,
        "questions": a.questions,
        "max_output_length": a.tokens,
        "num_ppo_epochs": a.num_ppo_epochs,
        "num_mini_batches": a.num_mini_batches,
        "micro_batch": a.micro_batch,
        "layout": a.layout,
        "old_logprobs": a.old_logprobs,
        "generated_tokens": a.questions * a.agents * a.turns * a.tokens,
        "trained_response_tokens": trained_tokens,
        "first_step": results[0][0]["step"],
        **times,
    }))


if __name__ == "__main__":
    main()

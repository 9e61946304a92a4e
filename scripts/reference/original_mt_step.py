#!/usr/bin/env python3
"""One 2-turn MAGRPO step done the way the original CoMLRL trainer does it, with transformers, for a
multi-turn step benchmark (the multi-turn counterpart of `original_step.py`).

Setting (the same as `original_step.py`, notes/toolchain.md): 2 agents, each its own copy of
SmolLM2-135M-Instruct loaded from the local GGUF in float32, `torch.set_num_threads(2)`, G = 4 samples
per agent per node, exactly 128 new tokens (EOS ignored: `min_new_tokens = max_new_tokens`), pure
sampling (temperature 1, top_k 0, top_p 1), the same PROMPT rendered with the chat template, AdamW
(lr 1e-5, weight decay 0), and the same stand-in reward: for joint action j, the fraction of even token
ids in agent 0's j-th completion plus that in agent 1's j-th completion (index-aligned joint actions).

Turn-2 prompts stand in for the external transition (not timed on the reward side; here it is a
string concatenation): for each agent, the user message
    PROMPT + "\\n\\n" + FEEDBACK + "\\n\\n" + <that agent's handed/branch completion text>
rendered again with the chat template (add_generation_prompt=True). The completion text is the
original's: `tokenizer.decode(completion_ids, skip_special_tokens=True)`.

Pieces of the original mirrored here (CoMLRL `comlrl/trainers/magrpo.py`; "current" = the tree
trainer, "1e4bf91" = the older handoff trainer):

* generation, both variants: `MAGRPOTrainer._generate_completions` (called through
  `_generate_completions_with_external_prompts`): tokenize the one prompt (padding=True,
  truncation=True), set `requires_grad=False` on every parameter and `eval()`, one
  `agent.generate(..., num_return_sequences=4, do_sample=True, num_beams=1, output_scores=True,
  return_dict_in_generate=True, pad_token_id=...)` per agent per node, restore train mode and
  `requires_grad`, cut each row after the prompt and decode it. `min_new_tokens` reaches `generate`
  the way the original's `**kwargs` do (`generation_kwargs.update(kwargs)`).
  One deviation: the original finds the prompt's end as the first pad token in the prompt ids; SmolLM2's
  pad token is `<|im_end|>` (id 2), which the chat template itself contains, so that scan would cut
  inside the prompt. With a single unpadded prompt the intended value is the prompt length, used here.
* loss, both variants: `MAGRPOTrainer._compute_loss_with_gradients`: advantages = returns (tree) or
  rewards (handoff) minus their mean over the node's 4 samples (1e4bf91 then clamps them to
  [-10, 10]); per completion one forward of `prompt + completion[:-1]` (batch 1, all-ones attention
  mask), logits `[P-1:-1]` (so, as in the original, the completion's last token gets no logit and is
  not scored), a per-token `log_softmax(...)[token]` loop, summed, `-advantage * logprob`, averaged
  over the 4 completions.
* `--variant tree` (current trainer, `MAGRPOTrainer._train_step_returns`): `build_node` generates the
  root (agent 0, then agent 1), rewards the 4 aligned joint actions (`joint_mode: aligned`), then, for
  each joint action j in order, builds child node j from the turn-2 prompts (agent 0, then agent 1);
  `compute_returns`: leaf returns = rewards, R_j = r_j + 0.9 * mean(child j's returns);
  `post_order_update` makes one `NodeSample` per node per agent, sorted per agent by `node_env_step`
  (root, child 0..3); `_append_to_buffer` with `rollout_buffer_size: 1` calls `_process_buffer` ->
  `_update_from_samples` for every sample: zero_grad, loss * (1/1) backward, one AdamW step. Order:
  agent 0 (root, child 0, 1, 2, 3), then agent 1 (same): 10 optimizer steps, 10 generate calls.
  `termination_threshold` is taken as None: its default (-0.2) would stop branching at the root
  because the stand-in reward is positive.
* `--variant handoff` (1e4bf91, `MAGRPOTrainer._train_step` with `handoff: best`): per turn
  zero_grad both optimizers, generate 4 per agent (agent 0, then agent 1), reward the aligned joint
  actions, keep the best joint action (`rewards.index(max(rewards))`) whose completions make the
  turn-2 prompts; after the episode, per turn (weights `turn_gradient_weights` = [1.2, 0.8]), per agent:
  loss * weight, backward, AdamW step, zero_grad: 4 optimizer steps, 4 generate calls. The early
  termination check (threshold 4.0, only evaluated with wandb on) can not fire: the reward is at most 2.

Timing: generate = wall time inside the generation helper (tokenize + generate + decode), train = the
update phase (losses, backward, AdamW), step = the whole step (also rewards, returns, the stand-in
transition). Progress goes to stderr; one JSON line goes to stdout at the end, with the keys of
`original_step.py` plus the variant, the per-step split and the token counts.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF = Path.home() / ".cache/cotrain/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = ("You are a careful Python programmer. Write a function `rolling_max(numbers)` that, given a list "
          "of integers, returns the list of the running maximum at every position. For example rolling_max([1, 2, 3, 2, 3, 4, 2]) "
          "returns [1, 2, 3, 3, 3, 4, 4]. Explain briefly, then give the code.")
FEEDBACK = "Feedback: your previous answer, below, does not pass all the tests. Fix it and give the full corrected code."
G = 4
NEW_TOKENS = 128
GAMMA = 0.9
TURN_WEIGHTS = [1.2, 0.8]


class Bench:
    def __init__(self, model_path):
        path = Path(model_path)
        self.tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.agents = [AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32) for _ in range(2)]
        for m in self.agents:
            m.train()  # as the original's train(): agent.train() before the epochs
        self.opts = [torch.optim.AdamW(m.parameters(), lr=1e-5, weight_decay=0.0) for m in self.agents]
        self.gen_secs = 0.0
        self.gen_tokens = 0
        self.gen_calls = 0
        self.opt_steps = 0
        self.prompt_tokens = []  # per generate call

    def render(self, content):
        return self.tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)

    def transition(self, completion_text):
        """Stand-in for the external transition: the turn-2 prompt of one agent."""
        return self.render(f"{PROMPT}\n\n{FEEDBACK}\n\n{completion_text}")

    def generate(self, agent, prompt_text):
        """MAGRPOTrainer._generate_completions for one prompt, num_return_sequences = G."""
        t0 = time.time()
        enc = self.tok([prompt_text], padding=True, truncation=True, return_tensors="pt")
        prompt_ids, prompt_mask = enc.input_ids, enc.attention_mask
        training_mode = agent.training
        req = {}
        for name, p in agent.named_parameters():
            req[name] = p.requires_grad
            p.requires_grad = False
        agent.eval()
        out = agent.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=NEW_TOKENS,
                             output_scores=True, return_dict_in_generate=True, do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, num_beams=1, num_return_sequences=G,
                             pad_token_id=self.tok.pad_token_id, min_new_tokens=NEW_TOKENS)
        agent.train(training_mode)
        for name, p in agent.named_parameters():
            p.requires_grad = req[name]
        prompt_len = prompt_ids.shape[1]  # see the docstring: not the original's first-pad scan
        comp_ids = [out.sequences[s, prompt_len:] for s in range(min(G, out.sequences.shape[0]))]
        comp_text = [self.tok.decode(c, skip_special_tokens=True) for c in comp_ids]
        self.gen_secs += time.time() - t0
        self.gen_tokens += sum(int(c.shape[0]) for c in comp_ids)
        self.gen_calls += 1
        self.prompt_tokens.append(int(prompt_len))
        return {"prompt_input_ids": prompt_ids.detach().cpu(), "completion_input_ids": [[c.detach().cpu() for c in comp_ids]],
                "completions": [comp_text]}

    @staticmethod
    def rewards(node_comps):
        """The stand-in reward of the aligned joint actions (as original_step.py)."""
        return [sum(float((c["completion_input_ids"][0][j] % 2 == 0).float().mean()) for c in node_comps) for j in range(G)]

    @staticmethod
    def loss(agent, data, returns, clamp):
        """MAGRPOTrainer._compute_loss_with_gradients (current; 1e4bf91 when clamp)."""
        returns_t = torch.tensor(returns, dtype=torch.float)
        adv = returns_t - returns_t.mean()
        if clamp:
            adv = torch.clamp(adv, min=-10.0, max=10.0)
        agent.train()
        prompt_ids = data["prompt_input_ids"][0]
        total = torch.tensor(0.0, requires_grad=True)
        n = 0
        for k, comp in enumerate(data["completion_input_ids"][0]):
            if k >= len(adv):
                break
            if len(comp) > 0:
                input_ids = torch.cat([prompt_ids, comp[:-1]])
                mask = torch.ones(len(input_ids))
                logits = agent(input_ids=input_ids.unsqueeze(0), attention_mask=mask.unsqueeze(0)).logits[0, prompt_ids.size(0) - 1:-1, :]
                lps = [torch.log_softmax(logits[i], dim=-1)[t] for i, t in enumerate(comp) if i < logits.size(0)]
                if lps:
                    total = total + (-torch.stack(lps).sum() * adv[k])
                    n += 1
        if n > 0:
            total = total / n
        if torch.isnan(total) or torch.isinf(total):
            return torch.tensor(0.1, requires_grad=True)
        return total

    def step_tree(self, prompt_text):
        """MAGRPOTrainer._train_step_returns (current), 2 turns, aligned, rollout_buffer_size 1."""
        env_step = [0]

        def build_node(turn, prompts):
            comps = [self.generate(self.agents[a], prompts[a]) for a in range(2)]
            r = self.rewards(comps)
            env_step[0] += len(r)
            node = {"turn": turn, "completions": comps, "rewards": r, "children": [], "env_step": env_step[0]}
            if turn < 1:
                for j in range(len(r)):
                    child_prompts = [self.transition(comps[a]["completions"][0][j]) for a in range(2)]
                    node["children"].append(build_node(turn + 1, child_prompts))
            return node

        root = build_node(0, [prompt_text, prompt_text])

        def compute_returns(node):
            if not node["children"]:
                node["returns"] = list(node["rewards"])
            else:
                node["returns"] = [rj + GAMMA * (sum(ch) / len(ch)) for rj, ch in
                                   zip(node["rewards"], (compute_returns(c) for c in node["children"]))]
            return node["returns"]

        compute_returns(root)
        t_gen_end = time.time()
        pending = [[], []]

        def post_order(node):
            for c in node["children"]:
                post_order(c)
            for a in range(2):
                pending[a].append((node["env_step"], node["completions"][a], node["returns"]))

        post_order(root)
        for a in range(2):
            pending[a].sort(key=lambda s: s[0])
            for _, data, rets in pending[a]:
                # _append_to_buffer -> _process_buffer -> _update_from_samples (one sample)
                samples = [(data, rets)]
                random.shuffle(samples)
                self.opts[a].zero_grad()
                scale = 1.0 / len(samples)
                for d, rr in samples:
                    (self.loss(self.agents[a], d, rr, clamp=False) * scale).backward()
                self.opts[a].step()
                self.opt_steps += 1
        return t_gen_end, {"root_returns": root["returns"]}

    def step_handoff(self, prompt_text):
        """MAGRPOTrainer._train_step (1e4bf91), 2 turns, handoff best, turn weights 1.2 / 0.8."""
        turn_data = []
        best = [None, None]
        for turn in range(2):
            for opt in self.opts:
                opt.zero_grad()
            prompts = [prompt_text, prompt_text] if turn == 0 else [self.transition(best[a]) for a in range(2)]
            comps = [self.generate(self.agents[a], prompts[a]) for a in range(2)]
            r = self.rewards(comps)
            b = r.index(max(r))
            best = [comps[a]["completions"][0][b] for a in range(2)]
            turn_data.append({"completions": comps, "rewards": r})
        t_gen_end = time.time()
        for turn, info in enumerate(turn_data):
            w = TURN_WEIGHTS[turn] if turn < len(TURN_WEIGHTS) else 1.0
            for a in range(2):
                loss = self.loss(self.agents[a], info["completions"][a], info["rewards"], clamp=True)
                (loss * w).backward()
                self.opts[a].step()
                self.opts[a].zero_grad()
                self.opt_steps += 1
        return t_gen_end, {"turn_mean_rewards": [sum(t["rewards"]) / G for t in turn_data]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=["tree", "handoff"], required=True)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--model", default=str(GGUF))
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    random.seed(0)
    bench = Bench(args.model)
    prompt_text = bench.render(PROMPT)
    step_secs, gen_secs, train_secs, gen_tokens, gen_calls, opt_steps, turn2_prompt_tokens = [], [], [], [], [], [], []
    for step in range(args.steps):
        bench.gen_secs, bench.gen_tokens, bench.gen_calls, bench.opt_steps, bench.prompt_tokens = 0.0, 0, 0, 0, []
        t0 = time.time()
        t_gen_end, info = (bench.step_tree if args.variant == "tree" else bench.step_handoff)(prompt_text)
        t_end = time.time()
        secs = t_end - t0
        train = t_end - t_gen_end
        step_secs.append(secs)
        gen_secs.append(bench.gen_secs)
        train_secs.append(train)
        gen_tokens.append(bench.gen_tokens)
        gen_calls.append(bench.gen_calls)
        opt_steps.append(bench.opt_steps)
        t2 = bench.prompt_tokens[2:]
        turn2_prompt_tokens.append(sum(t2) / len(t2) if t2 else 0.0)
        print(f"original-style {args.variant} step {step + 1}: {secs:.1f} s (generate {bench.gen_secs:.1f} s, train {train:.1f} s), "
              f"{bench.gen_tokens} generated tokens in {bench.gen_calls} generate calls, {bench.opt_steps} AdamW steps, "
              f"{info}", file=sys.stderr, flush=True)
    print(json.dumps({"impl": "transformers-original", "variant": args.variant, "turns": 2, "agents": 2, "samples": G,
                      "new_tokens": NEW_TOKENS, "prompt_tokens": int(bench.prompt_tokens[0]),
                      "turn2_prompt_tokens_mean": turn2_prompt_tokens, "step_seconds": step_secs, "best_seconds": min(step_secs),
                      "generate_seconds": gen_secs, "train_seconds": train_secs, "generated_tokens": gen_tokens,
                      "generate_calls": gen_calls, "optimizer_steps": opt_steps}))


if __name__ == "__main__":
    main()

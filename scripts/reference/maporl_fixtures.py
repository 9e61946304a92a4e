#!/usr/bin/env python3
"""Reference values of the ORIGINAL MaPoRL trainer's per-token PPO arithmetic, critic head, discussion
prompts and answer rewrite, for cotrain's MaPoRL tests: `learner/tests/fixtures/maporl/*.json`.

Original code (read at run time from --maporl, never copied into cotrain):
  repository  chanwoo-park-official/MAPoRL
  commit      c204c2c5be12d51230267b239b7b32b3e0115548  (2025-09-06; the code is identical to 765ad1f,
              later commits only touch readme.md)
  files       trl/trl/trainer/ppov2_trainer_multi_different_model.py   the trainer (rollout, rewards, GAE, PPO)
              trl/trl/trainer/utils_multi_unified.py                   score_rule, bonus_rule, first_true_indices, truncate_response
              trl/trl/trainer/utils_multi_unified_chat.py              formatting_question, construct_message_multi_agent, combine_agent_contexts
              trl/trl/core.py                                          masked_mean, masked_var, masked_whiten
              utils/dataset.py                                         extract_ans_from_response
              utils/utils_cooperateLLM.py                              grad_requires_setting, calculate_reward_from_answer
              utils/utils_model.py                                     the value heads (line 182)

Getting a checkout:
  git clone https://github.com/chanwoo-park-official/MAPoRL /tmp/maporl-repo
  mkdir -p /tmp/maporl && git -C /tmp/maporl-repo archive c204c2c | tar -x -C /tmp/maporl

Running (Python 3.11 + torch; no transformers/peft/accelerate/deepspeed/wandb needed):
  python scripts/reference/maporl_fixtures.py --maporl /tmp/maporl [--out learner/tests/fixtures/maporl]

How the original is called. The original modules cannot be imported as they stand: the trainer file has
a stray backtick on line 443 (a SyntaxError), trl/trl/trainer/ppov2_config.py imports a module that the
repository does not ship (`..trainer.utils`), and the helper modules import vllm-era heavy packages at top
level. So every ORIGINAL FUNCTION used here is taken from the checkout's source text with `ast` (the exact
`def` block, unchanged) and exec'd in a namespace holding only what it refers to (torch, re, typing).
Code that lives inline in the trainer's loop is transcribed line for line into functions named
`trainer_*` below, each marked with the trainer lines it transcribes; they are kept as close to the
original text as possible (same variable names, same operations, same order).

Fixtures written:
  rewards_gae.json        2 agents x 3 turns x 2 questions, response length 6, fixed token ids with
                          padding (pad = eos = 0, "<|end|>" = 3, as Phi-3: pad_token = eos_token =
                          <|endoftext|>, turns end with <|end|>), fixed logprobs / ref_logprobs / values
                          (the critic's raw outputs at every response position) and fixed per-answer scores
                          s(t,i) (one is the -10 invalid penalty). Holds, per (turn, agent): the truncated
                          response (truncate_response), sequence_lengths, padding masks, the masked
                          logprobs / ref / values (trainer 1504-1510), the training score R(t,i)+bonus
                          (score_rule + bonus_rule, trainer 1605-1616; alpha = [0,0,0,0] and
                          alpha = [0.1,0.2,0.3,0.4] with a correctness table), the per-token rewards
                          (KL shaping + score at actual_end), the GAE advantages and returns (gamma 1,
                          lambda 0.95) and the whitened advantages, whitened per (turn, agent) over that
                          (turn, agent)'s questions (trainer 1630-1691).
  value_head.json         a value head as utils/utils_model.py:182 makes it (nn.Linear(H, 1, bias=False),
                          default init, created after torch.manual_seed(seed)), its weight, fixed hidden
                          states [2, 3, H] and the head's outputs; plus which parameters
                          grad_requires_setting (utils/utils_cooperateLLM.py:501-519) leaves trainable for
                          a model with PEFT-style parameter names, for the flag combinations.
  followup_prompt.json    a 2-agent, 3-turn discussion of one GSM8K question built with the original
                          formatting_question / construct_message_multi_agent / combine_agent_contexts and
                          the trainer's own-score message (1420-1432): for reward_feedback true and false,
                          every (turn, agent)'s chat messages exactly as passed to apply_chat_template
                          (trainer 954-958), the verifier's query for every answer (1271-1302), and the
                          raw follow-up message text.
  boxed_rewrite.json      the trainer's answer rewrite (1120-1217) and the verifier-side clean-up
                          (1276-1293) for several answer strings: extracted answer, the rewritten text
                          shown to the other agents, the text the verifier scores, and its correctness
                          (calculate_reward_from_answer, the original).

Caveat: in the original, the rewritten text is re-tokenized (encode without special tokens, padded with
<|end|>, truncated, decoded skipping special tokens; 1219-1264, 1414) before it is shown to the other
agents; with Phi-3's tokenizer that round trip is the identity for ordinary text, and it is skipped here.
"""

import argparse
import ast
import json
import math
import re
import sys
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

COMMIT = "c204c2c5be12d51230267b239b7b32b3e0115548"
TRAINER = "trl/trl/trainer/ppov2_trainer_multi_different_model.py"
UTILS = "trl/trl/trainer/utils_multi_unified.py"
CHAT = "trl/trl/trainer/utils_multi_unified_chat.py"
CORE = "trl/trl/core.py"
DATASET = "utils/dataset.py"
COOP = "utils/utils_cooperateLLM.py"

# PPOv2Config defaults the trainer uses (trl/trl/trainer/ppov2_config.py) and the released configs' values.
GAMMA = 1.0
LAM = 0.95
KL_COEF = 0.002
INVALID_LOGPROB = 1.0  # trainer line 95


# --------------------------------------------------------------------------------------------------
# Loading original functions by source
# --------------------------------------------------------------------------------------------------

def load_functions(root: Path, rel: str, names: List[str], ns: Dict[str, Any]) -> Dict[str, Any]:
    """Exec the exact `def` blocks `names` of file `rel` into namespace `ns`; return {name: (fn, first, last line)}."""
    src = (root / rel).read_text()
    tree = ast.parse(src)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            seg = ast.get_source_segment(src, node)
            exec(compile("\n" * (node.lineno - 1) + seg, str(root / rel), "exec"), ns)
            found[node.name] = (ns[node.name], node.lineno, node.end_lineno)
    missing = set(names) - set(found)
    if missing:
        raise SystemExit(f"{rel}: functions not found: {sorted(missing)}")
    return found


def base_ns() -> Dict[str, Any]:
    return {"torch": torch, "re": re, "nn": nn, "F": F, "Optional": Optional, "List": List, "Dict": Dict,
            "Tuple": Tuple, "Union": Union, "Any": Any, "np": __import__("numpy")}


class Orig:
    def __init__(self, root: Path):
        self.root = root
        self.refs: Dict[str, str] = {}
        ns = base_ns()
        for rel, names in [
            (CORE, ["masked_mean", "masked_var", "masked_whiten"]),
            (UTILS, ["first_true_indices", "truncate_response", "score_rule", "bonus_rule"]),
            (CHAT, ["formatting_question", "construct_message_multi_agent", "combine_agent_contexts",
                    "construct_assistant_message"]),
            (DATASET, ["extract_ans_from_response"]),
            (COOP, ["grad_requires_setting", "calculate_reward_from_answer"]),
        ]:
            for name, (fn, a, b) in load_functions(root, rel, names, ns).items():
                setattr(self, name, fn)
                self.refs[name] = f"{rel}:{a}-{b}"
        # calculate_reward_from_answer does `from utils.dataset import extract_ans_from_response` inside:
        # serve it the original function extracted above (utils/dataset.py imports `datasets` at top level).
        pkg = types.ModuleType("utils")
        pkg.__path__ = []  # a package
        mod = types.ModuleType("utils.dataset")
        mod.extract_ans_from_response = self.extract_ans_from_response
        sys.modules["utils"] = pkg
        sys.modules["utils.dataset"] = mod
        check_trainer_lines(root)


def check_trainer_lines(root: Path) -> None:
    """Fail loudly if the trainer lines transcribed below are not where (and what) they are expected to be."""
    lines = (root / TRAINER).read_text().splitlines()
    expect = {
        1181: 'final_answer_str = f"Answer: \\\\boxed{{{answer[q]}}}"',
        1210: 'modified_response = re.sub(r"\\\\boxed{(.*?)}", r"\\1", modified_response)',
        1293: "modified_response = re.sub(r'[^a-zA-Z}]+$', '', modified_response)",
        1432: "agent_contexts_set[q][agent].append({'role': 'user', 'content': f\"Reward from a verifier of your answer: {score_value:.3f} out of 1.0, which means {feedback}\"})",
        1506: "padding_mask = response_idxs > sequence_lengths.unsqueeze(1)",
        1634: "actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths)",
        1671: "lastgaelam = delta + args.gamma * args.lam * lastgaelam",
        1690: "advantages = masked_whiten(advantages, ~padding_mask)",
    }
    for n, text in expect.items():
        got = lines[n - 1].strip()
        if got != text:
            raise SystemExit(f"{TRAINER}:{n} is not the expected line (wrong commit?)\n  expected: {text}\n  got:      {got}")


# --------------------------------------------------------------------------------------------------
# Trainer transcriptions
# --------------------------------------------------------------------------------------------------

def trainer_feedback_message(score_value: float) -> str:
    """Transcribes trainer 1421-1432: the own-score user message appended after each answer (reward_feedback)."""
    if score_value < 0.3:
        feedback = "Your answer is highly likely wrong."
    elif score_value < 0.6:
        feedback = "Your answer might be wrong, or your reasoning needs to have a stronger argument."
    elif score_value < 0.8:
        feedback = "Your answer seems right, but check your reasoning again, there might be some room for improvement."
    else:
        feedback = "Your answer is likely right with high probability."
    return f"Reward from a verifier of your answer: {score_value:.3f} out of 1.0, which means {feedback}"


def trainer_boxed_rewrite(o: Orig, dataset_name: str, decoded_response_raw: str) -> Tuple[Any, str]:
    """Transcribes trainer 1121 + 1169-1172 + 1180-1217 (not open-ended, answer_detecting False):
    returns (answer, modified_response)."""
    decoded_response = decoded_response_raw.strip()  # 1121: decode(..., skip_special_tokens=True).strip()
    answer = o.extract_ans_from_response(dataset_name, decoded_response)  # 1169-1172
    final_answer_str = f"Answer: \\boxed{{{answer}}}"
    modified_response = decoded_response
    if f"The answer is: {answer}" in decoded_response:
        modified_response = modified_response.replace(f"The answer is: {answer}", final_answer_str)
    if f"The answer is: \\boxed{{{answer}}}" in decoded_response:
        modified_response = modified_response.replace(f"The answer is: \\boxed{{{answer}}}", final_answer_str)
    if f"Answer: {answer}" in decoded_response:
        modified_response = modified_response.replace(f"Answer: {answer}", final_answer_str)
    length_to_check = int(1.5 * len(final_answer_str))
    if len(modified_response) >= length_to_check:
        response_to_check = modified_response[-length_to_check:]
    else:
        response_to_check = modified_response
    if answer != "invalid":
        if final_answer_str not in response_to_check:
            modified_response = re.sub(r"\\boxed{(.*?)}", r"\1", modified_response)
            if modified_response.endswith(f"\n{answer}"):
                modified_response = modified_response.rstrip(f"\n{answer}")  # str.rstrip: a CHARACTER SET
            if modified_response.endswith("\n"):
                modified_response = modified_response.rstrip("\n")
            modified_response = f"{modified_response}" + "\n\n" + f"{final_answer_str}"
    return answer, modified_response


def trainer_verifier_text(o: Orig, dataset_name: str, modified_response: str) -> str:
    """Transcribes trainer 1274-1293: the clean-up of the rewritten answer before the verifier scores it."""
    if modified_response.endswith("<|im_end|>"):
        modified_response = modified_response[:-len("<|im_end|>")].strip()
    if modified_response.startswith("model"):
        modified_response = modified_response[len("model"):].strip()
    if modified_response.startswith("<|im_start|>"):
        modified_response = modified_response[len("<|im_start|>"):].strip()
    if modified_response.startswith("assistant"):
        modified_response = modified_response[len("assistant"):].strip()
    if modified_response.startswith("<|im_start|>assistant"):
        modified_response = modified_response[len("<|im_start|>assistant"):].strip()
    if o.extract_ans_from_response(dataset_name, modified_response) != "invalid":
        modified_response = re.sub(r'[^a-zA-Z}]+$', '', modified_response)
    return modified_response


def trainer_masks(o: Orig, responses, logprobs, ref_logprobs, values, pad_token_id, stop_ids):
    """Transcribes trainer 1081-1085 (truncate_response, the original), 1093 and 1504-1510."""
    postprocessed_response = o.truncate_response(stop_ids, pad_token_id, responses)
    sequence_lengths = o.first_true_indices(postprocessed_response == pad_token_id) - 1
    sequence_lengths_p1 = sequence_lengths + 1
    response_idxs = torch.arange(responses.shape[1], device=responses.device).repeat(responses.shape[0], 1)
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))
    logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
    values = torch.masked_fill(values, padding_mask_p1, 0)
    return dict(postprocessed_response=postprocessed_response, sequence_lengths=sequence_lengths,
                sequence_lengths_p1=sequence_lengths_p1, padding_mask=padding_mask,
                padding_mask_p1=padding_mask_p1, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values)


def trainer_rewards_gae(o: Orig, scores, responses, logprobs, ref_logprobs, values, sequence_lengths,
                        sequence_lengths_p1, padding_mask, padding_mask_p1, kl_coef=KL_COEF, gamma=GAMMA,
                        lam=LAM, whiten_rewards=False):
    """Transcribes trainer 1630-1691 for ONE (turn, agent): rewards, GAE, returns, whitening."""
    kl = logprobs - ref_logprobs
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    actual_start = torch.arange(rewards.size(0), device=rewards.device)
    actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths)
    actual_end = torch.clamp(actual_end, 0, rewards.size(1) - 1)
    rewards[actual_start, actual_end] += scores
    if whiten_rewards:
        rewards = o.masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
        rewards = torch.masked_fill(rewards, padding_mask_p1, 0)
    lastgaelam = 0
    advantages_reversed = []
    gen_length = responses.shape[1]
    for t in reversed(range(gen_length)):
        if t < gen_length - 1:
            nextvalues = values[:, t + 1]
        else:
            nextvalues = torch.zeros_like(values[:, 0], device=values.device)
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    advantages_unwhitened = advantages.clone()
    advantages = o.masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return dict(kl=kl, non_score_reward=non_score_reward, actual_end=actual_end, rewards=rewards,
                advantages_unwhitened=advantages_unwhitened, returns=returns, advantages=advantages)


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------

def tl(x):
    """Tensor -> nested list (floats rounded through float64 repr)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bool:
            return x.tolist()
        if x.dtype.is_floating_point:
            return x.double().tolist()
        return x.tolist()
    return x


def fixture_rewards_gae(o: Orig) -> dict:
    T, A, Q, L = 3, 2, 2, 6
    PAD, END = 0, 3          # pad = eos (Phi-3: <|endoftext|>), END = <|end|>
    stop_ids = [PAD, END]    # trainer 1070-1076: [eos_token_id, <|end|>]
    # Raw sampled responses (the sampler ignores EOS and always emits L tokens; tokens after the first
    # stop token are garbage that truncate_response turns into pad). Cases by (turn, agent, question):
    responses = {
        (0, 0): [[11, 12, 13, END, 21, 22],   # <|end|> at 3: sequence_length 3, score at 4
                 [14, 15, 16, 17, 18, 19]],   # no stop: sequence_length 5, score at 5 (last token)
        (0, 1): [[11, 12, END, 24, 25, 26],   # <|end|> at 2: score at 3
                 [14, 15, 16, 17, 18, END]],  # <|end|> at 5 (last): sequence_length 5, p1 = 6 = L -> score at 5
        (1, 0): [[11, 12, 13, PAD, 27, 28],   # eos == pad at 3: sequence_length 2, score at 3 (the EOS slot)
                 [14, END, 31, 32, 33, 34]],  # <|end|> at 1: score at 2
        (1, 1): [[11, 12, 13, 14, END, 35],   # <|end|> at 4: score at 5
                 [14, 15, 16, END, 36, 37]],
        (2, 0): [[11, 12, 13, 14, 15, 16],    # no stop
                 [14, 15, END, 38, 39, 40]],
        (2, 1): [[11, END, 41, 42, 43, 44],
                 [14, 15, 16, 17, END, 45]],
    }
    g = torch.Generator().manual_seed(1234)
    logprobs, ref_logprobs, values = {}, {}, {}
    for t in range(T):
        for a in range(A):
            # fixed numbers, rounded to 3 decimals so they can be read back exactly
            lp = -torch.rand(Q, L, generator=g, dtype=torch.float64) * 3
            rl = lp + (torch.rand(Q, L, generator=g, dtype=torch.float64) - 0.5) * 0.4
            v = (torch.rand(Q, L, generator=g, dtype=torch.float64) - 0.3)
            logprobs[(t, a)] = torch.round(lp * 1000) / 1000
            ref_logprobs[(t, a)] = torch.round(rl * 1000) / 1000
            values[(t, a)] = torch.round(v * 1000) / 1000
    # s(t, i) per question, after the invalid penalty (trainer 1497-1503): verifier probabilities, one -10.
    raw_scores = {
        (0, 0): [0.912, 0.105], (0, 1): [0.234, 0.871],
        (1, 0): [0.655, -10.0], (1, 1): [0.802, 0.443],
        (2, 0): [0.977, 0.512], (2, 1): [0.031, 0.699],
    }
    # 0/1 correctness (correctnesses_turn_agent, trainer 1520), for bonus_rule's incentives.
    correct = {
        (0, 0): [1, 0], (0, 1): [0, 1],
        (1, 0): [1, 0], (1, 1): [1, 1],
        (2, 0): [1, 1], (2, 1): [0, 1],
    }
    finished_question = [-1] * Q  # consensus never stops a question (criteria 1.1 in every shipped config)
    dtype = torch.float64

    masked = {}
    for key in responses:
        masked[key] = trainer_masks(o, torch.tensor(responses[key]), logprobs[key], ref_logprobs[key],
                                    values[key], PAD, stop_ids)

    out_cases = []
    for alpha in ([0.0, 0.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]):
        scores_turn_agent = {k: torch.tensor(v, dtype=dtype) for k, v in raw_scores.items()}
        correctnesses_turn_agent = {k: torch.tensor(v, dtype=torch.long) for k, v in correct.items()}
        # trainer 1604-1616
        training_scores = {}
        score_parts = {}
        for turn in range(T):
            for agent in range(A):
                scores = o.score_rule("discounted_sum", "all", 0.3, scores_turn_agent, T, A, finished_question,
                                      turn, agent, incentive=True, alpha=alpha, device="cpu")
                bonues = o.bonus_rule(correctnesses_turn_agent, T, A, finished_question, turn, agent,
                                      incentive=False, alpha=alpha, device="cpu")
                scores_bonuses = scores + bonues
                filtered_scores = scores_bonuses[scores != -1]
                training_scores[(turn, agent)] = filtered_scores.to(dtype)
                score_parts[(turn, agent)] = (scores, bonues)
        per = []
        for turn in range(T):
            for agent in range(A):
                m = masked[(turn, agent)]
                r = trainer_rewards_gae(o, training_scores[(turn, agent)], torch.tensor(responses[(turn, agent)]),
                                        m["logprobs"], m["ref_logprobs"], m["values"], m["sequence_lengths"],
                                        m["sequence_lengths_p1"], m["padding_mask"], m["padding_mask_p1"])
                per.append({
                    "turn": turn, "agent": agent,
                    "score_rule": tl(score_parts[(turn, agent)][0]),
                    "bonus": tl(score_parts[(turn, agent)][1]),
                    "training_score": tl(training_scores[(turn, agent)]),
                    "kl": tl(r["kl"]),
                    "actual_end": tl(r["actual_end"]),
                    "rewards": tl(r["rewards"]),
                    "advantages_unwhitened": tl(r["advantages_unwhitened"]),
                    "returns": tl(r["returns"]),
                    "advantages_whitened": tl(r["advantages"]),
                })
        out_cases.append({"alpha": alpha, "per_turn_agent": per})

    inputs = []
    for turn in range(T):
        for agent in range(A):
            m = masked[(turn, agent)]
            inputs.append({
                "turn": turn, "agent": agent,
                "responses": responses[(turn, agent)],
                "logprobs_raw": tl(logprobs[(turn, agent)]),
                "ref_logprobs_raw": tl(ref_logprobs[(turn, agent)]),
                "values_raw": tl(values[(turn, agent)]),
                "score": raw_scores[(turn, agent)],
                "correct": correct[(turn, agent)],
                "postprocessed_response": tl(m["postprocessed_response"]),
                "sequence_lengths": tl(m["sequence_lengths"]),
                "padding_mask": tl(m["padding_mask"]),
                "padding_mask_p1": tl(m["padding_mask_p1"]),
                "logprobs": tl(m["logprobs"]),
                "ref_logprobs": tl(m["ref_logprobs"]),
                "values": tl(m["values"]),
            })
    return {
        "source": {"repo": "chanwoo-park-official/MAPoRL", "commit": COMMIT,
                   "transcribed": [f"{TRAINER}:1081-1093 (truncate + sequence_lengths)",
                                   f"{TRAINER}:1504-1510 (masks)",
                                   f"{TRAINER}:1604-1616 (score_rule + bonus_rule composition)",
                                   f"{TRAINER}:1630-1691 (rewards, GAE, returns, whitening)"],
                   "original_functions": {k: o.refs[k] for k in ["truncate_response", "first_true_indices",
                                                                 "score_rule", "bonus_rule", "masked_whiten",
                                                                 "masked_var", "masked_mean"]}},
        "constants": {"turns": T, "agents": A, "questions": Q, "response_length": L, "pad_token_id": PAD,
                      "end_token_id": END, "stop_token_ids": stop_ids, "kl_coef": KL_COEF, "gamma": GAMMA,
                      "lam": LAM, "invalid_logprob": INVALID_LOGPROB, "rule_horizon": "discounted_sum",
                      "rule_agent_share": "all", "rule_discount": 0.3, "whiten_rewards": False,
                      "whitening": "masked_whiten(advantages, ~padding_mask) per (turn, agent) over its questions; "
                                   "unbiased variance, (x - mean) * rsqrt(var + 1e-8)"},
        "notes": [
            "sequence_length = first index of pad in the truncated response, minus 1 (truncate_response keeps "
            "the stop token and pads after it). Stop token != pad (<|end|>): sequence_length = index of the stop "
            "token; the score lands at sequence_length + 1 (the first padded slot) if that is < L, else at "
            "sequence_length. Stop token == pad (eos): sequence_length = index before it, the score lands on the "
            "EOS slot. No stop token: sequence_length = L-1, the score lands on the last token.",
            "logprobs/ref_logprobs are filled with 1.0 where padding_mask (idx > sequence_length), so KL is 0 "
            "there; values are zeroed where padding_mask_p1 (idx > sequence_length + 1).",
            "returns = advantages (unwhitened) + values; advantages whitened over ~padding_mask then zeroed on "
            "padding_mask (the score slot sequence_length+1 is outside the whitening mask but inside the value "
            "loss mask ~padding_mask_p1).",
        ],
        "inputs": inputs,
        "cases": out_cases,
    }


def fixture_value_head(o: Orig) -> dict:
    H = 8
    seed = 42
    torch.manual_seed(seed)
    head = nn.Linear(H, 1, bias=False)  # utils/utils_model.py:182 (created after set_seed(42), train script :226)
    g = torch.Generator().manual_seed(7)
    hidden = torch.round((torch.rand(2, 3, H, generator=g) * 2 - 1) * 1000) / 1000
    with torch.no_grad():
        out = head(hidden)  # utils_multi_unified.get_reward: value_head(output.hidden_states[-1])

    # grad_requires_setting (original) on a module tree with the names the trainer's model has:
    # model = accelerator.prepare(PolicyAndValueWrapper(policy, value_heads)) -> "module.policy...." and
    # "module.value_heads_{t}.weight" (trainer 132-166, 463, 536).
    def make_model(adapters: List[str], turns: int) -> nn.Module:
        root = nn.Module()
        wrapper = nn.Module()
        root.add_module("module", wrapper)
        policy = nn.Module()
        wrapper.add_module("policy", policy)
        layer = nn.Module()
        policy.add_module("q_proj", layer)
        layer.register_parameter("base_layer_weight", nn.Parameter(torch.zeros(2, 2)))
        for kind in ("lora_A", "lora_B"):
            d = nn.Module()
            layer.add_module(kind, d)
            for ad in adapters:
                sub = nn.Module()
                sub.register_parameter("weight", nn.Parameter(torch.zeros(2, 2)))
                d.add_module(ad, sub)
        for t in range(turns):
            wrapper.add_module(f"value_heads_{t}", nn.Linear(2, 1, bias=False))
        return root

    T = 3
    combos = []
    for policy_separation, collaboration_separation, task_training in [
        (True, True, False),   # "policy" (turn 0) + "col" (turns >= 1): the noverifier config's layout
        (True, False, True),   # per-turn policy_{t}: what the *_turn configs resolve to (their line 94-96)
        (True, False, False),
        (False, True, False),  # the reloadF/reloadT configs as resolved (ModelManager raises on this)
        (False, False, True),
    ]:
        if policy_separation and not collaboration_separation:
            adapters = [f"policy_{t}" for t in range(T)]
        elif policy_separation and collaboration_separation:
            adapters = ["policy", "col"]
        else:
            adapters = ["policy"]
        adapters = adapters + [f"value_{t}" for t in range(T)] + ["ref"]
        model = make_model(adapters, T)
        for p in model.parameters():
            p.requires_grad = True  # nn defaults / PEFT marks adapters trainable
        o.grad_requires_setting(model, task_training, policy_separation, collaboration_separation)
        combos.append({
            "policy_separation": policy_separation, "collaboration_separation": collaboration_separation,
            "task_training": task_training,
            "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
            "frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad),
        })

    return {
        "source": {"repo": "chanwoo-park-official/MAPoRL", "commit": COMMIT,
                   "value_head": "utils/utils_model.py:180-183 nn.Linear(policy.config.hidden_size, 1, bias=False)",
                   "applied": "trl/trl/trainer/utils_multi_unified.py:1009-1012 (get_reward)",
                   "grad_requires_setting": o.refs["grad_requires_setting"]},
        "hidden_size": H, "seed": seed,
        "init": "torch.nn.Linear default: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(H), 1/sqrt(H)), no bias; "
                "drawn here right after torch.manual_seed(seed) (the original draws it after loading the model "
                "and adding adapters, so its actual numbers cannot be reproduced outside that run)",
        "bound": 1 / math.sqrt(H),
        "weight": tl(head.weight),
        "hidden_states": tl(hidden),
        "values": tl(out.squeeze(-1)),
        "grad_requires_setting": combos,
        "notes": ["The value heads have no 'lora' in their names, so grad_requires_setting freezes them in "
                  "every configuration: the critic is LoRA adapter value_{t} (trained) + a random, frozen linear "
                  "head."],
    }


def build_discussion(o: Orig, question: str, model_name: str, reward_feedback: bool, answers, scores) -> dict:
    """Transcribes the rollout's context bookkeeping for ONE question (trainer 832, 840-866, 948-963,
    1271-1302, 1410-1432), with answers[t][i] the decoded response of agent i at turn t and scores[t][i]
    its verifier score."""
    dataset_name = "GSM8k"
    T, A = len(answers), len(answers[0])
    question_text_set = [question]
    agent_contexts_set = [[[{"role": "user", "content": o.formatting_question(dataset_name, model_name, text)}]
                           for agent in range(A)] for text in question_text_set]  # 832
    raw_agent_context_set = []
    chats, followups, verifier_queries, shown = [], [], [], []
    for turn in range(T):
        for agent in range(A):
            if turn != 0:  # 865-952
                agent_contexts_other_set = [agent_contexts[:agent] + agent_contexts[agent + 1:]
                                            for agent_contexts in agent_contexts_set]
                for q in range(len(question_text_set)):
                    message = o.construct_message_multi_agent(
                        agent_contexts_other_set[q],
                        o.formatting_question(dataset_name, model_name, question_text_set[q]),
                        turn, dataset_name, reward_feedback)
                    agent_contexts_set[q][agent].append(message)
                    followups.append({"turn": turn, "agent": agent, "content": message["content"]})
            agent_context_set = o.combine_agent_contexts(agent_contexts_set, agent, turn, reward_feedback)  # 954
            if turn == 0:
                raw_agent_context_set.append([list(c) for c in agent_context_set])  # 962-963
            chats.append({"turn": turn, "agent": agent, "messages": agent_context_set[0]})
            # generation, then the rewrite and the verifier query (1120-1302)
            answer, modified = trainer_boxed_rewrite(o, dataset_name, answers[turn][agent])
            current_raw_agent_context = raw_agent_context_set[agent][0][0]["content"]  # 1273
            verifier_queries.append({"turn": turn, "agent": agent, "query": [
                {"role": "user", "content": current_raw_agent_context},
                {"role": "assistant", "content": trainer_verifier_text(o, dataset_name, modified)}]})
            shown.append({"turn": turn, "agent": agent, "answer": answer, "text": modified})
            # 1410-1432: the (re-tokenized) rewritten text, then the own-score message
            agent_contexts_set[0][agent].append(o.construct_assistant_message(modified))
            if reward_feedback:
                agent_contexts_set[0][agent].append({"role": "user",
                                                     "content": trainer_feedback_message(scores[turn][agent])})
    return {"reward_feedback": reward_feedback, "model_name": model_name, "chats": chats,
            "followup_messages": followups, "verifier_queries": verifier_queries, "shown_answers": shown,
            "final_agent_contexts": agent_contexts_set[0]}


def fixture_followup(o: Orig) -> dict:
    question = ("Tom has 3 boxes with 12 pencils each. He gives away 7 pencils. "
                "How many pencils does he have left?")
    answers = [
        ["3 boxes times 12 pencils is 36 pencils. 36 - 7 = 29.\n\nAnswer: \\boxed{29}",
         "He has 3 * 12 = 36 pencils and gives away 7, so 36 - 7 = 28.\nThe answer is: 28"],
        ["Agent 1 got 28 but 36 - 7 = 29. So the answer is 29.\n\nAnswer: \\boxed{29}",
         "I recheck: 36 - 7 = 29, I was wrong before.\n\nAnswer: 29"],
        ["We agree: 36 - 7 = 29.\n\nAnswer: \\boxed{29}",
         "Both agents now say 29 pencils. \\boxed{29} pencils"],
    ]
    scores = [[0.912, 0.234], [0.655, 0.802], [0.977, 0.512]]
    out = {
        "source": {"repo": "chanwoo-park-official/MAPoRL", "commit": COMMIT,
                   "original_functions": {k: o.refs[k] for k in ["formatting_question",
                                                                 "construct_message_multi_agent",
                                                                 "combine_agent_contexts",
                                                                 "construct_assistant_message"]},
                   "transcribed": [f"{TRAINER}:832, 840-866, 948-963 (contexts)",
                                   f"{TRAINER}:1120-1217 (rewrite)", f"{TRAINER}:1271-1302 (verifier query)",
                                   f"{TRAINER}:1410-1432 (assistant message + own-score message)"]},
        "question": question, "answers": answers, "scores": scores,
        "feedback_thresholds": "score < 0.3 | < 0.6 | < 0.8 | else; formatted {score:.3f}",
        "discussions": [],
    }
    for model_name in ("microsoft/Phi-3-mini-128k-instruct", "Qwen/Qwen2.5-3B-Instruct"):
        for rf in (True, False):
            out["discussions"].append(build_discussion(o, question, model_name, rf, answers, scores))
    return out


def fixture_boxed(o: Orig) -> dict:
    cases = [
        ("already boxed at the end", "3 * 12 = 36, 36 - 7 = 29.\n\nAnswer: \\boxed{29}", 29),
        ("'The answer is: x'", "3 * 12 = 36, 36 - 7 = 29.\nThe answer is: 29", 29),
        ("'The answer is: \\boxed{x}'", "36 - 7 = 29. The answer is: \\boxed{29}", 29),
        ("'Answer: x' without box", "36 - 7 = 29\n\nAnswer: 29", 29),
        ("box mid-text, then more text", "So \\boxed{29} is what I get. Let me double check the numbers once more to be sure about it.", 29),
        ("no box: every digit of the text concatenated", "The total is 129\n29", 29),
        ("no box, '.' or '-' in the text -> invalid", "36 - 7 = 9\n9", 9),
        ("box, then bare answer on the last line (rstrip is a character set)",
         "So it is \\boxed{29}. Check: 129\n29", 29),
        ("two boxes, last wins", "First \\boxed{28}, corrected: \\boxed{29}", 29),
        ("box with units and comma", "Total cost is \\boxed{$1,250}", 1250),
        ("negative answer", "The change is -4 degrees.\nAnswer: \\boxed{-4}.", -4),
        ("decimal inside box (int() fails -> invalid)", "It is \\boxed{2.5} kg", 3),
        ("no number at all", "I cannot solve this problem.", 29),
        ("trailing whitespace and period", "  36 - 7 = 29.\n\nAnswer: \\boxed{29}.\n\n  ", 29),
        ("chat markers (verifier clean-up)", "assistant 36 - 7 = 29.\n\nAnswer: \\boxed{29}<|im_end|>", 29),
        ("ANSWER spacing variant", "36-7=29\nAnswer:\\boxed{29}", 29),
    ]
    rows = []
    for label, text, truth in cases:
        answer, modified = trainer_boxed_rewrite(o, "GSM8k", text)
        vtext = trainer_verifier_text(o, "GSM8k", modified)
        correctness = o.calculate_reward_from_answer(
            "GSM8k", [[{"role": "user", "content": "q"}, {"role": "assistant", "content": vtext}]], [truth])
        rows.append({"case": label, "response": text, "ground_truth": truth,
                     "answer": answer, "rewritten": modified, "verifier_text": vtext,
                     "has_box_for_penalty": bool(re.compile(r"\\boxed{.*?}").search(text)),
                     "correct": int(correctness[0])})
    return {
        "source": {"repo": "chanwoo-park-official/MAPoRL", "commit": COMMIT,
                   "original_functions": {k: o.refs[k] for k in ["extract_ans_from_response",
                                                                 "calculate_reward_from_answer"]},
                   "transcribed": [f"{TRAINER}:1121, 1169-1172, 1180-1217 (rewrite)",
                                   f"{TRAINER}:1274-1293 (verifier clean-up)",
                                   f"{TRAINER}:1479-1488 (box check of the penalty, on the ORIGINAL response)"]},
        "regexes": {"boxed_extract": r"\\boxed\{(.*?)\}", "gsm8k_keep": r"[^0-9\-\.]",
                    "unbox": r"\\boxed{(.*?)} -> \1", "verifier_trailing": r"[^a-zA-Z}]+$",
                    "penalty_box": r"\\boxed{.*?}"},
        "cases": rows,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--maporl", required=True, type=Path, help="checkout of chanwoo-park-official/MAPoRL at c204c2c")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "learner/tests/fixtures/maporl")
    args = ap.parse_args()
    torch.set_num_threads(2)
    o = Orig(args.maporl)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, fn in [("rewards_gae.json", fixture_rewards_gae), ("value_head.json", fixture_value_head),
                     ("followup_prompt.json", fixture_followup), ("boxed_rewrite.json", fixture_boxed)]:
        data = fn(o)
        (args.out / name).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()

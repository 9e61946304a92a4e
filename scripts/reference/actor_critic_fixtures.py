#!/usr/bin/env python3
"""Reference values from the ORIGINAL CoMLRL IAC / MAAC trainer code, for cotrain's actor-critic tests:
`learner/tests/fixtures/actor_critic/upstream.json`.

What it runs
------------
The unmodified methods of CoMLRL's actor-critic trainers, imported from an extracted wheel, with stubs
only for what needs a model (generation, forward passes, tokenizer), the optimizers and the reward
function. Nothing of the math is re-implemented here; the script only builds inputs, calls the
original code and reads what it produced (then checks it against the closed forms, see `check_*`).

  advantages    ActorCriticTrainerBase._prepare_advantages on one (agent, turn) group of RolloutSample
                objects (self = SimpleNamespace(args=SimpleNamespace(advantage_normalization=...))).
  td_targets    IACTrainer._collect_rollouts_multi_turn and MAACTrainer._collect_rollouts_multi_turn on
                an object made with `__new__` (no __init__: that would load models). Runs the original
                turn loop, external transition plumbing (_resolve_turn_prompt / build_formatters),
                call_reward_function, normalize_reward_lengths, the reward processor
                (RewardProcessors.shift), _expand_rewards, _kl_shaped_reward (KL off), early termination
                and the TD-target / returns tail. Stubbed: IAC `_generate_rollout` (returns fixed
                token ids and the scripted old value V(h_t) per (turn, agent)); MAAC `_generate` and
                `_policy_eval` (fixed ids, log-prob -1). For MAAC the ORIGINAL `_critic_value_from_text`
                -> `_encode_prompt` -> `_value_on_prompt_only` runs, against a stub tokenizer (bytes of
                the text) and a stub critic model whose `.values` holds the scripted joint value at the
                last position (and 1e9 elsewhere, so a wrong index would show).
  critic_input  MAACTrainer._build_critic_input (self = SimpleNamespace(args=SimpleNamespace(critic_type))).
  ac_step       IACTrainer._ac_step / MAACTrainer._ac_step on one mini-batch of 3 RolloutSample, with
                `_policy_eval` and `_value_for_critic_type` (IAC) / `_value_on_prompt_only` (MAAC)
                stubbed to return fresh leaf tensors (requires_grad) and no-op optimizers; the
                gradients are read from the leaves' .grad after the original backward() calls.
                policy_loss / value_loss are the original locals `actor_loss` / `value_loss`, read
                from the `_ac_step` frame at its return through sys.setprofile.

Upstream version
----------------
  package   comlrl 1.4.3 (PyPI wheel comlrl-1.4.3-py3-none-any.whl,
            sha256 1deee16d61b2ed046137f12fe53f6d7203cbc9854a77bb75b45dc7c5e1e16cb6), extracted:
              pip download comlrl==1.4.3 --no-deps -d /tmp/iacspec_scratch
              cd /tmp/iacspec_scratch && python -m zipfile -e comlrl-1.4.3-py3-none-any.whl whl
            The directory must hold `comlrl/` and `comlrl-1.4.3.dist-info/` (comlrl/__init__.py calls
            importlib.metadata.version("comlrl")). Every file of `comlrl/` is checked against the
            sha256 in the wheel's RECORD before anything runs; if the .whl file itself lies next to
            the directory, its sha256 is checked too.
  files     comlrl/trainers/actor_critic/ac_base.py  (_prepare_advantages, _expand_rewards,
                                                      _kl_shaped_reward, _value_on_prompt_only,
                                                      _resolve_turn_prompt, _encode_prompt, _run_agent_tasks)
            comlrl/trainers/actor_critic/iac.py      (_collect_rollouts_multi_turn, _ac_step)
            comlrl/trainers/actor_critic/maac.py     (_collect_rollouts_multi_turn, _build_critic_input,
                                                      _critic_value_from_text, _ac_step)
            comlrl/utils/reward_utils.py, reward_processor.py, formatters.py

Running
-------
  ~/.cache/cotrain/bench-venv/bin/python scripts/reference/actor_critic_fixtures.py \
      [--wheel-dir /tmp/iacspec_scratch/whl] [--out learner/tests/fixtures/actor_critic/upstream.json]
  (run from the repository root; `COMLRL_WHEEL_DIR` may replace --wheel-dir). Needs torch (run with
  2.13), numpy, tqdm and transformers (5.24) importable; about 5 s on CPU, no GPU, no network.

  Importing comlrl needs `wandb` and `datasets`, which that venv lacks. If they cannot be imported, the
  script puts minimal stub modules into sys.modules before importing comlrl (after importing the
  transformers classes comlrl uses, because transformers/accelerate probe for wandb with find_spec) (`wandb`: log/init/finish/
  Html/run=None; `datasets`: empty classes Dataset, IterableDataset). Neither is used by the code run here.

Dtypes
------
  Upstream casts some values itself and those casts are kept (recorded values are what it produced):
  * _prepare_advantages computes `target.float32 - old_value.float32`, stores it in the dtype of
    `sample.returns`, and normalises in float32. The stubs give targets, old values and returns as
    float64 tensors, so `advantages` are float32 differences widened to float64 and `normalized` are
    float32 (with normalize=false: the float64 copy of the advantage).
  * In the multi-turn collection upstream stores rewards as float32 (`torch.tensor([r], float32)`),
    computes `target = r + discount * next_v` in Python floats from that float32 reward and the stubbed
    old value, and stores the target as `torch.tensor([target])` (default dtype float32); returns are
    float32 too. The stubbed old values are float64 tensors. So `value_target`, `adv_target`, `returns`
    and `reward` are float32 values (written as the float64 numbers they equal), while `values` and
    `raw_rewards` are exact float64 inputs.
  * _ac_step: the leaf tensors (log-prob sums, values), old values, value targets and normalized
    advantages are all float64, so policy_loss, value_loss and the gradients are float64.
  The torch default dtype is left at float32, as upstream expects.

Output
------
  source        package, version, wheel_sha256, script
  advantages    [{normalize, targets, old_values, advantages, normalized}]  one group each; n = 1, 2 equal,
                2 different, 5, 5 with normalize off
  td_targets    [{trainer, critic_type, num_agents, num_turns, discount, early_termination_threshold,
                  reward_shift, raw_rewards[turn] (the 1-element list the reward function returned),
                  values[turn][agent] (stubbed old values; MAAC: the joint value repeated per agent),
                  turns_played, value_target / adv_target / returns / reward [agent][turn]}]
                cases: IAC 3 turns gamma 0.9; IAC gamma 1 stopped early after turn index 1 (threshold
                -0.2, processed mean -0.15); MAAC 3 turns gamma 0.9; MAAC 2 turns gamma 1 whose turn-0
                mean equals the threshold exactly (strict `>`: no stop)
  critic_input  [{critic_type, prompts, completions or null, text}]  2 and 3 agents, newlines, an empty
                completion, and a "v" case given completions (ignored)
  ac_step       [{trainer, use_separate_critic, value_clip_range, value_loss_coef, samples[{logprob_sum,
                  value, old_value, value_target, normalized_advantage}], policy_loss, value_loss
                  (before the coefficient), grad_logprob_sum, grad_value (d total loss / d leaf, so
                  grad_value includes value_loss_coef)}]
                cases: IAC separate critic (clip 0.2 given but ignored), IAC shared head clip 0.2 (one
                sample inside the range, one clipped branch -> zero value gradient, one outside the
                range where the unclipped error is larger), IAC shared head no clip, MAAC.
  Every entry is checked against the closed forms (A = f32(y) - f32(v_old), population-std
  normalisation, y_t = r'_t + gamma V(h_{t+1}), y_last = r'_last, undiscounted returns,
  dL/dlp = -A/B, dL/dv = coef 2 (v - y)/B or 0 on the clipped branch) before the file is written.
"""

import argparse
import base64
import csv
import hashlib
import inspect
import json
import math
import os
import struct
import sys
import types
from pathlib import Path

WHEEL_SHA256 = "1deee16d61b2ed046137f12fe53f6d7203cbc9854a77bb75b45dc7c5e1e16cb6"
VERSION = "1.4.3"
SCRIPT = "scripts/reference/actor_critic_fixtures.py"
DEFAULT_WHEEL_DIR = "/tmp/iacspec_scratch/whl"
DEFAULT_OUT = "learner/tests/fixtures/actor_critic/upstream.json"

NS = types.SimpleNamespace


# --------------------------------------------------------------------------------------------------
# Loading the upstream package
# --------------------------------------------------------------------------------------------------

def verify_wheel_dir(wheel_dir: Path) -> None:
    """Check every comlrl/ file against the sha256 in the wheel's RECORD (and the .whl if present)."""
    record = wheel_dir / f"comlrl-{VERSION}.dist-info" / "RECORD"
    if not record.is_file():
        sys.exit(f"{record} not found: --wheel-dir must be the extracted comlrl {VERSION} wheel")
    checked = 0
    with record.open(newline="") as fh:
        for row in csv.reader(fh):
            if not row or not row[0].startswith("comlrl/") or not row[1]:
                continue
            algo, _, want = row[1].partition("=")
            data = (wheel_dir / row[0]).read_bytes()
            got = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
            if got != want:
                sys.exit(f"{row[0]} differs from the wheel RECORD ({got} != {want})")
            checked += 1
    if checked == 0:
        sys.exit("RECORD lists no comlrl/ files")
    whl = wheel_dir.parent / f"comlrl-{VERSION}-py3-none-any.whl"
    if whl.is_file():
        got = hashlib.sha256(whl.read_bytes()).hexdigest()
        if got != WHEEL_SHA256:
            sys.exit(f"{whl}: sha256 {got} != {WHEEL_SHA256}")
    print(f"verified {checked} comlrl files against RECORD", file=sys.stderr)


def install_stub_modules() -> None:
    """Minimal `wandb` / `datasets` stand-ins, only when the real ones are not importable."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        wandb = types.ModuleType("wandb")
        wandb.run = None
        wandb.log = lambda *a, **k: None
        wandb.init = lambda *a, **k: None
        wandb.finish = lambda *a, **k: None
        wandb.Html = lambda *a, **k: None
        sys.modules["wandb"] = wandb
        print("stubbed module: wandb", file=sys.stderr)
    try:
        import datasets  # noqa: F401
    except ImportError:
        datasets = types.ModuleType("datasets")
        datasets.Dataset = type("Dataset", (), {})
        datasets.IterableDataset = type("IterableDataset", (), {})
        sys.modules["datasets"] = datasets
        print("stubbed module: datasets", file=sys.stderr)


def import_upstream(wheel_dir: Path):
    sys.path.insert(0, str(wheel_dir))
    # Load the transformers pieces comlrl uses BEFORE stubbing: transformers/accelerate probe for
    # wandb with importlib.util.find_spec, which fails on a stub module (its __spec__ is None).
    import transformers  # noqa: F401
    from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedModel,  # noqa: F401
                              PreTrainedTokenizerBase)
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions  # noqa: F401
    install_stub_modules()
    import comlrl
    from comlrl.trainers.actor_critic.ac_base import ActorCriticTrainerBase
    from comlrl.trainers.actor_critic.iac import IACConfig, IACTrainer, RolloutSample
    from comlrl.trainers.actor_critic.maac import MAACConfig, MAACTrainer
    from comlrl.utils.formatters import build_formatters
    from comlrl.utils.reward_processor import RewardProcessors

    if Path(comlrl.__file__).resolve().parent != (wheel_dir / "comlrl").resolve():
        sys.exit(f"imported comlrl from {comlrl.__file__}, not from {wheel_dir}")
    if comlrl.__version__ != VERSION:
        sys.exit(f"comlrl version {comlrl.__version__} != {VERSION}")
    return NS(
        ActorCriticTrainerBase=ActorCriticTrainerBase,
        IACConfig=IACConfig,
        IACTrainer=IACTrainer,
        RolloutSample=RolloutSample,
        MAACConfig=MAACConfig,
        MAACTrainer=MAACTrainer,
        build_formatters=build_formatters,
        RewardProcessors=RewardProcessors,
    )


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------

def scalar(t) -> float:
    return float(t.detach().reshape(-1)[0].item())


def f32(x: float) -> float:
    """x rounded to the nearest float32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def make_sample(U, torch, agent_idx=0, **kw):
    """A RolloutSample with dummy token fields; kw fills old_value/returns/metadata/... ."""
    fields = dict(
        agent_idx=agent_idx,
        prompt="p",
        completion="c",
        full_input_ids=torch.tensor([5, 6, 7, 8, 9], dtype=torch.long),
        attention_mask=torch.ones(5, dtype=torch.long),
        prompt_len=3,
        response_len=2,
        old_logprob=torch.tensor([-1.0], dtype=torch.float64),
        old_value=torch.tensor([0.0], dtype=torch.float64),
        reward=torch.tensor([0.0], dtype=torch.float64),
        returns=torch.tensor([0.0], dtype=torch.float64),
        advantage=torch.tensor([0.0], dtype=torch.float64),
        normalized_advantage=None,
        metadata={},
    )
    fields.update(kw)
    return U.RolloutSample(**fields)


# --------------------------------------------------------------------------------------------------
# 1. ActorCriticTrainerBase._prepare_advantages
# --------------------------------------------------------------------------------------------------

ADVANTAGE_CASES = [
    # normalize, targets, old_values
    (True, [0.7314], [-0.2861]),                                   # n = 1: not normalised
    (True, [1.328125, -0.453125], [0.90625, -0.875]),              # n = 2, equal advantages (exact dyadics)
    (True, [0.5372, -1.2046], [0.1183, -0.3391]),                  # n = 2, different
    (True, [1.0473, -0.3318, 2.2195, 0.0862, -1.4427],
           [0.3126, 0.1947, 1.0381, -0.5712, -0.8349]),            # n = 5
    (False, [1.0473, -0.3318, 2.2195, 0.0862, -1.4427],
            [0.3126, 0.1947, 1.0381, -0.5712, -0.8349]),           # n = 5, normalize off
]


def case_advantages(U, torch):
    out = []
    for normalize, targets, olds in ADVANTAGE_CASES:
        samples = []
        for y, v in zip(targets, olds):
            yt = torch.tensor([y], dtype=torch.float64)
            samples.append(make_sample(
                U, torch,
                old_value=torch.tensor([v], dtype=torch.float64),
                returns=yt.clone(),
                metadata={"adv_target": yt.clone(), "value_target": yt.clone()},
            ))
        U.ActorCriticTrainerBase._prepare_advantages(
            NS(args=NS(advantage_normalization=normalize)), samples)
        entry = {
            "normalize": normalize,
            "targets": [float(y) for y in targets],
            "old_values": [float(v) for v in olds],
            "advantages": [scalar(s.advantage) for s in samples],
            "normalized": [scalar(s.normalized_advantage) for s in samples],
        }
        check_advantages(entry)
        out.append(entry)
    return out


def check_advantages(e):
    adv = [f32(f32(y) - f32(v)) for y, v in zip(e["targets"], e["old_values"])]
    require(e["advantages"] == adv, f"advantages {e['advantages']} != {adv}")
    n = len(adv)
    if e["normalize"] and n > 1:
        mu = sum(adv) / n
        sd = max(math.sqrt(sum((a - mu) ** 2 for a in adv) / n), 1e-6)
        want = [(a - mu) / sd for a in adv]
        tol = 1e-6 if sd > 1e-3 else 1e-2
        for g, w in zip(e["normalized"], want):
            require(abs(g - w) <= tol * max(1.0, abs(w)), f"normalized {e['normalized']} != {want}")
    else:
        require(e["normalized"] == adv, "un-normalised advantages must be copied")


# --------------------------------------------------------------------------------------------------
# 2. Multi-turn TD targets (_collect_rollouts_multi_turn)
# --------------------------------------------------------------------------------------------------

TD_CASES = [
    dict(trainer="iac", num_turns=3, discount=0.9, early_termination_threshold=None,
         reward_shift=-1.5, raw_rewards=[0.83, 2.41, 1.67],
         values=[[0.412, -0.267], [1.138, 0.954], [-0.356, 0.721]]),
    # processed mean reward: turn 0 = -2.7 (not > -0.2), turn 1 = -0.15 (> -0.2) -> stop after 2 turns
    dict(trainer="iac", num_turns=3, discount=1.0, early_termination_threshold=-0.2,
         reward_shift=-4.0, raw_rewards=[1.3, 3.85, 2.2],
         values=[[-1.734, -2.118], [-0.472, -0.391], [-0.083, -0.127]]),
    dict(trainer="maac", num_turns=3, discount=0.9, early_termination_threshold=None,
         reward_shift=0.5, raw_rewards=[-0.62, 0.174, 1.093],
         values=[0.338, -0.471, 0.825]),
    # processed mean at turn 0 is exactly -0.25 == threshold: the strict `>` does not stop
    dict(trainer="maac", num_turns=2, discount=1.0, early_termination_threshold=-0.25,
         reward_shift=-2.0, raw_rewards=[1.75, 1.4375],
         values=[-0.6183, -0.2457]),
]


class StubTokenizer:
    """Callable like a HF tokenizer on one string: one token per UTF-8 byte."""

    def __call__(self, text, return_tensors=None, truncation=None):
        import torch

        ids = torch.tensor([list(text.encode("utf-8"))], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class StubCritic:
    """Callable like CausalLMWithValueHead; the scripted value sits at the last position."""

    def __init__(self, values, seen):
        self.values = list(values)
        self.seen = seen  # list of input lengths, one per call

    def __call__(self, input_ids, attention_mask=None, output_values=True):
        import torch

        t = len(self.seen)
        T = input_ids.size(1)
        vals = torch.full((1, T), 1e9, dtype=torch.float64)
        vals[0, T - 1] = self.values[t]
        self.seen.append(T)
        return NS(values=vals, logits=None)


def run_td_case(U, torch, case):
    N = 2
    trainer_cls = U.IACTrainer if case["trainer"] == "iac" else U.MAACTrainer
    cfg_cls = U.IACConfig if case["trainer"] == "iac" else U.MAACConfig
    t = trainer_cls.__new__(trainer_cls)
    t.args = cfg_cls(num_agents=N, num_turns=case["num_turns"], num_generations=1,
                     discount=case["discount"], critic_type="v",
                     early_termination_threshold=case["early_termination_threshold"])
    t.critic_type = "v"
    t.parallel_training = "none"
    t.formatters = U.build_formatters(None, N)
    t.external_transition = lambda **kw: [
        f"Turn feedback for agent {a}:\nprevious answer was {kw['agent_completions'][a]!r}"
        for a in range(kw["num_agents"])]
    raw_iter = iter(case["raw_rewards"])
    raw_returned = []

    def reward_func(completions_0, completions_1):
        r = next(raw_iter)
        raw_returned.append(r)
        return [r]

    t.reward_func = reward_func
    t._reward_signature = inspect.signature(reward_func)
    t.reward_processor = U.RewardProcessors.shift(case["reward_shift"])
    t.agents = [object() for _ in range(N)]
    t.agent_devices = [torch.device("cpu")] * N
    t.device = torch.device("cpu")
    calls = {a: 0 for a in range(N)}
    values_used = []  # per turn, per agent (old value given to the sample)

    def ids_for(prompt_len):
        return torch.arange(1, prompt_len + 3, dtype=torch.long).unsqueeze(0)

    if case["trainer"] == "iac":
        def fake_generate_rollout(self, agent_model, prompt, agent_idx, num_ret=1):
            turn = calls[agent_idx]
            calls[agent_idx] += 1
            v = case["values"][turn][agent_idx]
            if agent_idx == 0:
                values_used.append([])
            values_used[turn].append(v)
            P = 3
            seq = ids_for(P)
            return {"prompt": prompt, "prompt_len": P, "sequences": seq,
                    "attention_mask": torch.ones_like(seq), "response_lens": [2],
                    "logprobs": [torch.tensor(-1.0, dtype=torch.float64)], "reference_kls": [],
                    "values": torch.tensor([v], dtype=torch.float64),
                    "completions": [f"completion of agent {agent_idx} at turn {turn}"]}

        t._generate_rollout = types.MethodType(fake_generate_rollout, t)
    else:
        seen = []
        t.tokenizer = StubTokenizer()
        t.tokenizers = [t.tokenizer] * N
        t.critic_device = torch.device("cpu")
        t.critics = [StubCritic(case["values"], seen)]
        critic_texts = []
        orig_build = U.MAACTrainer._build_critic_input

        def recording_build(self, prompts, action_completions=None):
            text = orig_build(self, prompts, action_completions)  # the original, unchanged
            critic_texts.append((list(prompts), text))
            return text

        t._build_critic_input = types.MethodType(recording_build, t)

        def fake_generate(self, agent_model, prompt, agent_idx):
            turn = calls[agent_idx]
            calls[agent_idx] += 1
            P = 3
            seq = ids_for(P)
            return {"prompt": prompt, "prompt_len": P, "sequences": seq,
                    "attention_mask": torch.ones_like(seq), "response_lens": [2],
                    "reference_kls": [],
                    "completions": [f"completion of agent {agent_idx} at turn {turn}"]}

        def fake_policy_eval(self, agent_model, sequences, attention_mask, prompt_len,
                             response_len, output_values=False, completion_loss_mask=None):
            return torch.tensor([-1.0], dtype=torch.float64), None

        t._generate = types.MethodType(fake_generate, t)
        t._policy_eval = types.MethodType(fake_policy_eval, t)

    samples = t._collect_rollouts_multi_turn({"prompt": "Write a haiku about\nsorting."},
                                             case["num_turns"])

    per_agent = [[s for s in samples if s.agent_idx == a] for a in range(N)]
    for a in range(N):
        require([s.metadata["turn_idx"] for s in per_agent[a]] == list(range(len(per_agent[a]))),
                "turn order")
    k = len(per_agent[0])
    if case["trainer"] == "maac":
        require(len(seen) == k, "one critic call per turn")
        for (prompts, text), T in zip(critic_texts, seen):
            want = "\n\n".join(f"[Agent {i}] {p}" for i, p in enumerate(prompts))
            require(text == want, f"critic text {text!r}")
            require(T == len(text.encode("utf-8")), "critic input length")
        values_used = [[case["values"][tt]] * N for tt in range(k)]
        for a in range(N):
            for tt, s in enumerate(per_agent[a]):
                require(scalar(s.old_value) == case["values"][tt], "maac old value")
                require(int(s.metadata["joint_prompt_len"]) == seen[tt], "joint_prompt_len")

    entry = {
        "trainer": case["trainer"],
        "critic_type": "v",
        "num_agents": N,
        "num_turns": case["num_turns"],
        "discount": float(case["discount"]),
        "early_termination_threshold": (None if case["early_termination_threshold"] is None
                                        else float(case["early_termination_threshold"])),
        "reward_shift": float(case["reward_shift"]),
        "raw_rewards": [[float(r)] for r in raw_returned],
        "values": [[float(v) for v in row] for row in values_used],
        "turns_played": k,
        "value_target": [[scalar(s.metadata["value_target"]) for s in per_agent[a]] for a in range(N)],
        "adv_target": [[scalar(s.metadata["adv_target"]) for s in per_agent[a]] for a in range(N)],
        "returns": [[scalar(s.returns) for s in per_agent[a]] for a in range(N)],
        "reward": [[scalar(s.reward) for s in per_agent[a]] for a in range(N)],
    }
    check_td(entry)
    return entry


def check_td(e):
    k, N, g = e["turns_played"], e["num_agents"], e["discount"]
    require(len(e["raw_rewards"]) == k and len(e["values"]) == k, "lengths")
    proc = [f32(r[0] + e["reward_shift"]) for r in e["raw_rewards"]]
    thr = e["early_termination_threshold"]
    for t in range(k - 1):  # no turn before the last one may trip the termination test
        require(thr is None or not (e["raw_rewards"][t][0] + e["reward_shift"] > thr), "early stop")
    if k < e["num_turns"]:
        require(thr is not None and e["raw_rewards"][k - 1][0] + e["reward_shift"] > thr, "stop reason")
    for a in range(N):
        for t in range(k):
            y = proc[t] + g * e["values"][t + 1][a] if t < k - 1 else proc[t]
            require(e["value_target"][a][t] == f32(y), f"value_target a{a} t{t}")
            require(e["adv_target"][a][t] == e["value_target"][a][t], "adv_target")
            require(e["reward"][a][t] == proc[t], "reward")
            fut = 0.0
            for x in reversed(proc[t:]):
                fut = x + fut
            require(e["returns"][a][t] == f32(fut), f"returns a{a} t{t}")


# --------------------------------------------------------------------------------------------------
# 3. MAACTrainer._build_critic_input
# --------------------------------------------------------------------------------------------------

CRITIC_INPUT_CASES = [
    ("v", ["Summarise the text.", "Expand the summary."], None),
    ("q", ["Summarise the text.", "Expand the summary."], ["Short summary.", "A longer\nelaboration."]),
    ("v", ["Line one\nline two\n", "def f(x):\n    return x\n", "  third agent  "], None),
    ("q", ["Line one\nline two\n", "def f(x):\n    return x\n", "  third agent  "],
          ["answer A\n", "", "answer C\n\nwith a blank line"]),
    ("v", ["p0", "p1"], ["c0 is ignored", "c1 is ignored"]),
]


def case_critic_input(U):
    out = []
    for critic_type, prompts, completions in CRITIC_INPUT_CASES:
        text = U.MAACTrainer._build_critic_input(
            NS(args=NS(critic_type=critic_type)), prompts, completions)
        base = "\n\n".join(f"[Agent {i}] {p}" for i, p in enumerate(prompts))
        if critic_type == "v":
            want = base
        else:
            want = base + "\n\n[Joint Action]" + "".join(
                f"\n\n[Agent {i} action]\n{c}" for i, c in enumerate(completions))
        require(text == want, f"critic text {text!r}")
        out.append({"critic_type": critic_type, "prompts": prompts, "completions": completions,
                    "text": text})
    return out


# --------------------------------------------------------------------------------------------------
# 4. _ac_step losses and gradients
# --------------------------------------------------------------------------------------------------

AC_CASES = [
    # separate critic: the clip range is ignored even though |v - v_old| > 0.2
    dict(trainer="iac", use_separate_critic=True, value_clip_range=0.2, samples=[
        dict(logprob_sum=-14.372, value=0.5316, old_value=0.1182, value_target=0.8427,
             normalized_advantage=1.2174),
        dict(logprob_sum=-9.8135, value=-0.2743, old_value=0.0951, value_target=-0.6128,
             normalized_advantage=-0.3861),
        dict(logprob_sum=-21.604, value=1.0372, old_value=1.1193, value_target=0.9544,
             normalized_advantage=-0.8313)]),
    # shared value head, clip 0.2: sample 0 inside the clip range; sample 1 moved towards y beyond 0.2
    # (the clipped error is larger -> clipped branch, zero value gradient); sample 2 moved away from y
    # beyond 0.2 (the unclipped error is larger -> ordinary gradient)
    dict(trainer="iac", use_separate_critic=False, value_clip_range=0.2, samples=[
        dict(logprob_sum=-11.247, value=0.4235, old_value=0.3117, value_target=0.7792,
             normalized_advantage=0.9482),
        dict(logprob_sum=-7.0618, value=0.8731, old_value=0.2264, value_target=1.1375,
             normalized_advantage=0.4127),
        dict(logprob_sum=-16.93, value=-0.6842, old_value=-0.1415, value_target=0.2509,
             normalized_advantage=-1.3609)]),
    dict(trainer="iac", use_separate_critic=False, value_clip_range=None, samples=[
        dict(logprob_sum=-11.247, value=0.4235, old_value=0.3117, value_target=0.7792,
             normalized_advantage=0.9482),
        dict(logprob_sum=-7.0618, value=0.8731, old_value=0.2264, value_target=1.1375,
             normalized_advantage=0.4127),
        dict(logprob_sum=-16.93, value=-0.6842, old_value=-0.1415, value_target=0.2509,
             normalized_advantage=-1.3609)]),
    dict(trainer="maac", use_separate_critic=True, value_clip_range=None, samples=[
        dict(logprob_sum=-12.538, value=-0.3306, old_value=-0.5127, value_target=-0.0843,
             normalized_advantage=1.1092),
        dict(logprob_sum=-18.071, value=0.2918, old_value=0.1044, value_target=0.6615,
             normalized_advantage=-0.2275),
        dict(logprob_sum=-5.4429, value=-0.7154, old_value=-0.9012, value_target=-1.2391,
             normalized_advantage=-0.8817)]),
]
VALUE_LOSS_COEF = 0.6


class NoOpt:
    def zero_grad(self):
        pass

    def step(self):
        pass


def ac_step_locals(fn, *args):
    """Call fn(*args); return the locals of the original `_ac_step` frame at its return."""
    code = fn.__code__
    captured = {}

    def prof(frame, event, arg):
        if event == "return" and frame.f_code is code:
            captured.update(frame.f_locals)

    sys.setprofile(prof)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return captured


def run_ac_case(U, torch, case):
    f64 = torch.float64
    leaves = {"lp": [], "v": []}
    S = case["samples"]
    lp_iter = iter([s["logprob_sum"] for s in S])
    v_iter = iter([s["value"] for s in S])

    def fake_policy_eval(self, agent_model, sequences, attention_mask, prompt_len, response_len,
                         output_values=False, completion_loss_mask=None):
        x = torch.tensor([next(lp_iter)], dtype=f64, requires_grad=True)
        leaves["lp"].append(x)
        return x, None

    def fake_value(self, *a, **k):
        x = torch.tensor([next(v_iter)], dtype=f64, requires_grad=True)
        leaves["v"].append(x)
        return x

    batch = []
    for s in S:
        y = torch.tensor([s["value_target"]], dtype=f64)
        meta = {"value_target": y.clone(), "adv_target": y.clone(), "turn_idx": 0}
        if case["trainer"] == "maac":
            meta.update(joint_input_ids=torch.tensor([[11, 12, 13, 14]]),
                        joint_attention_mask=torch.ones(1, 4, dtype=torch.long),
                        joint_prompt_len=4)
        batch.append(make_sample(
            U, torch,
            old_value=torch.tensor([s["old_value"]], dtype=f64),
            returns=y.clone(),
            normalized_advantage=torch.tensor([s["normalized_advantage"]], dtype=f64),
            metadata=meta,
        ))

    if case["trainer"] == "iac":
        u = U.IACTrainer.__new__(U.IACTrainer)
        u.args = U.IACConfig(num_agents=1, num_turns=1, use_separate_critic=case["use_separate_critic"],
                             value_clip_range=case["value_clip_range"], value_loss_coef=VALUE_LOSS_COEF)
        u.critic_type = "v"
        u.agents = [object()]
        u.critics = [object()] if case["use_separate_critic"] else []
        u.agent_devices = [torch.device("cpu")]
        u.critic_devices = [torch.device("cpu")] if case["use_separate_critic"] else []
        u.agent_optimizers = [NoOpt()]
        u.critic_optimizers = [NoOpt()] if case["use_separate_critic"] else []
        u._policy_eval = types.MethodType(fake_policy_eval, u)
        u._value_for_critic_type = types.MethodType(fake_value, u)
        loc = ac_step_locals(U.IACTrainer._ac_step, u, 0, batch)
    else:
        u = U.MAACTrainer.__new__(U.MAACTrainer)
        u.args = U.MAACConfig(num_agents=1, num_turns=1, value_loss_coef=VALUE_LOSS_COEF)
        u.agents = [object()]
        u.critics = [object()]
        u.agent_devices = [torch.device("cpu")]
        u.critic_device = torch.device("cpu")
        u.agent_optimizers = [NoOpt()]
        u.critic_optimizer = NoOpt()
        u._policy_eval = types.MethodType(fake_policy_eval, u)
        u._value_on_prompt_only = types.MethodType(fake_value, u)
        loc = ac_step_locals(U.MAACTrainer._ac_step, u, 0, batch)

    require(len(leaves["lp"]) == len(S) and len(leaves["v"]) == len(S), "one forward per sample")
    entry = {
        "trainer": case["trainer"],
        "use_separate_critic": case["use_separate_critic"],
        "value_clip_range": case["value_clip_range"],
        "value_loss_coef": VALUE_LOSS_COEF,
        "samples": [{k: float(s[k]) for k in ("logprob_sum", "value", "old_value", "value_target",
                                              "normalized_advantage")} for s in S],
        "policy_loss": scalar(loc["actor_loss"]),
        "value_loss": scalar(loc["value_loss"]),
        "grad_logprob_sum": [scalar(x.grad) for x in leaves["lp"]],
        "grad_value": [scalar(x.grad) for x in leaves["v"]],
    }
    check_ac(entry)
    return entry


def check_ac(e):
    S, B, c = e["samples"], len(e["samples"]), e["value_loss_coef"]
    eps = e["value_clip_range"] if (e["trainer"] == "iac" and not e["use_separate_critic"]) else None
    pl = sum(-s["logprob_sum"] * s["normalized_advantage"] for s in S) / B
    require(close(e["policy_loss"], pl, 1e-12), f"policy_loss {e['policy_loss']} != {pl}")
    vl, gv = 0.0, []
    for s in S:
        v, vo, y = s["value"], s["old_value"], s["value_target"]
        un = (y - v) ** 2
        if eps is not None:
            vc = vo + min(max(v - vo, -eps), eps)
            cl = (y - vc) ** 2
            if cl > un:
                vl += cl
                gv.append(0.0 if abs(v - vo) > eps else c * 2 * (vc - y) / B)
                continue
        vl += un
        gv.append(c * 2 * (v - y) / B)
    vl /= B
    require(close(e["value_loss"], vl, 1e-12), f"value_loss {e['value_loss']} != {vl}")
    for g, s in zip(e["grad_logprob_sum"], S):
        require(close(g, -s["normalized_advantage"] / B, 1e-12), "grad lp")
    for g, w in zip(e["grad_value"], gv):
        require(close(g, w, 1e-12), f"grad v {e['grad_value']} != {gv}")


# --------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel-dir", type=Path,
                    default=Path(os.environ.get("COMLRL_WHEEL_DIR", DEFAULT_WHEEL_DIR)),
                    help="the extracted comlrl 1.4.3 wheel (holds comlrl/ and the dist-info)")
    ap.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help="the JSON file to write")
    args = ap.parse_args()

    verify_wheel_dir(args.wheel_dir)
    U = import_upstream(args.wheel_dir)
    import random

    import torch

    torch.set_num_threads(2)
    random.seed(0)
    torch.manual_seed(0)

    data = {
        "source": {"package": "comlrl", "version": VERSION, "wheel_sha256": WHEEL_SHA256,
                   "script": SCRIPT},
        "advantages": case_advantages(U, torch),
        "td_targets": [run_td_case(U, torch, c) for c in TD_CASES],
        "critic_input": case_critic_input(U),
        "ac_step": [run_ac_case(U, torch, c) for c in AC_CASES],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out} (all closed-form checks passed)", file=sys.stderr)


if __name__ == "__main__":
    main()

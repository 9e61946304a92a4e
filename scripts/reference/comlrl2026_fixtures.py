#!/usr/bin/env python3
"""Reference values of the ORIGINAL "CoMLRL 2026" MAGRPO tree trainer and of the code-generation
scripts' next-turn prompts, for cotrain's tests: `learner/tests/fixtures/comlrl2026/*.json`.

Original code (imported at run time from the checkouts, never copied here):
  --comlrl     OpenMLRL/CoMLRL at 86d1bb9012ee31f0f1eaeaa034a305ac4ad0edb5 (v1.3.8+, reference KL with
               `reference_devices`; the advantage/update code is the same as bb779554 and as the later
               v1.4.x files seen). Used: comlrl/trainers/reinforce/magrpo.py (MAGRPOConfig,
               MAGRPOTrainer._train_step_returns, _process_buffer, _drain_ready_buffers,
               _update_from_samples, _compute_advantages, _apply_reference_kl_to_returns,
               _compute_loss_with_gradients, _generate_completions_with_external_prompts),
               comlrl/utils/formatters.py (build_formatters), comlrl/utils/reference_kl.py.
  --code-gen   OpenMLRL/LLM_Collab_Code_Generation at e5b008e9702538e3a09804b83f1763a2be311be0 (2026-01-20):
               external/__init__.py (get_external_transition), external/level_feedback.py,
               train_magrpo.py (aux/main formatters, the nested _make_sliced_assert_tests of main()).
               Its level_feedback prompt text equals the later stored version (3618829, which only adds
               `math` to the exec globals of the tests).
  --code-gen-sep  the same repository at 9a8608d6e33a4f2eab98a517bb3ea85a345c8f74 (2025-09-24, "Reward
               (#15)"): the September 2025 level_feedback (original_prompt / previous_response flags,
               external/common.py build_first_turn_prompts) and its formatters.
  OpenMLRL/* could not be mirrored here. The code-gen commits are in the fork
  junho328/LLM_Collab_Code_Generation (same commit ids). No fork carries the 2026 CoMLRL; for the run that
  wrote the committed fixtures, --comlrl pointed at /tmp/comlrl-86d1bb9, a partial tree reassembled from
  the code index's stored copy of that exact commit (magrpo.py with the methods above verbatim and the
  rest left out; formatters.py and reference_kl.py whole). A full checkout works the same way.

Getting checkouts (not committed anywhere in cotrain):
  git clone https://github.com/OpenMLRL/CoMLRL /tmp/comlrl-repo && mkdir -p /tmp/comlrl-86d1bb9 &&
    git -C /tmp/comlrl-repo archive 86d1bb9012ee31f0f1eaeaa034a305ac4ad0edb5 | tar -x -C /tmp/comlrl-86d1bb9
  git clone https://github.com/junho328/LLM_Collab_Code_Generation /tmp/cg-repo   # or OpenMLRL's
  mkdir -p /tmp/cg-e5b008e /tmp/cg-9a8608d
  git -C /tmp/cg-repo archive e5b008e | tar -x -C /tmp/cg-e5b008e
  git -C /tmp/cg-repo archive 9a8608d | tar -x -C /tmp/cg-9a8608d

Running (Python with torch; transformers optional; wandb/datasets/tqdm and the scripts' other heavy
imports are replaced by stub modules; about 10 s):
  python scripts/reference/comlrl2026_fixtures.py --comlrl /tmp/comlrl-86d1bb9 \
      --code-gen /tmp/cg-e5b008e --code-gen-sep /tmp/cg-9a8608d

Fixtures written (learner/tests/fixtures/comlrl2026/):
  advantages.json   For fixed return groups (G=4) and every advantage_mode (mean, rloo, max, raw) with
                    advantage_normalization on and off, plus reference-KL cases: the advantages the
                    original _compute_loss_with_gradients multiplies into the loss (recovered exactly from
                    the gradient of that original loss on a probe model whose per-sequence log-probs are
                    independent parameters), the original _compute_advantages output, the KL-shaped
                    returns from _apply_reference_kl_to_returns, and the loss value of the probe model
                    (all logits zero, vocabulary 16, completions of 3 tokens of which the original scores
                    the first 2: loss = -(1/G) sum_j A_j * 2 * log(1/16)).
  batch_schedule.json  The original _train_step_returns run on a stubbed environment (scripted rewards per
                    node, fake generation) for the 2026 HE/CHE settings (2 agents, 2 turns, G=4, aligned,
                    discount 1.0, early_termination_threshold -0.2, rollout_buffer_size/train_batch_size
                    2/2 and 4/4) over two items plus the end-of-epoch drain, and a case with early
                    termination: every optimiser step in order with the nodes (turn, branch, env_step,
                    returns) of its mini-batch, after random.seed(0).
  turn2_prompts.json  Turn-2 prompts of both agents for HumanEval/0 and CoopHumanEval/0 with fixed fake
                    turn-1 responses: (a) 2026 level_feedback text (the full-history prompt) as e5b008e
                    passes it (external_prompt_passthrough hard-coded true in train_magrpo.py), (b) the
                    prompt actually tokenised under the 07663c1 configs (external_prompt_passthrough:
                    false: the first-turn formatter wraps the level_feedback text, computed by the
                    original _generate_completions_with_external_prompts + build_formatters), (c) the
                    September 2025 prompt (9a8608d level_feedback with original_prompt/previous_response
                    true, then wrapped by the first-turn formatter as CoMLRL's trainer of that time did).
                    Diagnostics come from the original analyze_code run on the fake responses
                    (sandbox_slice 1); `fake_report` variants replace analyze_code by a fixed report
                    (syntax error, failed cases, aux misuse, wrapper warning) to pin the formatting alone.
"""

import argparse
import ast
import gzip
import importlib
import importlib.machinery
import json
import math
import os
import random
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "learner" / "tests" / "fixtures" / "comlrl2026"


class _Anything:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Anything()

    def __getattr__(self, name):
        return _Anything()


def _stub(name, **attrs):
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _try_import_or_stub(name, **attrs):
    try:
        return importlib.import_module(name)
    except Exception:
        return _stub(name, **attrs)


# --------------------------------------------------------------------------------------------------
# CoMLRL
# --------------------------------------------------------------------------------------------------


def load_comlrl(path):
    import torch  # noqa: F401

    for mod in ("wandb",):
        try:
            importlib.import_module(mod)
        except Exception:
            _stub(mod, run=None, log=lambda *a, **k: None, init=lambda *a, **k: None)
    try:
        importlib.import_module("datasets")
    except Exception:
        _stub("datasets", Dataset=_Anything, IterableDataset=_Anything, load_dataset=None)
    try:
        importlib.import_module("tqdm")
    except Exception:
        _stub("tqdm", tqdm=lambda x, **k: x)
    # Package shells pointing at the checkout, so that package __init__ files (which import every
    # trainer) do not run; submodules resolve to the checkout's files.
    base = Path(path) / "comlrl"
    for pkg, sub in (
        ("comlrl", ""),
        ("comlrl.utils", "utils"),
        ("comlrl.trainers", "trainers"),
        ("comlrl.trainers.reinforce", "trainers/reinforce"),
    ):
        m = types.ModuleType(pkg)
        m.__path__ = [str(base / sub) if sub else str(base)]
        sys.modules[pkg] = m

    class _DeviceScheduler:
        @staticmethod
        def resolve_devices(spec, n, kind=""):
            return ["cpu"] * n

        @staticmethod
        def resolve_single_device(spec):
            return "cpu"

    _try_import_or_stub("comlrl.schedulers", DeviceScheduler=_DeviceScheduler)
    _try_import_or_stub(
        "comlrl.utils.distributed", local_context=lambda *a, **k: None, unwrap_model=lambda m: m
    )
    _try_import_or_stub("comlrl.utils.model_loading", infer_model_name=None, resolve_model_sources=None)
    _try_import_or_stub("comlrl.utils.reward_utils", call_reward_function=None)
    _try_import_or_stub("comlrl.utils.tokenizer_utils", apply_tokenizer_specials=None, resolve_tokenizers=None)
    formatters = importlib.import_module("comlrl.utils.formatters")
    magrpo = importlib.import_module("comlrl.trainers.reinforce.magrpo")
    return magrpo, formatters


def _probe_agent(vocab, per_seq_tokens):
    """A model whose logits depend only on the input token: logits[t] = W[input_t]. W starts at zero."""
    import torch

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.W = torch.nn.Parameter(torch.zeros(vocab, vocab))

        def forward(self, input_ids=None, attention_mask=None, **k):
            return types.SimpleNamespace(logits=self.W[input_ids])

    return Probe()


def _bare_trainer(magrpo, args):
    t = object.__new__(magrpo.MAGRPOTrainer)
    t.args = args
    t.advantage_mode = args.advantage_mode
    t.num_agents = int(args.num_agents)
    t.parallel_training = args.parallel_training
    t.agent_devices = ["cpu"] * t.num_agents
    t.env_step = 0
    t._last_train_log_step = -1
    t.wandb_initialized = False
    t.reference_models = []
    return t


def advantages_fixture(magrpo):
    import torch

    V, G = 16, 4
    groups = {
        "increasing": [1.0, 2.0, 3.0, 4.0],
        "all_equal": [-2.5, -2.5, -2.5, -2.5],
        "one_winner": [-4.0, -4.0, -4.0, 0.75],
        "shifted_code_rewards": [-3.25, -1.5, -4.0, -0.4],
        "mixed": [2.5, -1.0, 0.7, 3.1],
    }
    cases = []
    for name, returns in groups.items():
        for mode in ("mean", "rloo", "max", "raw"):
            for norm in (True, False):
                cases.append((name, returns, mode, norm, False, 0.1, []))
    cases.append(("increasing", groups["increasing"], "mean", True, True, 0.1, [0.2, 0.4, 0.1, 0.0]))
    cases.append(("increasing", groups["increasing"], "mean", False, True, 0.5, [0.2, 0.4, 0.1, 0.0]))
    cases.append(("mixed", groups["mixed"], "rloo", True, True, 0.1, [1.5, 0.0, 0.25, 3.0]))
    cases.append(("one_winner", groups["one_winner"], "mean", True, True, 0.1, [0.3, 0.3]))  # fewer KLs than G

    out = []
    for name, returns, mode, norm, kl_on, kl_coef, kls in cases:
        args = magrpo.MAGRPOConfig(
            num_agents=1, num_turns=1, num_generations=G, advantage_mode=mode,
            advantage_normalization=norm, reference_kl_enabled=kl_on, reference_kl_coef=kl_coef,
        )
        t = _bare_trainer(magrpo, args)
        agent = _probe_agent(V, 3)
        # completion j = [c_j, d_j, 0]; c_j = 1 + j, d_j = 8 + j: the only W entries touched by sequence j
        # are W[prompt_last, c_j] and W[c_j, d_j] (the original never scores the last completion token).
        comp = [torch.tensor([1 + j, 8 + j, 0]) for j in range(G)]
        data = {
            "prompt_input_ids": torch.tensor([[5, 6]]),
            "completion_input_ids": [comp],
            "reference_kls": list(kls),
        }
        loss = t._compute_loss_with_gradients(agent, data, returns)
        loss.backward()
        g = agent.W.grad
        # d loss / d W[c_j, d_j] = -(1/G) * A_j * (1 - 1/V)  (W = 0: p = 1/V)
        adv = [float(-G * g[1 + j, 8 + j] / (1.0 - 1.0 / V)) for j in range(G)]
        eff = t._apply_reference_kl_to_returns(torch.tensor(returns, dtype=torch.float), data)
        base = t._compute_advantages(eff)
        out.append({
            "group": name, "returns": returns, "advantage_mode": mode, "advantage_normalization": norm,
            "reference_kl_enabled": kl_on, "reference_kl_coef": kl_coef, "reference_kls": kls,
            "kl_shaped_returns": [float(x) for x in eff],
            "baseline_advantages": [float(x) for x in base],
            "advantages_in_loss": adv,
            "probe_loss": float(loss.detach()),
        })
    return {
        "source": "OpenMLRL/CoMLRL 86d1bb9 comlrl/trainers/reinforce/magrpo.py "
                  "_compute_loss_with_gradients/_compute_advantages/_apply_reference_kl_to_returns",
        "formula": "A = base(mode, R - coef*KL); if advantage_normalization and G>1: "
                   "A = (A - mean A) / max(std_pop(A), 1e-6)",
        "probe": {"vocab": V, "G": G, "prompt": [5, 6], "completion_j": "[1+j, 8+j, 0]",
                  "logits": "all zero", "scored_tokens_per_completion": 2},
        "cases": out,
    }


def batch_schedule_fixture(magrpo):
    import torch

    def run(name, buffer_size, batch_size, reward_plan, n_items=2, threshold=-0.2):
        args = magrpo.MAGRPOConfig(
            num_agents=2, num_turns=2, num_generations=4, discount=1.0, joint_mode="aligned",
            early_termination_threshold=threshold, rollout_buffer_size=buffer_size,
            train_batch_size=batch_size, advantage_normalization=True,
        )
        t = _bare_trainer(magrpo, args)
        t.agents = [_probe_agent(16, 3), _probe_agent(16, 3)]
        t.rollout_buffers = [[], []]
        events = []

        def fake_generate(agent, batch_items, agent_idx=0, num_return_sequences=1, max_new_tokens=128,
                          prompts_override=None, external_prompts=None, **kw):
            prompts = prompts_override or [external_prompts or batch_items[0]["prompt"]]
            return {
                "prompts": prompts, "batch_items": batch_items,
                "prompt_input_ids": torch.tensor([[5, 6]]),
                "completions": [[f"{prompts[0]}|a{agent_idx}|g{j}" for j in range(num_return_sequences)]],
                "completion_input_ids": [[torch.tensor([1 + j, 8 + j, 0]) for j in range(num_return_sequences)]],
                "reference_kls": [],
            }

        item_state = {"item": 0}

        def fake_rewards(prompts, completions_list, batch_items=None):
            turn = 0 if prompts[0].startswith("item") else 1
            branch = None if turn == 0 else int(prompts[0].split("|")[-1][1:])
            return list(reward_plan(item_state["item"], turn, branch))

        def fake_transition(prompt, agent_completions, num_agents, prompt_history_per_agent=None,
                            response_history_per_agent=None):
            j = agent_completions[0].split("|g")[-1]
            return [f"turn2|agent0|b{j}", f"turn2|agent1|b{j}"]

        class Opt:
            def __init__(self, agent_idx):
                self.agent_idx = agent_idx

            def zero_grad(self):
                events.append({"agent": self.agent_idx, "samples": []})

            def step(self):
                pass

        orig_loss = t._compute_loss_with_gradients

        def recording_loss(agent, completions_data, returns):
            ev = events[-1]
            ev["samples"].append({**completions_data["_node"], "returns": [float(r) for r in returns]})
            return orig_loss(agent, completions_data, returns)

        orig_pack = t._pack_completions_for_buffer

        def pack(cd):
            packed = orig_pack(cd)
            packed["_node"] = dict(cd["_node"])
            return packed

        t._compute_rewards = fake_rewards
        t.external_transition = fake_transition
        t.optimizers = [Opt(0), Opt(1)]
        t._compute_loss_with_gradients = recording_loss
        t._pack_completions_for_buffer = pack

        random.seed(0)
        for item in range(n_items):
            item_state["item"] = item
            batch_item = {"prompt": f"item{item}"}

            # annotate: the fake generator's completions encode the branch; attach node info on packing
            def gen_with_tag(agent, batch_items, agent_idx=0, num_return_sequences=1, max_new_tokens=128,
                             prompts_override=None, external_prompts=None, _item=item, **kw):
                cd = fake_generate(agent, batch_items, agent_idx, num_return_sequences, max_new_tokens,
                                   prompts_override, external_prompts)
                p = cd["prompts"][0]
                turn = 0 if p.startswith("item") else 1
                branch = None if turn == 0 else int(p.split("|b")[-1])
                cd["_node"] = {"item": _item, "turn": turn, "branch": branch}
                return cd

            t._generate_completions = gen_with_tag
            t._train_step_returns(batch_item, [[], []], [[], []])
        # end of epoch (train(): drain every non-empty buffer)
        ready = [i for i, b in enumerate(t.rollout_buffers) if b]
        t._drain_ready_buffers(ready)
        return {"name": name, "rollout_buffer_size": buffer_size, "train_batch_size": batch_size,
                "early_termination_threshold": threshold, "optimizer_steps": events}

    def plan_no_stop(item, turn, branch):
        if turn == 0:
            return [-4.0, -3.0, -2.5, -1.0]
        return [-4.0 + 0.5 * branch + 0.25 * k for k in range(4)]

    def plan_stop_second_item(item, turn, branch):
        if item == 1 and turn == 0:
            return [0.5, -0.5, 0.0, -0.4]  # mean 0.025 > -0.2: the root is a leaf
        return plan_no_stop(item, turn, branch)

    runs = [
        run("he_buffer2_batch2", 2, 2, plan_no_stop),
        run("che_buffer4_batch4", 4, 4, plan_no_stop),
        run("he_buffer2_batch2_early_stop_item1", 2, 2, plan_stop_second_item),
        run("buffer4_batch2", 4, 2, plan_no_stop),
    ]
    # attach the returns the original computed for each node (turn-1 node of item i: rewards + 1.0*mean child)
    return {
        "source": "OpenMLRL/CoMLRL 86d1bb9 comlrl/trainers/reinforce/magrpo.py _train_step_returns, "
                  "_drain_ready_buffers, _process_buffer, _update_from_samples (random.seed(0) before item 0)",
        "reward_plan": {
            "root (turn 0)": [-4.0, -3.0, -2.5, -1.0],
            "child of branch b (turn 1)": "[-4 + 0.5 b + 0.25 k for k in 0..3]",
            "early-stop run, item 1 root": [0.5, -0.5, 0.0, -0.4],
        },
        "note": "each optimiser step = zero_grad, then for each sample of the mini-batch "
                "(loss_sample / len(batch)).backward(), then step; samples listed in processing order",
        "runs": runs,
    }


# --------------------------------------------------------------------------------------------------
# Code-generation scripts
# --------------------------------------------------------------------------------------------------

_CG_MODULES = ("external", "rewards", "loggers", "train_magrpo", "config")


def _purge_codegen():
    for name in list(sys.modules):
        if name.split(".")[0] in _CG_MODULES:
            del sys.modules[name]


def load_codegen(path):
    _purge_codegen()
    sys.path.insert(0, str(path))
    _stub("config", Config=_Anything, add_config_args=lambda *a, **k: None,
          parse_overrides=lambda *a, **k: {}, make_run_id=lambda: "x")
    if "datasets" not in sys.modules:
        _stub("datasets", load_dataset=None, Dataset=_Anything, IterableDataset=_Anything)
    else:
        sys.modules["datasets"].load_dataset = None
    _stub("transformers", AutoModelForCausalLM=_Anything, AutoTokenizer=_Anything,
          PreTrainedModel=_Anything, PreTrainedTokenizerBase=_Anything)
    _stub("loggers")
    _stub("loggers.code_logger", code_reward_logger=None, aggregate_code_metrics_for_logging=None)
    _stub("loggers.mt_code_logger", mt_humaneval_logger=None, aggregate_mt_humaneval_metrics_for_logging=None)
    _stub("comlrl.utils.reward_processor", RewardProcessors=_Anything)
    for api in ("anthropic", "openai"):  # expert_edits' clients (imported by external/ in 2025)
        if api not in sys.modules:
            try:
                importlib.import_module(api)
            except Exception:
                _stub(api, Anthropic=_Anything, OpenAI=_Anything)
    _stub("comlrl.trainers.magrpo", MAGRPOConfig=_Anything, MAGRPOTrainer=_Anything)
    ext = importlib.import_module("external")
    ext.VERBOSE = False
    lf = importlib.import_module("external.level_feedback")
    tm = importlib.import_module("train_magrpo")
    # the nested helper of main() that builds the sandbox tests (sandbox_slice)
    src = (Path(path) / "train_magrpo.py").read_text()
    tree = ast.parse(src)
    main_fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    helper = next(n for n in ast.walk(main_fn)
                  if isinstance(n, ast.FunctionDef) and n.name == "_make_sliced_assert_tests")
    ns = {"re": re}
    exec(compile(ast.Module(body=[helper], type_ignores=[]), "train_magrpo.py", "exec"), ns)
    sys.path.remove(str(path))
    return ext, lf, tm, ns["_make_sliced_assert_tests"]


def load_items():
    with gzip.open(ROOT / "data" / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        he0 = json.loads(f.readline())
    che = json.loads((ROOT / "data" / "coophumaneval" / "che_raw.json").read_text())
    return [he0, che[0]]


FAKE_RESPONSES = {
    "HumanEval/0": (
        "def aux(numbers):\n    return sorted(numbers)\n",
        "def has_close_elements(numbers, threshold):\n    s = aux(numbers)\n"
        "    return not any(b - a < threshold for a, b in zip(s, s[1:]))\n",
    ),
    "CoopHumanEval/0": (
        "def aux(n):\n    if n < 2:\n        return False\n    return all(n % i for i in range(2, n))\n",
        "def x_or_y(n, x, y):\n    return x if aux(n) else y\n",
    ),
}

FAKE_REPORT = {
    "aux_func": "def aux(x):\n    return x",
    "main_func": "def f(x):\n    return aux(x)",
    "aux_defined": True,
    "aux_message": "Aux function defined",
    "main_defined": True,
    "main_message": "Main function (f) defined",
    "syntax_ok": False,
    "syntax_message": "Combined code has a syntax error",
    "syntax_error": {"line": 3, "offset": 7, "msg": "invalid syntax"},
    "aux_called": True,
    "aux_called_but_not_used": True,
    "aux_problematic_calls": ["Line 2: result discarded", "Line 4: called twice", "Line 9: third"],
    "is_wrapper": True,
    "tests_passed": 1,
    "tests_total": 3,
    "test_details": [
        {"status": "pass", "case": "assert f(1) == 1"},
        {"status": "fail", "case": "assert f(2) == 3", "error_type": "AssertionError", "error_message": ""},
        {"status": "fail", "case": "assert f(3) == 4", "error_type": "TimeoutException",
         "error_message": "test execution timed out"},
    ],
}


def prompts_fixture(magrpo, formatters_mod, cg_path, cg_sep_path):
    items = load_items()
    out = {"items": [], "fake_report": FAKE_REPORT}

    # ---- 2026 (e5b008e level_feedback; 86d1bb9 trainer prompt handling) ----
    ext, lf, tm, slicer = load_codegen(cg_path)
    fmts = formatters_mod.build_formatters(
        tm.get_formatters("humaneval", 2), 2, pass_none_external_prompts=False
    )
    ctx = {}
    for it in items:
        ctx[" ".join(it["prompt"].split()).strip()] = {
            "entry_point": it["entry_point"], "tests_eval": it["test"],
            "tests_sandbox": slicer(it["test"], 1),
        }
    ext.set_context_resolver(lambda p: ctx.get(" ".join((p or "").split()).strip()))

    def tree_era(it, aux_resp, main_resp, passthrough):
        turn1 = [fmts[0](it), fmts[1](it)]
        ext_prompts = ext.get_external_transition(
            prompt=it["prompt"], agent_completions=[aux_resp, main_resp], num_agents=2,
            expert_model="deepseek-coder", mode="level_feedback",
            prompt_history_per_agent=[[turn1[0]], [turn1[1]]],
            response_history_per_agent=[[aux_resp], [main_resp]],
        )
        args = magrpo.MAGRPOConfig(num_agents=2, num_turns=2, external_prompt_passthrough=passthrough)
        t = _bare_trainer(magrpo, args)
        t.formatters = fmts
        seen = {}

        def gen(agent, batch_items, agent_idx=0, num_return_sequences=1, max_new_tokens=128,
                prompts_override=None, external_prompts=None, **kw):
            # the formatting lines of the original _generate_completions
            if prompts_override is not None:
                prompts = prompts_override
            else:
                format_func = t.formatters[agent_idx]
                if external_prompts is None:
                    prompts = [format_func(item) for item in batch_items]
                else:
                    prompts = [format_func(item, external_prompts=external_prompts) for item in batch_items]
            seen[agent_idx] = prompts[0]
            return {"prompts": prompts, "batch_items": batch_items}

        t._generate_completions = gen
        recorded = []
        for a in range(2):
            cd = t._generate_completions_with_external_prompts(
                None, [dict(it)], agent_idx=a, num_return_sequences=4, external_prompts=ext_prompts[a])
            recorded.append(cd["prompts"][0])
        return turn1, list(ext_prompts), [seen[0], seen[1]], recorded

    for it in items:
        aux_resp, main_resp = FAKE_RESPONSES[it["task_id"]]
        turn1, lf_text, tokenised_false, recorded_false = tree_era(it, aux_resp, main_resp, False)
        _, _, tokenised_true, _ = tree_era(it, aux_resp, main_resp, True)
        report = lf.analyze_code(it["prompt"], aux_resp, main_resp, slicer(it["test"], 1), it["entry_point"])
        orig_analyze = lf.analyze_code
        lf.analyze_code = lambda *a, **k: dict(FAKE_REPORT)
        try:
            fake = lf.format_followup_prompts(
                it["prompt"], aux_resp, main_resp, "", it["entry_point"], num_agent=2,
                prompt_history_per_agent=[[turn1[0]], [turn1[1]]],
                response_history_per_agent=[[aux_resp], [main_resp]],
            )
        finally:
            lf.analyze_code = orig_analyze
        out["items"].append({
            "task_id": it["task_id"], "entry_point": it["entry_point"], "prompt": it["prompt"],
            "tests_sandbox": slicer(it["test"], 1),
            "turn1_responses": [aux_resp, main_resp],
            "turn1_prompts": turn1,
            "report": {k: v for k, v in report.items()},
            "tree2026": {
                "level_feedback": lf_text,
                "tokenised_passthrough_true": tokenised_true,
                "tokenised_passthrough_false": tokenised_false,
                "recorded_in_history_passthrough_false": recorded_false,
                "fake_report_level_feedback": list(fake),
            },
        })

    # ---- September 2025 (9a8608d) ----
    if cg_sep_path:
        ext2, lf2, tm2, slicer2 = load_codegen(cg_sep_path)
        ext2.set_context_resolver(lambda p: ctx.get(" ".join((p or "").split()).strip()))
        f_aux, f_main = tm2.get_formatters("humaneval", 2)
        for rec, it in zip(out["items"], items):
            aux_resp, main_resp = FAKE_RESPONSES[it["task_id"]]
            raw = ext2.get_external_transition(
                prompt=it["prompt"], agent_completions=[aux_resp, main_resp], num_agents=2,
                expert_model="deepseek-coder", mode="level_feedback",
                original_prompt=True, previous_response=True,
            )
            wrapped = [f({**it, "prompt": p}) for f, p in zip((f_aux, f_main), raw)]
            orig_analyze = lf2.analyze_code
            lf2.analyze_code = lambda *a, **k: dict(FAKE_REPORT)
            try:
                fake = lf2.format_followup_prompts(
                    it["prompt"], aux_resp, main_resp, "", it["entry_point"],
                    original_prompt_flag=True, previous_response_flag=True, num_agent=2)
            finally:
                lf2.analyze_code = orig_analyze
            rec["september2025"] = {
                "turn1_prompts": [f_aux(it), f_main(it)],
                "level_feedback": list(raw),
                "tokenised": wrapped,
                "fake_report_level_feedback": list(fake),
            }
    _purge_codegen()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comlrl", required=True)
    ap.add_argument("--code-gen", required=True)
    ap.add_argument("--code-gen-sep", default=None)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    sys.path.insert(0, a.comlrl)
    magrpo, formatters_mod = load_comlrl(a.comlrl)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "advantages.json": advantages_fixture(magrpo),
        "batch_schedule.json": batch_schedule_fixture(magrpo),
        "turn2_prompts.json": prompts_fixture(magrpo, formatters_mod, a.code_gen, a.code_gen_sep),
    }
    for name, obj in results.items():
        (out / name).write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n")
        print("wrote", out / name)


if __name__ == "__main__":
    main()

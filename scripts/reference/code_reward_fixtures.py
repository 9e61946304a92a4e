#!/usr/bin/env python3
"""Reference values of the ORIGINAL two-agent code reward (helper `aux` + main function) for the
reward server's tests: `reward-server/tests/fixtures/original_code_reward.jsonl.gz`.

Original code (imported at run time from --orig, never copied here):
  repository  OpenMLRL/LLM_Collab_Code_Generation (the MAGRPO code-generation scripts)
  commit      7ad598510f0fee38b4d17cbee9159de71d5480ef  (2025-09-26, "Early termination (#17)")
  files       rewards/code_rewards.py   execution_reward_aux            (the training reward)
              rewards/code_utils.py     the helpers it calls
              loggers/code_logger.py    code_reward_logger              (the eval-time level breakdown)
              train_grpo.py             execution_reward_single_agent   (the GRPO adapter: aux = "")
  The reward logic of rewards/ is identical from the repository's first commit 3b067f6 (2025-08-25)
  to e5b008e (2026-01-20) apart from renames, a VERBOSE switch and two try/except around ast.parse in
  functions the reward does not call. The upstream repository could not be mirrored here; the commit
  was taken from the fork junho328/LLM_Collab_Code_Generation, which carries the upstream history
  with the same commit ids. See reward-server/tests/fixtures/original_code_reward.SOURCE.md.

Getting a checkout of the original (not committed anywhere in cotrain):
  git clone https://github.com/OpenMLRL/LLM_Collab_Code_Generation /tmp/orig-repo   # or any fork with the commit
  mkdir -p /tmp/orig && git -C /tmp/orig-repo archive 7ad598510f0fee38b4d17cbee9159de71d5480ef | tar -x -C /tmp/orig

Running (Python 3.11, standard library only; no torch/transformers/datasets needed: the training
scripts' heavy imports are replaced by empty stub modules, the reward itself does not use them):
  python3 scripts/reference/code_reward_fixtures.py --orig /tmp/orig          # about 1.5 minutes, 2 jobs

What it does: builds several hundred joint actions (aux completion, main completion) and single-agent
completions deterministically (seeded templates) for HumanEval, CoopHumanEval and MBPP items from
data/, scores each with the original functions in a fresh forked child process (the original runs
model code with exec() in-process and uses SIGALRM, so nothing may leak between items), and writes
one JSON line per joint action. Phase 1 scores every item's solution alone (GRPO) and split into
aux + main; phase 2 applies each edge-case template (case labels = template names below) to one
seeded item per dataset among those whose solution passed all its tests in phase 1, plus the
HumanEval items with `assert True` lines, helper functions in the prompt, multi-line asserts and no
tests. PYTHONHASHSEED is pinned to 0 (the script re-executes itself) so set
and dict orders inside the scored code are reproducible.

Completions come from two kinds of correct solutions:
  - HumanEval: the dataset's canonical_solution (real code).
  - CoopHumanEval and MBPP (no solutions in the data): an "oracle" body generated from the item's own
    `assert candidate(<literals>) == <literal>` lines (a lookup table), so that tests pass and the
    cooperation bonuses can be exercised. The reward only looks at the text, so this is as good as
    real code for testing the reward.

Each line: {"dataset", "task_id", "agents": 1|2, "completions": [aux, main] | [single], "reward",
"case", "logger": {...}, "reward_log": {...}, "extracted": {...}, "item_traits": [...]}.
  reward      execution_reward_aux (2 agents) or train_grpo.execution_reward_single_agent (1 agent).
  logger      loggers/code_logger.code_reward_logger's per-sample metrics for the same joint action:
              the original's own level breakdown (level_1/2/3_reward, test_reward, passed_tests,
              total_tests, passed_rate, timeout_num, bonus_reward, aux_usage_bonus,
              anti_wrapper_bonus, called_wo_used_deduction, total_reward). It runs each test once with
              exec(); the reward additionally eval()s `f(args)` and the expected value of
              `assert f(args) == expected` lines before exec()ing the assert (so the call runs twice).
              The two totals agree except where that double call matters (cases stateful_double_call,
              timeout_caught_by_code).
  reward_log  parsed from the reward's own verbose output: passed_tests, total_tests, timeouts,
              load_failed (exec of the program raised), stopped ("level1" | "syntax" | "no_tests" | null).
  extracted   the original's extract_specific_function(aux completion, "aux") and
              (main completion, entry_point), and extract_imports_from_prompt(prompt). The program the
              original executes is concatenate_functions(aux, main, imports): the non-empty ones of
              imports, cleanup_code(aux), cleanup_code(main), joined by blank lines.
  item_traits computed by this script from the item (not by the original), to select items:
              assert_true, multiline_assert, dup_asserts, assert_without_candidate, zero_tests,
              prompt_helpers, prompt_imports.
"""

import argparse
import ast
import contextlib
import copy
import gzip
import io
import json
import os
import random
import re
import select
import signal
import sys
import time
import types
from pathlib import Path

ORIGINAL_REPO = "OpenMLRL/LLM_Collab_Code_Generation"
ORIGINAL_COMMIT = "7ad598510f0fee38b4d17cbee9159de71d5480ef"
SEED = 20250926
ROOT = Path(__file__).resolve().parents[2]
CHILD_LIMIT_S = 240


# --------------------------------------------------------------------------------------------------
# Importing the original
# --------------------------------------------------------------------------------------------------

def _stub(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def import_original(orig):
    """Import the original reward, logger and single-agent adapter from the checkout `orig`."""
    orig = str(Path(orig).resolve())
    if not Path(orig, "rewards", "code_rewards.py").exists():
        sys.exit(f"--orig {orig}: rewards/code_rewards.py not found")
    sys.path.insert(0, orig)

    class _Anything:  # stands in for classes the training scripts import but the reward never uses
        def __init__(self, *a, **k):
            pass

    # Heavy / networked imports of train_grpo.py and loggers/code_logger.py, unused by the reward.
    _stub("numpy")
    _stub("torch")
    _stub("datasets", load_dataset=None, Dataset=_Anything, IterableDataset=_Anything)
    _stub("transformers", AutoModelForCausalLM=_Anything, AutoTokenizer=_Anything)
    _stub("comlrl")
    _stub("comlrl.utils")
    _stub("comlrl.utils.reward_processor", RewardProcessors=_Anything)
    _stub("comlrl.trainers")
    _stub("comlrl.trainers.magrpo", MAGRPOConfig=_Anything, MAGRPOTrainer=_Anything)
    _stub("external", get_external_transition=None, set_context_resolver=lambda *a, **k: None)

    import rewards.code_rewards as code_rewards  # noqa: E402
    import rewards.code_utils as code_utils  # noqa: E402
    import loggers.code_logger as code_logger  # noqa: E402
    import train_grpo  # noqa: E402

    code_rewards.VERBOSE = True  # its log is parsed for reward_log
    return types.SimpleNamespace(
        execution_reward_aux=code_rewards.execution_reward_aux,
        single_agent=train_grpo.execution_reward_single_agent,
        code_reward_logger=code_logger.code_reward_logger,
        utils=code_utils,
    )


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------

def load_items(data_dir):
    data_dir = Path(data_dir)
    with gzip.open(data_dir / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        he = [json.loads(line) for line in f if line.strip()]
    che = json.loads((data_dir / "coophumaneval" / "che_raw.json").read_text())
    mbpp = json.loads((data_dir / "mbpp" / "mbpp_raw.json").read_text())
    return {"humaneval": he, "coophumaneval": che, "mbpp": mbpp}


def item_traits(item, orig):
    test = item["test"]
    m = re.search(r"def check\(candidate\):(.*?)(?=\n\ndef|\Z)", test, re.DOTALL)
    lines = [l.strip() for l in (m.group(1) if m else "").strip().split("\n")]
    traits = []
    if any(l.startswith("assert True") for l in lines):
        traits.append("assert_true")
    for l in lines:
        if l.startswith("assert") and "candidate" in l:
            try:
                compile(l, "<assert>", "exec")
            except SyntaxError:
                traits.append("multiline_assert")
                break
    cand = [l for l in lines if l.startswith("assert") and "candidate" in l]
    if len(set(cand)) != len(cand):
        traits.append("dup_asserts")
    if any(l.startswith("assert") and "candidate" not in l and not l.startswith("assert True") for l in lines):
        traits.append("assert_without_candidate")
    if not orig.utils.extract_test_cases(test, item["entry_point"]):
        traits.append("zero_tests")
    if len(re.findall(r"^def \w+", item["prompt"], re.M)) > 1:
        traits.append("prompt_helpers")
    if orig.utils.extract_imports_from_prompt(item["prompt"]):
        traits.append("prompt_imports")
    return traits


# --------------------------------------------------------------------------------------------------
# Solutions: canonical (HumanEval) or oracle lookup tables (CoopHumanEval, MBPP)
# --------------------------------------------------------------------------------------------------

def _literal(node):
    try:
        ast.literal_eval(ast.unparse(node))
        return True
    except Exception:
        return False


def oracle_table(test, entry_point):
    """(args_tuple_src, expected_src) of every `assert candidate(<literals>) [== <literal>]` in check()."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return []
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks:
        return []
    table = []
    for node in ast.walk(checks[0]):
        if not isinstance(node, ast.Assert):
            continue
        t, expected = node.test, None
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
            call, expected = t.left, t.comparators[0]
        elif isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
            call, expected = t.operand, ast.Constant(False)
        else:
            call, expected = t, ast.Constant(True)
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "candidate"
                and not call.keywords and not any(isinstance(a, ast.Starred) for a in call.args)):
            continue
        args = ast.Tuple(elts=call.args, ctx=ast.Load())
        if _literal(args) and _literal(expected):
            table.append((ast.unparse(args), ast.unparse(expected), len(call.args)))
    return table


class Sol:
    """Pieces to assemble completions for one item."""

    def __init__(self, dataset, item):
        self.dataset = dataset
        self.item = item
        self.entry = item["entry_point"]
        prompt = item["prompt"]
        tree = ast.parse(prompt)
        fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == self.entry][-1]
        lines = prompt.split("\n")
        first = fn.body[0]
        has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
        self.header = "\n".join(lines[fn.lineno - 1:first.lineno - 1]) + "\n"  # the def line(s), as in the prompt
        self.doc = ("\n".join(lines[first.lineno - 1:first.end_lineno]) + "\n") if has_doc else ""
        self.params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        self.call = ", ".join(self.params)
        bare = copy.deepcopy(fn.args)
        for a in bare.posonlyargs + bare.args:
            a.annotation = None
        self.aux_def = f"def aux({ast.unparse(bare)}):\n"
        self.plain_header = f"def {self.entry}({ast.unparse(bare)}):\n"
        if dataset == "humaneval":
            body = item["canonical_solution"].lstrip("\n").rstrip() + "\n"
            self.kind = "canonical"
        else:
            table = oracle_table(item["test"], self.entry)
            key = "(" + "".join(p + ", " for p in self.params).rstrip(" ") + ")"
            body = "    _cases = [\n"
            body += "".join(f"        ({a}, {e}),\n" for a, e, _ in table)
            body += "    ]\n"
            body += "    for _args, _expected in _cases:\n"
            body += f"        if _args == {key}:\n"
            body += "            return _expected\n"
            body += "    return None\n"
            self.kind = "oracle"
        self.body = body
        self.aux_full = self.aux_def + body  # a complete helper named aux: the solution itself

    # main bodies that use aux
    def use_nonwrapper(self):
        return (f"    result = aux({self.call})\n"
                "    if result is None:\n"
                "        return result\n"
                "    return result\n")

    def main(self, body, doc=False):
        return self.header + (self.doc if doc else "") + body


def indent(text, n=4):
    return "".join((" " * n + l if l.strip() else l) for l in text.splitlines(True))


def first_def_swap(text, old, new):
    return text.replace(f"def {old}(", f"def {new}(", 1)


# --------------------------------------------------------------------------------------------------
# Templates. Each returns (agents, completions) or None when it does not apply to the item.
# --------------------------------------------------------------------------------------------------

T2 = {}  # two-agent templates
T1 = {}  # single-agent templates


def two(name):
    def deco(f):
        T2[name] = f
        return f
    return deco


def one(name):
    def deco(f):
        T1[name] = f
        return f
    return deco


@two("split_nonwrapper")
def _(s, r):
    return s.aux_full, s.main(s.use_nonwrapper())


@two("split_nonwrapper_with_prompt_docstring")
def _(s, r):
    return s.aux_full, s.main(s.use_nonwrapper(), doc=True)


@two("wrapper_return_aux")
def _(s, r):
    return s.aux_full, s.main(f"    return aux({s.call})\n")


@two("wrapper_assign_return")
def _(s, r):
    return s.aux_full, s.main(f"    out = aux({s.call})\n    return out\n")


@two("wrapper_return_expression")
def _(s, r):
    return s.aux_full, s.main(f"    return aux({s.call}) if True else None\n")


@two("wrapper_oneline_docstring")
def _(s, r):
    return s.aux_full, s.main(f'    """Delegates to the helper."""\n    return aux({s.call})\n')


@two("wrapper_with_prompt_docstring")
def _(s, r):
    return s.aux_full, s.main(f"    return aux({s.call})\n", doc=True)


@two("full_solution_plus_assigned_aux")
def _(s, r):
    return s.aux_full, s.main(f"    check_value = aux({s.call})\n" + s.body)


@two("ignores_aux_result_nospace")
def _(s, r):
    return s.aux_full, s.main(f"    aux({s.call})\n" + s.body)


@two("ignores_aux_result_space_onechar")
def _(s, r):
    return "def aux(*args):\n    return 0\n", s.main("    aux (0)\n" + s.body)


@two("ignores_aux_result_space_twochars")
def _(s, r):
    return "def aux(*args):\n    return 0\n", s.main("    aux (10)\n" + s.body)


@two("ignores_aux_result_space_semicolon")
def _(s, r):
    return "def aux(*args):\n    return 0\n", s.main("    aux (0);\n" + s.body)


@two("ignores_aux_result_nospace_onechar")
def _(s, r):
    return "def aux(*args):\n    return 0\n", s.main("    aux(0)\n" + s.body)


@two("main_no_aux_call")
def _(s, r):
    return s.aux_full, s.main(s.body)


@two("main_no_aux_call_with_prompt_docstring")
def _(s, r):
    return s.aux_full, s.main(s.body, doc=True)


@two("aux_only_in_comment")
def _(s, r):
    return s.aux_full, s.main(f"    # aux({s.call}) would also work here\n" + s.body)


@two("aux_only_in_docstring")
def _(s, r):
    return s.aux_full, s.main(f'    """Could call aux({s.call}) instead."""\n' + s.body)


@two("aux_name_as_suffix_only")
def _(s, r):
    return s.aux_full, s.main(f"    my_aux = {s.params[0]}\n" + s.body)


@two("main_returns_none")
def _(s, r):
    return s.aux_full, s.main(f"    result = aux({s.call})\n    return None\n")


@two("main_wrong_value")
def _(s, r):
    return s.aux_full, s.main(f"    result = aux({s.call})\n    return [result, 'wrong']\n")


@two("main_raises")
def _(s, r):
    return s.aux_full, s.main(f"    result = aux({s.call})\n    raise ValueError(result)\n    return result\n")


@two("aux_returns_none_main_uses_it")
def _(s, r):
    return s.aux_def + "    return None\n", s.main(s.use_nonwrapper())


@two("missing_aux_main_calls_it")
def _(s, r):
    return "", s.main(s.use_nonwrapper())


@two("missing_aux_full_main")
def _(s, r):
    return "", s.main(s.body)


@two("aux_prose_only")
def _(s, r):
    return "I would write a helper that computes the answer step by step.", s.main(s.body)


@two("aux_wrong_name")
def _(s, r):
    return first_def_swap(s.aux_full, "aux", "helper"), s.main(f"    result = helper({s.call})\n    return result\n")


@two("aux_no_return_main_calls_it")
def _(s, r):
    return s.aux_def + "    unused = 0\n", s.main(f"    aux({s.call})\n" + s.body)


@two("aux_bare_return_last_line")
def _(s, r):
    return s.aux_def + "    unused = 0\n    return\n", s.main(f"    aux({s.call})\n" + s.body)


@two("aux_bare_return_middle")
def _(s, r):
    return s.aux_def + "    if unused_flag():\n        return\n    unused = 0\n", s.main(s.body)


@two("aux_return_only_in_comment")
def _(s, r):
    return s.aux_def + "    # return the helper value\n    unused = 0\n", s.main(s.body)


@two("aux_return_paren")
def _(s, r):
    return s.aux_def + "    return(0)\n", s.main(s.body)


@two("main_return_paren")
def _(s, r):
    return s.aux_full, s.main(f"    return(aux({s.call}))\n")


@two("main_return_only_in_docstring")
def _(s, r):
    return s.aux_full, s.main(f'    """We return the helper result."""\n    result = aux({s.call})\n')


@two("main_return_only_in_comment")
def _(s, r):
    return s.aux_full, s.main(f"    result = aux({s.call})\n    # return result\n")


@two("main_return_only_in_nested_def")
def _(s, r):
    return s.aux_full, s.main(f"    def inner():\n        return aux({s.call})\n    inner()\n")


@two("syntax_error_main")
def _(s, r):
    return s.aux_full, s.main(f"    result = aux({s.call}\n    return result\n")


@two("syntax_error_aux")
def _(s, r):
    return s.aux_full + "    return (\n", s.main(s.use_nonwrapper())


@two("fenced_python")
def _(s, r):
    return "```python\n" + s.aux_full + "```\n", "```python\n" + s.main(s.use_nonwrapper()) + "```\n"


@two("fenced_plain")
def _(s, r):
    return "```\n" + s.aux_full + "```", "```\n" + s.main(s.use_nonwrapper()) + "```"


@two("fenced_py_tag")
def _(s, r):
    return "```py\n" + s.aux_full + "```\n", "```python3\n" + s.main(s.use_nonwrapper()) + "```\n"


@two("prose_around_fenced")
def _(s, r):
    return ("Here is the helper function:\n\n```python\n" + s.aux_full + "```\n\nThis helper returns the core value.\n",
            "Sure! Here's the implementation:\n\n```python\n" + s.main(s.use_nonwrapper())
            + "```\n\nExplanation: it calls aux and returns its result.\n")


@two("prose_around_unfenced")
def _(s, r):
    return ("Helper:\n" + s.aux_full + "\nThis is the helper.\n",
            "Main function:\n" + s.main(s.use_nonwrapper()) + "\nThat completes the solution.\n")


@two("prose_line_in_body_removed")
def _(s, r):
    body = s.use_nonwrapper().replace("    if result", "    This is the final step.\n    if result", 1)
    return s.aux_full, s.main(body)


@two("prose_line_in_body_kept")
def _(s, r):
    body = s.use_nonwrapper().replace("    if result", "    Note that we call aux (the helper) here.\n    if result", 1)
    return s.aux_full, s.main(body)


@two("completion_import_top_level")
def _(s, r):
    return s.aux_full, "import math\n\n" + s.main("    unused = math.floor(2.5)\n" + s.use_nonwrapper())


@two("completion_import_in_body")
def _(s, r):
    return s.aux_full, s.main("    import math\n    unused = math.floor(2.5)\n" + s.use_nonwrapper())


@two("aux_import_top_level")
def _(s, r):
    return "import math\n\n" + s.aux_def + "    unused = math.floor(2.5)\n" + s.body, s.main(s.use_nonwrapper())


@two("annotation_needs_completion_import")
def _(s, r):
    hdr = s.plain_header.replace("):\n", ") -> Dict[str, int]:\n", 1)
    return s.aux_full, "from typing import Dict\n\n" + hdr + s.use_nonwrapper()


@two("annotation_name_error")
def _(s, r):
    return s.aux_full, s.plain_header.replace("):\n", ") -> UndefinedType:\n", 1) + s.use_nonwrapper()


@two("default_arg_raises_at_def")
def _(s, r):
    return s.aux_full, s.plain_header.replace("):\n", ", _z=1 // 0):\n", 1) + s.use_nonwrapper()


@two("dup_main_adjacent_first_correct")
def _(s, r):
    return s.aux_full, s.main(s.use_nonwrapper()) + "\n\n" + s.main("    return None\n")


@two("dup_main_adjacent_second_correct")
def _(s, r):
    return s.aux_full, s.main("    return None\n") + "\n\n" + s.main(s.use_nonwrapper())


@two("dup_main_separated_first_correct")
def _(s, r):
    return s.aux_full, (s.main(s.use_nonwrapper()) + "\n\ndef unrelated(v):\n    return v\n\n\n"
                        + s.main("    return None\n"))


@two("dup_main_separated_second_correct")
def _(s, r):
    return s.aux_full, (s.main("    return None\n") + "\n\ndef unrelated(v):\n    return v\n\n\n"
                        + s.main(s.use_nonwrapper()))


@two("dup_aux_adjacent_second_correct")
def _(s, r):
    return s.aux_def + "    return None\n\n\n" + s.aux_full, s.main(s.use_nonwrapper())


@two("dup_aux_adjacent_first_correct")
def _(s, r):
    return s.aux_full + "\n\n" + s.aux_def + "    return None\n", s.main(s.use_nonwrapper())


@two("top_level_helper_in_main_completion")
def _(s, r):
    return s.aux_full, (first_def_swap(s.aux_full, "aux", "_helper") + "\n\n"
                        + s.main(f"    first = aux({s.call})\n    return _helper({s.call})\n"))


@two("nested_helper_then_code")
def _(s, r):
    inner = indent(first_def_swap(s.aux_full, "aux", "_inner"))
    return s.aux_full, s.main(inner + f"    first = aux({s.call})\n    return _inner({s.call})\n")


@two("decorated_main")
def _(s, r):
    return s.aux_full, "@functools.lru_cache(maxsize=None)\n" + s.main(s.use_nonwrapper())


@two("decorated_aux")
def _(s, r):
    return "@staticmethod\n" + s.aux_full, s.main(s.use_nonwrapper())


@two("indented_completions")
def _(s, r):
    return indent(s.aux_full), indent(s.main(s.use_nonwrapper()))


@two("tab_indented_main")
def _(s, r):
    main = s.main(s.use_nonwrapper())
    return s.aux_full, re.sub(r"(?m)^((?:    )+)", lambda m: "\t" * (len(m.group(1)) // 4), main)


@two("crlf_line_endings")
def _(s, r):
    return s.aux_full.replace("\n", "\r\n"), s.main(s.use_nonwrapper()).replace("\n", "\r\n")


@two("async_main")
def _(s, r):
    return s.aux_full, "async " + s.main(s.use_nonwrapper())


@two("main_as_method")
def _(s, r):
    hdr = s.plain_header.replace("(", "(self, ", 1)
    return s.aux_full, "class Solution:\n" + indent(hdr + s.use_nonwrapper())


@two("main_redefines_aux")
def _(s, r):
    return s.aux_def + "    return None\n", s.aux_full + "\n\n" + s.main(s.use_nonwrapper())


@two("aux_agent_also_writes_main")
def _(s, r):
    return s.aux_full + "\n\n" + s.main("    return None\n"), s.main(s.use_nonwrapper())


@two("aux_calls_main_recursion")
def _(s, r):
    return s.aux_def + f"    return {s.entry}({s.call})\n", s.main(s.use_nonwrapper())


@two("stateful_double_call")
def _(s, r):
    body = ("    globals()['_calls'] = globals().get('_calls', 0) + 1\n"
            "    if globals()['_calls'] % 2 == 1:\n"
            "        return 'odd call'\n") + s.use_nonwrapper()
    return s.aux_full, s.main(body)


@two("main_prints_noise")
def _(s, r):
    return s.aux_full, s.main(f"    print('debug: Tests passed: 0/0', aux({s.call}))\n" + s.use_nonwrapper())


@two("prompt_echo_plus_body")
def _(s, r):
    return s.aux_full, s.item["prompt"].rstrip("\n") + "\n" + s.use_nonwrapper()


@two("empty_both")
def _(s, r):
    return "", ""


@two("main_empty")
def _(s, r):
    return s.aux_full, ""


@two("main_prose_only")
def _(s, r):
    return s.aux_full, "The answer depends on the input."


@two("whitespace_only")
def _(s, r):
    return "   \n\n", "\n\t\n"


# --- timeouts (per-test SIGALRM of 10 s in the original; stop after 3 timeouts) ---

def _sleep_first_calls(n):
    return ("    import time\n"
            "    globals()['_n'] = globals().get('_n', 0) + 1\n"
            f"    if globals()['_n'] <= {n}:\n"
            "        time.sleep(25)\n")


@two("timeout_busy_loop_first_call")
def _(s, r):
    body = ("    globals()['_n'] = globals().get('_n', 0) + 1\n"
            "    while globals()['_n'] <= 1:\n"
            "        pass\n") + s.use_nonwrapper()
    return s.aux_full, s.main(body)


@two("timeout_sleep_three_calls_then_stop")
def _(s, r):
    return s.aux_full, s.main(_sleep_first_calls(3) + s.use_nonwrapper())


@two("timeout_sleep_two_calls_bonus_kept")
def _(s, r):
    return s.aux_full, s.main(_sleep_first_calls(2) + s.use_nonwrapper())


@two("timeout_caught_by_code")
def _(s, r):
    body = ("    import time\n"
            "    globals()['_n'] = globals().get('_n', 0) + 1\n"
            "    if globals()['_n'] <= 1:\n"
            "        try:\n"
            "            time.sleep(25)\n"
            "        except Exception:\n"
            "            return 'caught'\n") + s.use_nonwrapper()
    return s.aux_full, s.main(body)


TIMEOUT_CASES = {"timeout_busy_loop_first_call", "timeout_sleep_three_calls_then_stop",
                 "timeout_sleep_two_calls_bonus_kept", "timeout_caught_by_code"}


# --- single agent (GRPO): the adapter passes "" as the aux completion ---

@one("single_solution")
def _(s, r):
    return s.main(s.body)


@one("single_with_prompt_docstring")
def _(s, r):
    return s.main(s.body, doc=True)


@one("single_prompt_echo_plus_body")
def _(s, r):
    return s.item["prompt"].rstrip("\n") + "\n" + s.body


@one("single_fenced_prose")
def _(s, r):
    return "Here is my solution:\n\n```python\n" + s.main(s.body) + "```\n\nIt handles all cases.\n"


@one("single_returns_none")
def _(s, r):
    return s.main("    return None\n")


@one("single_syntax_error")
def _(s, r):
    return s.main("    return (\n")


@one("single_empty")
def _(s, r):
    return ""


@one("single_calls_aux")
def _(s, r):
    return s.main(f"    return aux({s.call})\n")


@one("single_defines_aux_and_main")
def _(s, r):
    return s.aux_full + "\n\n" + s.main(f"    result = aux({s.call})\n    return result\n")


@one("single_top_level_import")
def _(s, r):
    return "import math\n\n" + s.main("    unused = math.floor(2.5)\n" + s.body)


@one("single_return_paren")
def _(s, r):
    return s.main("    return(None)\n")


@one("single_dup_adjacent_second_correct")
def _(s, r):
    return s.main("    return None\n") + "\n\n" + s.main(s.body)


@one("single_mentions_aux_in_comment")
def _(s, r):
    return s.main("    # aux(x) is not available\n" + s.body)


# --- hand-made cases for items whose prompt holds helper functions ---

def special_cases(items_by_id):
    out = []
    he = items_by_id["humaneval"]
    it = he.get("HumanEval/10")
    if it:
        s = Sol("humaneval", it)
        aux = ('def aux(string: str) -> bool:\n    """ Test if given string is a palindrome """\n'
               "    return string == string[::-1]\n")
        main_aux = s.main(s.body.replace("is_palindrome(", "aux("))
        out.append(("humaneval", it, "prompt_helper_as_aux", 2, [aux, main_aux]))
        out.append(("humaneval", it, "prompt_helper_called_not_defined", 2, [aux, s.main(s.body)]))
        out.append(("humaneval", it, "prompt_helper_redefined_in_main_completion", 2,
                    [aux, 'def is_palindrome(string: str) -> bool:\n    return string == string[::-1]\n\n\n' + s.main(s.body)]))
    for tid, helper in (("HumanEval/38", "encode_cyclic"), ("HumanEval/50", "encode_shift")):
        it = he.get(tid)
        if not it:
            continue
        s = Sol("humaneval", it)
        tree = ast.parse(it["prompt"])
        fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == helper][0]
        src = "\n".join(it["prompt"].split("\n")[fn.lineno - 1:fn.end_lineno]) + "\n"
        aux = first_def_swap(src, helper, "aux")
        out.append(("humaneval", it, "prompt_helper_as_aux", 2, [aux, s.main(s.body.replace(helper + "(", "aux("))]))
    return out


# --------------------------------------------------------------------------------------------------
# Scoring in forked children
# --------------------------------------------------------------------------------------------------

_RE_PASSED = re.compile(r"📊 Tests passed: (\d+)/(\d+)")


def parse_reward_log(log):
    m = _RE_PASSED.search(log)
    stopped = None
    if "STOPPING: Function definition requirements not met" in log:
        stopped = "level1"
    elif "STOPPING: Syntax requirements not met" in log:
        stopped = "syntax"
    elif "❌ No test cases found" in log:
        stopped = "no_tests"
    return {
        "passed_tests": int(m.group(1)) if m else 0,
        "total_tests": int(m.group(2)) if m else (0 if stopped else None),
        "timeouts": len(re.findall(r"⏰ Test \d+: TIMEOUT", log)),
        "load_failed": "❌ Code loading failed" in log,
        "stopped": stopped,
    }


def score(orig, row):
    item = row["item"]
    comps = row["completions"]
    aux, main = (comps[0], comps[1]) if row["agents"] == 2 else ("", comps[0])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        if row["agents"] == 2:
            rewards = orig.execution_reward_aux([aux], [main], [item["test"]], [item["entry_point"]], [item["prompt"]])
        else:
            batch = [{"test": item["test"], "entry_point": item["entry_point"], "prompt": item["prompt"]}]
            rewards = orig.single_agent([main], batch_items=batch)
    reward_log = parse_reward_log(buf.getvalue())
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        metrics = orig.code_reward_logger([aux], [main], [item["test"]], [item["entry_point"]], [item["prompt"]])[0]
    u = orig.utils
    aux_x = u.extract_specific_function(aux, "aux")
    main_x = u.extract_specific_function(main, item["entry_point"])
    extracted = {"aux": aux_x, "main": main_x, "imports": u.extract_imports_from_prompt(item["prompt"])}
    logger = {k: v for k, v in metrics.items() if k not in ("sample_id", "entry_point", "gated_total_reward")}
    return {"reward": rewards[0], "logger": logger, "reward_log": reward_log, "extracted": extracted}


def run_all(orig, rows, jobs):
    results = [None] * len(rows)
    pending = list(range(len(rows)))
    # start the slow (timeout) cases first so they overlap with everything else
    pending.sort(key=lambda i: 0 if rows[i]["case"] in TIMEOUT_CASES else 1)
    running = {}  # fd -> (pid, index, start, chunks)
    done = 0
    t0 = time.time()
    while pending or running:
        busy = sum(1 for (_, j, _, _) in running.values() if rows[j]["case"] not in TIMEOUT_CASES)
        while pending and (busy < jobs or rows[pending[0]]["case"] in TIMEOUT_CASES):
            busy += rows[pending[0]]["case"] not in TIMEOUT_CASES
            i = pending.pop(0)
            rfd, wfd = os.pipe()
            pid = os.fork()
            if pid == 0:  # child
                os.close(rfd)
                try:
                    payload = json.dumps(score(orig, rows[i])).encode()
                except BaseException as e:  # noqa: BLE001
                    payload = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
                with os.fdopen(wfd, "wb") as w:
                    w.write(payload)
                os._exit(0)
            os.close(wfd)
            running[rfd] = (pid, i, time.time(), [])
        ready, _, _ = select.select(list(running), [], [], 1.0)
        for fd in ready:
            chunk = os.read(fd, 1 << 20)
            if chunk:
                running[fd][3].append(chunk)
                continue
            pid, i, _, chunks = running.pop(fd)
            os.close(fd)
            os.waitpid(pid, 0)
            data = b"".join(chunks)
            results[i] = json.loads(data) if data else {"error": "child produced no output"}
            done += 1
            if done % 100 == 0:
                print(f"  {done}/{len(rows)} scored ({time.time() - t0:.0f} s)", file=sys.stderr)
        for fd, (pid, i, start, _) in list(running.items()):
            if time.time() - start > CHILD_LIMIT_S:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(fd)
                running.pop(fd)
                results[i] = {"error": f"harness limit {CHILD_LIMIT_S} s exceeded"}
    return results


# --------------------------------------------------------------------------------------------------
# Building the rows
# --------------------------------------------------------------------------------------------------

class Builder:
    """Collects rows (one per joint action), deduplicated on (dataset, task_id, case)."""

    def __init__(self, items, orig):
        self.rng = random.Random(SEED)
        self.orig = orig
        self.items = items
        self.sols = {(ds, it["task_id"]): Sol(ds, it) for ds, lst in items.items() for it in lst}
        self.ntests = {k: len(orig.utils.extract_test_cases(s.item["test"], s.entry)) for k, s in self.sols.items()}
        self.rows, self.seen = [], set()

    def add(self, ds, item, case, agents, completions):
        key = (ds, item["task_id"], case)
        if key in self.seen:
            return
        self.seen.add(key)
        self.rows.append({"dataset": ds, "item": item, "task_id": item["task_id"], "agents": agents,
                          "completions": list(completions), "case": case})

    def apply(self, ds, task_id, case):
        s = self.sols[(ds, task_id)]
        if case in T2:
            c = T2[case](s, self.rng)
            if c is not None:
                self.add(ds, s.item, case, 2, c)
        else:
            c = T1[case](s, self.rng)
            if c is not None:
                self.add(ds, s.item, case, 1, [c])

    def phase1(self):
        """Every item's solution alone (GRPO) and split into aux + main (MBPP: a seeded sample split)."""
        for ds in ("humaneval", "coophumaneval", "mbpp"):
            for it in self.items[ds]:
                self.apply(ds, it["task_id"], "single_solution")
        for ds in ("humaneval", "coophumaneval"):
            for it in self.items[ds]:
                self.apply(ds, it["task_id"], "split_nonwrapper")
        mbpp_ids = [it["task_id"] for it in self.items["mbpp"]]
        for tid in sorted(self.rng.sample(mbpp_ids, 60), key=mbpp_ids.index):
            self.apply("mbpp", tid, "split_nonwrapper")

    def phase2(self, full_pass):
        """Every edge-case template on one seeded item of each dataset, chosen among the items whose
        solution alone passed all of its (>= 2) tests in phase 1, so that each case shows only the
        behaviour it is about; the timeout cases on one HumanEval item each (>= 5 tests)."""
        pools = {ds: sorted((tid for (d, tid) in full_pass if d == ds and self.ntests[(d, tid)] >= 2),
                            key=lambda t: int(t.split("/")[1]))
                 for ds in self.items}
        for case in list(T2) + list(T1):
            if case in ("split_nonwrapper", "single_solution"):
                continue
            if case in TIMEOUT_CASES:
                tid = self.rng.choice([t for t in pools["humaneval"] if self.ntests[("humaneval", t)] >= 5])
                self.apply("humaneval", tid, case)
                continue
            for ds in ("humaneval", "coophumaneval", "mbpp"):
                self.apply(ds, self.rng.choice(pools[ds]), case)
        # The items named in the brief: `assert True` lines (70, 88, 100), helper functions in the
        # prompt (10, 38, 50), multi-line asserts (1, 87, 113), no test at all (32).
        for tid in ("HumanEval/70", "HumanEval/88", "HumanEval/100", "HumanEval/10", "HumanEval/38",
                    "HumanEval/50", "HumanEval/1", "HumanEval/87", "HumanEval/113", "HumanEval/32"):
            for case in ("wrapper_return_aux", "main_no_aux_call", "split_nonwrapper_with_prompt_docstring",
                         "single_with_prompt_docstring", "single_prompt_echo_plus_body"):
                self.apply("humaneval", tid, case)
        by_id = {ds: {it["task_id"]: it for it in lst} for ds, lst in self.items.items()}
        for ds, it, case, agents, comps in special_cases(by_id):
            self.add(ds, it, case, agents, comps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--orig", required=True, help="checkout of the original repository at the commit above")
    ap.add_argument("--data", default=str(ROOT / "data"), help="folder with humaneval/, coophumaneval/, mbpp/")
    ap.add_argument("--out", default=str(ROOT / "reward-server" / "tests" / "fixtures" / "original_code_reward.jsonl.gz"))
    ap.add_argument("--jobs", type=int, default=2, help="concurrent child processes")
    args = ap.parse_args()

    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable] + sys.argv)

    orig = import_original(args.orig)
    items = load_items(args.data)
    b = Builder(items, orig)
    t0 = time.time()
    b.phase1()
    n1 = len(b.rows)
    print(f"phase 1: {n1} joint actions; scoring with {args.jobs} jobs ...", file=sys.stderr)
    results = run_all(orig, b.rows, args.jobs)
    full_pass = {(r["dataset"], r["task_id"]) for r, res in zip(b.rows, results)
                 if r["case"] == "single_solution" and "error" not in res
                 and 0 < res["logger"]["total_tests"] == res["logger"]["passed_tests"]}
    b.phase2(full_pass)
    print(f"phase 2: {len(b.rows) - n1} joint actions ...", file=sys.stderr)
    results += run_all(orig, b.rows[n1:], args.jobs)

    errors = 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # gzip with a fixed mtime, so that two runs give byte-identical files.
    with gzip.GzipFile(out, "wb", mtime=0) as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
        for row, res in zip(b.rows, results):
            if "error" in res:
                errors += 1
                print(f"ERROR {row['dataset']} {row['task_id']} {row['case']}: {res['error']}", file=sys.stderr)
                continue
            rec = {"dataset": row["dataset"], "task_id": row["task_id"], "agents": row["agents"],
                   "completions": row["completions"], "reward": res["reward"], "case": row["case"],
                   "logger": res["logger"], "reward_log": res["reward_log"], "extracted": res["extracted"],
                   "item_traits": item_traits(row["item"], orig)}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    disagree = [(r["dataset"], r["task_id"], r["case"]) for r, res in zip(b.rows, results)
                if "error" not in res and abs(res["reward"] - res["logger"]["total_reward"]) > 1e-9]
    print(f"wrote {len(b.rows) - errors} lines to {out} in {time.time() - t0:.0f} s ({errors} errors); "
          f"reward != logger total on {len(disagree)}: {disagree}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

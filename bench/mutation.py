"""Mutation testing of lora_ppo's numerical code: make one single-point change (a mutant) at a
time in a target function, run that target's fast tests against it in a temporary copy of the
repository, and report the mutants no test notices. The working tree is never edited.

    python bench/mutation.py --target lora_ppo/atomic.py       # one file, about 10 min on 2 cores
    python bench/mutation.py --target lora_ppo/roles.py:position_ids_for,last_real_index --list
    python bench/mutation.py --target lora_ppo/update.py --max-mutants 70 --json /tmp/update.json
    python bench/mutation.py --update-results                  # every default target (about 250 min)

A target is `path` or `path:name,name`, where a name is a function, method or class, and
`name@text` keeps only the lines of `name` that contain `text`. Known-equivalent mutants are
read from bench/mutation_results.md (or --equivalent FILE) by their stable id, so the score is
killed / non-equivalent. See bench/README.md, section mutation.py.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS_MD = REPO / "bench" / "mutation_results.md"

# What the temp copy holds: enough to import the package and run its tests, nothing else.
# bench/model_configs: real shapes for estimates; docs/: the tests that hold the code to what it documents.
COPY_PREFIXES = ("lora_ppo/", "tests/", "recipes/", "bench/model_configs/", "docs/")
COPY_FILES = ("pyproject.toml",)
COPY_BASENAMES = ("conftest.py",)

SAMPLE_SEED = 0
# A mutant's tests may run this much longer than the unmutated baseline before it counts as a
# hang (killed, "timeout"); the margin absorbs the other jobs sharing this machine's two cores.
TIMEOUT_FACTOR = 3.0
TIMEOUT_MARGIN_S = 30.0
# In one process (`-n 0`, not the suite's two workers): the tests run in their order, fastest first,
# and `-x` stops at the first that fails.
PYTEST_ARGS = ("-x", "-q", "-n", "0", "-p", "no:cacheprovider")
ID_LENGTH = 12
ID_PATTERN = rf"[0-9a-f]{{{ID_LENGTH}}}"
NOT_KILLED = "not killed yet"
RESULTS_MD_HEADER = """# Mutation testing results

Written by `python bench/mutation.py --update-results` (see bench/README.md, section mutation.py).
One section per target: its score, then each surviving mutant with its stable id. The verdict
column is either `equivalent: <why, in one line>` (no finite input tells the mutant apart in what
the package computes; differences only in NaN handling the trainer never reaches, in log lines,
or in memory count as equivalent; the score leaves it out) or `not killed yet: <an input or check
that would tell it apart>`. Verdicts are kept by id across runs; `--only-survivors` reruns the
open ones.
"""

# Fast tests per target file, fastest first (-x stops at the first failure). Files that do not
# exist yet are skipped, so this table may name tests still being written. Extra pytest
# arguments (a -k filter) apply to the whole run of that target.
TESTS: dict[str, tuple[list[str], list[str]]] = {
    "lora_ppo/ppo_math.py": (["tests/math/test_ppo_math.py", "tests/math/test_ppo_math_options.py",
                              "tests/math/test_ppo_math_edges.py", "tests/test_edge_cases.py"], []),
    "lora_ppo/logprobs.py": (["tests/math/test_logprobs.py", "tests/test_model_checks.py", "tests/test_roles.py",
                              "tests/test_rollout_generation_logprobs.py"], []),
    "lora_ppo/update.py": (["tests/test_update_absolute.py", "tests/test_update.py",
                            "tests/test_update_invariances.py", "tests/test_trainer_guards.py"], []),
    "lora_ppo/trainer.py": (["tests/test_score_shaping.py", "tests/test_trainer.py",
                             "tests/test_trainer_guards.py",
                             "tests/test_model_architectures.py::test_the_self_check_stops_the_first_step_when_the_transform_is_dropped",
                             "tests/test_compiled_update.py::test_a_run_with_the_update_compiled_trains_as_one_without_and_compiles_once"],
                            []),
    "lora_ppo/rollout.py": (["tests/test_positions.py", "tests/test_rollout*.py", "tests/test_score_shaping.py",
                             "tests/test_generation_settings.py", "tests/test_sft_samples.py",
                             "tests/test_compiled_generation.py", "tests/test_scoring_together.py",
                             "tests/test_trim_padding.py", "tests/test_packing.py", "tests/test_distributed.py"], []),
    "lora_ppo/model.py": (["tests/test_devices.py", "tests/test_chat_template_kwargs.py", "tests/test_model.py",
                           "tests/test_model_checks.py",
                           "tests/test_fused_4bit_decode.py::test_decode_sized_no_grad_calls_take_the_kernel_and_give_the_models_logits",
                           "tests/test_bnb_workarounds.py", "tests/test_memory_levers.py",
                           "tests/test_sft_training.py::test_hostile_data_is_one_line_and_exit_2[rows longer than the context]"],
                          []),
    "lora_ppo/compiled_generation.py": (["tests/test_compiled_generation.py"], []),
    "lora_ppo/roles.py": (["tests/test_positions.py", "tests/test_roles.py", "tests/test_scoring_together.py",
                           "tests/test_reward_training.py::test_pairs_are_scored_at_their_last_real_token_whatever_the_padding",
                           "tests/test_reward_training.py::test_reward_adapter_scores_equal_a_direct_forward",
                           "tests/test_roles_gradient_checkpointing.py", "tests/test_model.py", "tests/test_packing.py",
                           "tests/test_fused_lora.py", "tests/test_reward_training.py", "tests/test_trained.py",
                           "tests/test_model_checks.py", "tests/test_model_architectures.py",
                           "tests/test_estimate.py::test_lora_parameters_match_peft"], []),
    "lora_ppo/peft_workarounds.py": (["tests/test_peft_workarounds.py",
                                      "tests/test_model_architectures.py::test_every_adapter_on_an_moe_model_holds_the_same_layers_and_loads_whole"],
                                     []),
    "lora_ppo/model_shape.py": (["tests/test_estimate.py", "tests/test_estimate_sft.py", "tests/test_auto_sizes.py"], []),
    "lora_ppo/verifiable.py": (["tests/test_verifiable.py"], []),
    "lora_ppo/padding.py": (["tests/test_trim_padding.py", "tests/test_packing.py"], []),
    "lora_ppo/packing.py": (["tests/test_packing.py", "tests/test_sft_model.py"], []),
    "lora_ppo/fused_lora.py": (["tests/test_lean_lora.py", "tests/test_fused_lora.py"], []),
    "lora_ppo/adapter_switch.py": (["tests/test_roles.py", "tests/test_scoring_together.py"], []),
    "lora_ppo/perf.py": (["tests/test_perf.py"], []),
    "lora_ppo/alarms.py": (["tests/test_alarms.py"], []),
    "lora_ppo/estimate.py": (["tests/test_auto_sizes.py", "tests/test_estimate.py"], []),
    "lora_ppo/sft/batches.py": (["tests/test_sft_model.py"], []),
    "lora_ppo/sft/rows.py": (["tests/test_sft_rows.py"], []),
    "lora_ppo/rewards.py": (["tests/test_reward_imports.py", "tests/test_rewards.py", "tests/test_recipes.py",
                             "tests/test_trainer_guards.py",
                             "tests/test_python_api.py::test_python_reward_callable_overrides_recipe",
                             "tests/test_python_api.py::test_a_python_reward_is_what_the_run_records"], []),
    "lora_ppo/optimizers.py": (["tests/test_optimizers.py", "tests/test_checkpoint_files.py", "tests/test_memory_levers.py"],
                               []),
    "lora_ppo/sizing.py": (["tests/test_auto_sizes.py", "tests/test_memory_levers.py"], []),
    # The SIGKILL test kills a whole training run at a marker: minutes, and it tests resuming.
    "lora_ppo/atomic.py": (["tests/test_atomic.py", "tests/test_edge_cases.py", "tests/test_checkpoint.py"],
                           ["-k", "not sigkill"]),
    "lora_ppo/checkpoint.py": (["tests/test_checkpoint_files.py", "tests/test_run_dir.py", "tests/test_edge_cases.py",
                                "tests/test_distributed.py::test_a_checkpoint_of_one_process_is_refused_before_launching_two",
                                "tests/test_distributed.py::test_a_checkpoint_of_two_processes_is_refused_in_one_before_the_model_loads",
                                "tests/test_checkpoint.py"], ["-k", "not sigkill"]),
    "lora_ppo/export.py": (["tests/export/test_parity_limits.py", "tests/export/test_export_errors_and_adapters.py",
                            "tests/export/test_merge.py", "tests/export/test_model_card.py"], []),
    "lora_ppo/parity.py": (["tests/export/test_parity_limits.py", "tests/export/test_parity_measures.py",
                            "tests/export/test_merge.py", "tests/export/test_export_errors_and_adapters.py"], []),
    "lora_ppo/model_card.py": (["tests/export/test_model_card.py", "tests/export/test_merge.py",
                                "tests/export/test_export_errors_and_adapters.py"], []),
    "lora_ppo/sft/model.py": (["tests/test_sft_model.py"], []),
    "lora_ppo/evaluation.py": (["tests/test_evaluation.py", "tests/test_agent_episodes_scripted.py"], []),
    "lora_ppo/run_dir.py": (["tests/test_run_dir.py", "tests/test_checkpoint_files.py",
                             "tests/export/test_export_errors_and_adapters.py"], []),
    "lora_ppo/agents/tools.py": (["tests/test_agent_tools.py", "tests/test_agent_episodes_scripted.py"], []),
    "lora_ppo/agents/episodes.py": (["tests/test_agent_episode_layout.py", "tests/test_agent_episodes_scripted.py",
                                     "tests/test_agent_episodes.py", "tests/test_agents_doc_example.py",
                                     "tests/test_evaluation.py"], []),
    "lora_ppo/agents/environment.py": (["tests/test_agent_environment.py", "tests/test_agent_episode_layout.py",
                                        "tests/test_agent_episodes.py", "tests/test_agents_doc_example.py"], []),
    "lora_ppo/agents/given.py": (["tests/test_agent_episodes.py", "tests/test_agents_doc_example.py"], []),
    "lora_ppo/data.py": (["tests/test_data.py", "tests/test_builtin_datasets.py", "tests/test_reward_training.py"], []),
    "lora_ppo/adapter_training.py": (["tests/test_adapter_training.py", "tests/test_sft_model.py",
                                      "tests/test_sft_training.py", "tests/test_reward_training.py"], []),
    "lora_ppo/reward_training.py": (["tests/test_reward_training.py", "tests/test_adapter_training.py"], []),
    "lora_ppo/sft/trainer.py": (["tests/test_sft_model.py", "tests/test_sft_training.py",
                                 "tests/test_adapter_training.py"], []),
    "lora_ppo/sft/samples.py": (["tests/test_sft_samples.py", "tests/test_sft_training.py"], []),
    "lora_ppo/metrics.py": (["tests/test_step_metrics.py", "tests/test_kl_noise_floor.py", "tests/test_perf.py"], []),
    "lora_ppo/summary.py": (["tests/test_summary.py"], []),
    "lora_ppo/state.py": (["tests/test_state.py", "tests/test_checkpoint_files.py"], []),
    "lora_ppo/devices.py": (["tests/test_devices.py"], []),
    "lora_ppo/quantization.py": (["tests/test_devices.py", "tests/test_adapter_autocast.py", "tests/test_model.py",
                                  "tests/test_rewards.py::test_the_head_is_every_top_level_module_outside_the_base_model",
                                  "tests/test_rewards.py::test_a_model_that_is_its_own_base_keeps_no_head_and_quantizes_its_layers",
                                  "tests/test_memory_levers.py"], []),
    "lora_ppo/memory.py": (["tests/test_memory.py", "tests/test_devices.py"], []),
    "lora_ppo/model_checks.py": (["tests/test_model_checks.py",
                                  "tests/test_sft_model.py::test_packing_is_refused_where_attention_crosses_rows",
                                  "tests/test_library_notices.py::test_parity_greedy_decoding_uses_the_cache_keyword_and_matches_generate",
                                  "tests/test_compiled_generation.py::test_a_forward_that_takes_its_cache_as_past_key_values_decodes_with_its_context",
                                  "tests/test_model_architectures.py::test_a_model_whose_logit_transform_is_missed_is_refused_at_load",
                                  "tests/test_packing.py::test_packing_is_refused_where_attention_crosses_rows"], []),
    "lora_ppo/config.py": (["tests/test_config.py", "tests/test_config_fuzz.py", "tests/test_recipes.py",
                            "tests/test_cli.py"], []),
    "lora_ppo/trained.py": (["tests/test_trained.py",
                             "tests/test_agent_episodes.py::test_generate_on_an_environment_recipe_plays_episodes_that_step_takes_back",
                             "tests/test_agent_episodes.py::test_generate_on_a_run_with_an_environment_plays_its_episodes",
                             "tests/test_sft_training.py::test_ctrl_c_saves_a_checkpoint_after_the_step_and_says_how_to_resume"],
                            []),
    "lora_ppo/signals.py": (["tests/test_trainer_guards.py",
                             "tests/test_sft_training.py::test_ctrl_c_saves_a_checkpoint_after_the_step_and_says_how_to_resume"],
                            []),
    "lora_ppo/tracking.py": (["tests/test_tracking.py", "tests/test_adapter_training.py"], []),
    # The kernel-compile test runs bench/nf4_kernel_compile.py, which a mutant's copy does not hold.
    "lora_ppo/bnb_workarounds.py": (["tests/test_bnb_workarounds.py", "tests/test_memory_levers.py",
                                     "tests/test_fused_4bit_decode.py"], ["-k", "not kernel_compiles"]),
    "lora_ppo/step_log.py": (["tests/test_step_log.py", "tests/test_step_metrics.py", "tests/test_alarms.py",
                              "tests/test_progress.py", "tests/test_tracking.py", "tests/test_agent_episodes.py"], []),
    "lora_ppo/report.py": (["tests/test_report_plots.py", "tests/test_report.py",
                            "tests/test_sft_training.py::test_report_shows_the_loss_and_the_samples_before_and_after"], []),
    "lora_ppo/errors.py": (["tests/test_errors.py"], []),
    "lora_ppo/progress.py": (["tests/test_progress.py"], []),
}

# The numerical code issue #32 asks about (trainer, rollout and roles only in part), the layouts
# of trimmed and packed micro-batches (issue 41), the LoRA layers' forwards (every pass runs one), the
# role switches that choose their adapter, the perf/* throughput a run reports (issue 41), the
# alarms a run raises, SFT's rows, batches and target logprobs (which tokens the loss predicts, and
# how), and the held-out evaluation's means and standard errors. Targets too, not default ones: the
# auto sizes' choices in estimate.py (312 mutants at about 20 s each), the reward sources
# (rewards.py, about 65 min), the checkpoints (checkpoint.py, about 140 min: a survivor runs resumed
# training runs), merge-and-export (export.py, parity.py, model_card.py: about 45, 40 and 10 min),
# the run folder (run_dir.py, about 20 min), the agents' tools (agents/tools.py, about 11 min), their
# episodes, environments and given rollouts (agents/episodes.py, environment.py, given.py: about 85, 6
# and 40 min), the prompt and preference rows of data.py (its main functions: about 40 min), the
# stages before PPO (adapter_training.py, reward_training.py, sft/trainer.py, sft/samples.py: about
# 30, 13, 18 and 4 min), the recipe schema (config.py: about 35 min), a step's record (metrics.py:
# about 4 min), the run's summary (summary.py: 1 min), its saved state (state.py: 1 min), the
# device choice (devices.py: 2 min), the peak memory per phase (memory.py: 6 min) and the base model's
# loading and free memory (model.py's functions but the tokenizer's: about 30 min) and its number formats
# (quantization.py: about 14 min); Ctrl-C and SIGTERM (signals.py: 12 min), the trackers (tracking.py:
# 12 min), a step's record (step_log.py: about 45 min), eval and generate (trained.py: about 16 min)
# and the 4-bit layers' workarounds (bnb_workarounds.py); the report (report.py: about 50 min, its
# figures read back), the one-line errors (errors.py: 1.5 min) and progress lines (progress.py: 1 min).
DEFAULT_TARGETS = [
    "lora_ppo/atomic.py",
    "lora_ppo/verifiable.py",
    "lora_ppo/ppo_math.py",
    "lora_ppo/logprobs.py",
    "lora_ppo/update.py",
    "lora_ppo/roles.py:position_ids_for,last_real_index,logprobs_from_hidden,values_from_hidden,sequence_scores",
    "lora_ppo/trainer.py:_shape_scores,_combined_scores",
    "lora_ppo/rollout.py:truncate_at_stop,join_prompt_response,left_pad,SampledTokenLogprobs,"
    "collect_rollout@missing_eos_penalty",
    "lora_ppo/padding.py",
    "lora_ppo/packing.py",
    "lora_ppo/fused_lora.py:lean_lora_forward,_scaled_product,lora_addmm_forward,_with_adapters,_runs",
    "lora_ppo/adapter_switch.py",
    "lora_ppo/perf.py",
    "lora_ppo/alarms.py",
    "lora_ppo/sft/batches.py",
    "lora_ppo/sft/rows.py",
    "lora_ppo/sft/model.py",
    "lora_ppo/evaluation.py",
]

# Calls that only report: mutating them changes what is said, never what is computed.
LOGGER_NAMES = {"logger", "log", "logging", "_log", "_logger", "LOGGER", "warnings"}
LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}

BINOP_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.Pow: ast.Mult,
               ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd}
OP_TEXT = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**", ast.BitAnd: "&",
           ast.BitOr: "|"}
COMPARE_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                 ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
COMPARE_TEXT = {ast.Lt: r"<(?!=)", ast.LtE: r"<=", ast.Gt: r">(?!=)", ast.GtE: r">=", ast.Eq: r"==",
                ast.NotEq: r"!=", ast.Is: r"\bis\b(?!\s+not\b)", ast.IsNot: r"\bis\s+not\b"}
COMPARE_OUT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
               ast.Is: "is", ast.IsNot: "is not"}
UNARY_TEXT = {ast.Not: "not", ast.USub: "-", ast.Invert: "~"}
MIN_MAX = {"min": "max", "max": "min", "minimum": "maximum", "maximum": "minimum", "amin": "amax", "amax": "amin"}


@dataclass(frozen=True)
class Target:
    path: str  # relative to the repository root
    names: Optional[tuple[str, ...]]  # functions / classes to mutate (None: the whole file)

    @classmethod
    def parse(cls, spec: str) -> "Target":
        path, _, names = spec.partition(":")
        return cls(path, tuple(n.strip() for n in names.split(",") if n.strip()) if names else None)

    @property
    def spec(self) -> str:
        return self.path + (":" + ",".join(self.names) if self.names else "")


@dataclass
class Mutant:
    id: str
    file: str
    line: int
    function: str
    operator: str
    original: str  # the original source line(s), stripped
    mutated: str
    source: str = dataclasses.field(repr=False)  # the whole mutated file
    status: str = "not run"  # killed / timeout / survived
    killed_by: str = ""
    seconds: float = 0.0
    equivalent: bool = False


# ---- finding mutants ---------------------------------------------------------------------------

class _Source:
    """Character offsets of AST positions (whose columns are UTF-8 byte offsets)."""

    def __init__(self, text: str):
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col].decode(errors="ignore"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]


@dataclass
class _Candidate:
    """One single-point change: how it reads in the source and what the AST becomes."""

    node_index: int  # the node's position in ast.walk order
    operator: str
    edits: list[tuple[int, int, str]]  # replace text[start:end] by this, for each
    mutate: Callable[[ast.AST, ast.AST], Optional[ast.AST]]  # (node, parent) -> replacement node or None


def _between(src: _Source, left: ast.AST, right: ast.AST) -> tuple[int, str]:
    """The text between two operands (operators, parens, comments), comments blanked out."""
    start, end = src.span(left)[1], src.span(right)[0]
    text = re.sub(r"#[^\n]*", lambda m: " " * len(m.group()), src.text[start:end])
    return start, text


def _op_edit(src: _Source, left: ast.AST, right: ast.AST, pattern: str, new: str) -> Optional[tuple[int, int, str]]:
    start, text = _between(src, left, right)
    found = re.search(pattern, text)
    return (start + found.start(), start + found.end(), new) if found else None


def _is_logging_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "print"
    return (isinstance(func, ast.Attribute) and func.attr in LOG_METHODS
            and isinstance(func.value, ast.Name) and func.value.id in LOGGER_NAMES)


def _skipped_fields(node: ast.AST) -> set[str]:
    """Fields never mutated: annotations, decorators, an assert's message."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {"returns", "decorator_list"}
    if isinstance(node, ast.ClassDef):
        return {"decorator_list"}
    if isinstance(node, (ast.arg, ast.AnnAssign)):
        return {"annotation"}
    if isinstance(node, ast.Assert):
        return {"msg"}
    return set()


def _walk_in_scope(tree: ast.AST, target: Target, src: _Source) -> Iterator[tuple[ast.AST, ast.AST, str]]:
    """(node, parent, qualified function name) for every node the target may mutate."""
    names = {}
    for name in target.names or ():
        base, _, text = name.partition("@")
        names[base] = text or None

    def visit(node: ast.AST, parent: Optional[ast.AST], scope: tuple[str, ...], selected: Optional[str] | bool):
        if isinstance(node, (ast.Raise, ast.JoinedStr)) or _is_logging_call(node):
            return  # error messages, f-strings and logs: what is said, not what is computed
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return  # a docstring
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = scope + (node.name,)
            if target.names is not None and node.name in names and selected is False:
                selected = names[node.name] or True
        in_scope = selected is True or target.names is None
        if isinstance(selected, str) and hasattr(node, "lineno"):
            in_scope = selected in src.lines[node.lineno - 1]
        if in_scope and parent is not None:
            yield node, parent, ".".join(scope) or "<module>"
        skipped = _skipped_fields(node)
        for field, value in ast.iter_fields(node):
            if field in skipped:
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    yield from visit(child, node, scope, selected)

    yield from visit(tree, None, (), False)


def _number_mutation(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return {0: 1, 1: 0}.get(value, value + 1)
    if isinstance(value, float):
        return 1.0 if value == 0 else value * 2
    return None


def _candidates(node: ast.AST, parent: ast.AST, index: int, src: _Source) -> Iterator[_Candidate]:
    """Every single-point mutant of one node."""
    if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in BINOP_SWAPS:
        old, new = type(node.op), BINOP_SWAPS[type(node.op)]
        left, right = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.target, node.value)
        suffix = "=" if isinstance(node, ast.AugAssign) else ""
        edit = _op_edit(src, left, right, re.escape(OP_TEXT[old] + suffix), OP_TEXT[new] + suffix)
        if edit:
            kind = "bitwise" if old in (ast.BitAnd, ast.BitOr) else "arithmetic"

            def swap_op(n, p, new=new):
                n.op = new()

            yield _Candidate(index, f"{kind} {OP_TEXT[old]}{suffix} -> {OP_TEXT[new]}{suffix}", [edit], swap_op)

    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            if type(op) not in COMPARE_SWAPS:
                continue
            new = COMPARE_SWAPS[type(op)]
            edit = _op_edit(src, operands[i], operands[i + 1], COMPARE_TEXT[type(op)], COMPARE_OUT[new])
            if edit:
                def swap_cmp(n, p, i=i, new=new):
                    n.ops[i] = new()

                yield _Candidate(index, f"comparison {COMPARE_OUT[type(op)]} -> {COMPARE_OUT[new]}", [edit], swap_cmp)

    if isinstance(node, ast.BoolOp):
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        edits = [_op_edit(src, a, b, rf"\b{old}\b", new) for a, b in zip(node.values, node.values[1:])]
        if all(edits):
            def swap_bool(n, p):
                n.op = ast.Or() if isinstance(n.op, ast.And) else ast.And()

            yield _Candidate(index, f"boolean {old} -> {new}", edits, swap_bool)

    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_TEXT:
        start = src.span(node)[0]
        yield _Candidate(index, f"unary {UNARY_TEXT[type(node.op)]} removed", [(start, src.span(node.operand)[0], "")],
                         lambda n, p: n.operand)

    if isinstance(node, ast.Constant) and not isinstance(node.value, str):
        new_value = _number_mutation(node.value)
        if new_value is not None and not (isinstance(parent, ast.UnaryOp) and node.value == 0):
            start, end = src.span(node)
            written = src.text[start:end]
            text = oct(new_value) if written.lower().startswith("0o") and not isinstance(new_value, bool) else repr(
                new_value)
            yield _Candidate(index, f"constant {written} -> {text}", [(start, end, text)],
                             lambda n, p, v=new_value: ast.Constant(v))

    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in MIN_MAX and (isinstance(func, ast.Attribute) or name in ("min", "max")):
            end = src.span(func)[1]

            def swap_name(n, p, new=MIN_MAX[name]):
                if isinstance(n.func, ast.Name):
                    n.func.id = new
                else:
                    n.func.attr = new

            yield _Candidate(index, f"{name} -> {MIN_MAX[name]}", [(end - len(name), end, MIN_MAX[name])], swap_name)
        args = node.args
        if not any(isinstance(a, ast.Starred) for a in args):
            for i in range(len(args) - 1):
                a, b = args[i], args[i + 1]
                if ast.dump(a) == ast.dump(b):
                    continue
                start, end = src.span(a)[0], src.span(b)[1]
                between = src.text[src.span(a)[1]:src.span(b)[0]]

                def swap_args(n, p, i=i):
                    n.args[i], n.args[i + 1] = n.args[i + 1], n.args[i]

                yield _Candidate(index, f"swap arguments {i + 1} and {i + 2}",
                                 [(start, end, src.segment(b) + between + src.segment(a))], swap_args)

    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        start, end = src.span(node)
        yield _Candidate(index, "call removed", [(start, end, "pass")], lambda n, p: ast.Pass())

    if isinstance(node, ast.Slice):
        for bound in ("lower", "upper"):
            value = getattr(node, bound)
            if value is None:
                continue
            for op, text in ((ast.Add, "+"), (ast.Sub, "-")):
                start, end = src.span(value)

                def shift(n, p, bound=bound, op=op):
                    setattr(n, bound, ast.BinOp(getattr(n, bound), op(), ast.Constant(1)))

                yield _Candidate(index, f"slice {bound} {text}1", [(start, end, f"{src.segment(value)} {text} 1")],
                                 shift)


def _replace_child(parent: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for field, value in ast.iter_fields(parent):
        if value is old:
            setattr(parent, field, new)
            return
        if isinstance(value, list):
            for i, item in enumerate(value):
                if item is old:
                    value[i] = new
                    return
    raise ValueError("child not found")


def _mutated_tree(tree: ast.AST, cand: _Candidate) -> tuple[ast.AST, ast.AST]:
    """A copy of the module with the change made to the AST itself, and the changed node."""
    mutated = copy.deepcopy(tree)
    nodes = list(ast.walk(mutated))
    node = nodes[cand.node_index]
    parent = next(p for p in nodes if any(c is node for c in ast.iter_child_nodes(p)))
    replacement = cand.mutate(node, parent)
    if replacement is not None:
        _replace_child(parent, node, replacement)
    return mutated, replacement or node


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def _lines_changed(original: str, mutated: str) -> tuple[int, str, str]:
    """(first changed line, the original line(s), the mutated line(s)), stripped and joined."""
    a, b = original.splitlines(), mutated.splitlines()
    first = 0
    while first < min(len(a), len(b)) and a[first] == b[first]:
        first += 1
    last_a, last_b = len(a) - 1, len(b) - 1
    while last_a > first and last_b > first and a[last_a] == b[last_b]:
        last_a, last_b = last_a - 1, last_b - 1
    join = lambda lines: " ".join(line.strip() for line in lines)  # noqa: E731
    return first + 1, join(a[first:last_a + 1]), join(b[first:last_b + 1])


def stable_id(file: str, function: str, operator: str, original: str, mutated: str, occurrence: int) -> str:
    """A hash of what the mutant is, not where: edits elsewhere in the file keep it. `occurrence`
    tells apart the same change on identical lines of one function."""
    norm = lambda s: " ".join(s.split())  # noqa: E731
    key = "\x1f".join([file, function, operator, norm(original), norm(mutated), str(occurrence)])
    return hashlib.sha256(key.encode()).hexdigest()[:ID_LENGTH]


def find_mutants(target: Target, root: Path = REPO) -> tuple[list[Mutant], int]:
    """The target's mutants, in source order, and how many candidates were discarded (their text
    did not parse to the intended AST, or they did not compile)."""
    text = (root / target.path).read_text(encoding="utf-8")
    tree = ast.parse(text)
    src = _Source(text)
    index_of = {id(node): i for i, node in enumerate(ast.walk(tree))}
    mutants, seen, counts, discarded = [], set(), {}, 0
    for node, parent, function in _walk_in_scope(tree, target, src):
        for cand in _candidates(node, parent, index_of[id(node)], src):
            mutated = _apply(text, cand.edits)
            mutated_tree, changed = _mutated_tree(tree, cand)
            expected = ast.dump(mutated_tree)  # what the text edit must parse to
            if not _parses_to(mutated, expected):
                # Precedence changed (`a / b**2` -> `a / b*2`): parenthesise the node instead.
                mutated = _parenthesised(text, tree, src, cand.node_index, changed)
                if mutated is None or not _parses_to(mutated, expected):
                    discarded += 1
                    continue
            if mutated in seen or mutated == text:
                continue
            try:
                compile(mutated, target.path, "exec")
            except (SyntaxError, ValueError):
                discarded += 1
                continue
            seen.add(mutated)
            line, original_line, mutated_line = _lines_changed(text, mutated)
            key = (function, cand.operator, original_line, mutated_line)
            counts[key] = counts.get(key, 0) + 1
            mutants.append(Mutant(stable_id(target.path, function, cand.operator, original_line, mutated_line,
                                            counts[key] - 1),
                                  target.path, line, function, cand.operator, original_line, mutated_line, mutated))
    return mutants, discarded


def _parses_to(text: str, expected: str) -> bool:
    try:
        return ast.dump(ast.parse(text)) == expected
    except SyntaxError:
        return False


def _parenthesised(text: str, tree: ast.AST, src: _Source, node_index: int, changed: ast.AST) -> Optional[str]:
    """The source with the original node replaced by the changed one, unparsed in parentheses."""
    original = list(ast.walk(tree))[node_index]
    if not isinstance(original, ast.expr):
        return None
    start, end = src.span(original)
    return text[:start] + "(" + ast.unparse(changed) + ")" + text[end:]


def sample(mutants: list[Mutant], n: Optional[int], seed: int = SAMPLE_SEED) -> list[Mutant]:
    """A deterministic sample of `n` mutants: those whose seeded hash of their stable id is lowest,
    so a mutant's membership does not depend on the others."""
    if n is None or n >= len(mutants):
        return mutants
    rank = lambda m: hashlib.sha256(f"{seed}:{m.id}".encode()).hexdigest()  # noqa: E731
    chosen = {m.id for m in sorted(mutants, key=rank)[:n]}
    return [m for m in mutants if m.id in chosen]


# ---- running -----------------------------------------------------------------------------------

def repository_files(root: Path = REPO) -> list[str]:
    """Tracked files plus untracked files git does not ignore, limited to what the tests need."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                            check=True, capture_output=True, text=True).stdout.splitlines()
    return sorted({f for f in listed if (f.startswith(COPY_PREFIXES) or f in COPY_FILES
                                          or Path(f).name in COPY_BASENAMES) and (root / f).is_file()})


def make_copy(root: Path = REPO) -> Path:
    # No "lora_ppo" in the name: a test asserts that no traceback line mentions the package.
    copy_root = Path(tempfile.mkdtemp(prefix="mutation-copy-"))
    for rel in repository_files(root):
        dest = copy_root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest)
    return copy_root


def test_command(target: Target, copy_root: Path) -> list[str]:
    """pytest's arguments for a target: its tests that exist in the copy, and its extra options."""
    tests, extra = TESTS.get(target.path, ([], []))
    chosen: list[str] = []
    for test in tests:
        path, sep, node = test.partition("::")
        matches = sorted(glob.glob(str(copy_root / path))) if any(c in path for c in "*?[") else (
            [str(copy_root / path)] if (copy_root / path).exists() else [])
        if node:  # a test that was renamed or removed is skipped like a missing file
            matches = [m for m in matches if f"def {node.split('[')[0]}(" in Path(m).read_text(encoding="utf-8")]
        for match in matches:
            arg = os.path.relpath(match, copy_root) + sep + node
            if arg not in chosen:
                chosen.append(arg)
    return [*chosen, *extra]


def run_tests(copy_root: Path, args: list[str], timeout: Optional[float]) -> tuple[str, str, float]:
    """("passed" | "failed" | "timeout", the first failing test or the tail of the output, seconds)."""
    env = dict(os.environ, PYTHONPATH=str(copy_root), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    t0 = time.perf_counter()
    # A session of its own, so a hung mutant's whole process group (dataloaders, subprocesses) is killed.
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *PYTEST_ARGS, *args], cwd=copy_root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "timeout", "", time.perf_counter() - t0
    except BaseException:  # Ctrl-C or SIGTERM: leave no test process behind
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    seconds = time.perf_counter() - t0
    if proc.returncode == 0:
        return "passed", "", seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)
    return "failed", failed[0] if failed else out.strip().splitlines()[-1][:200] if out.strip() else "", seconds


def check_copy_imports_itself(copy_root: Path) -> None:
    """The tests must import the copy's lora_ppo, not the working tree's (editable install)."""
    env = dict(os.environ, PYTHONPATH=str(copy_root), PYTHONDONTWRITEBYTECODE="1")
    found = subprocess.run([sys.executable, "-c", "import lora_ppo; print(lora_ppo.__file__)"], cwd=copy_root,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(copy_root.resolve()):
        sys.exit(f"mutation.py: the temp copy imports lora_ppo from {found}, not from the copy; stopping")


def run_target(target: Target, mutants: list[Mutant], copy_root: Path, timeout: Optional[float],
               log: Callable[[str], None]) -> dict:
    args = test_command(target, copy_root)
    if not [a for a in args if a.startswith("tests")]:
        sys.exit(f"mutation.py: no test file of {target.path} exists (see TESTS in bench/mutation.py)")
    status, detail, baseline_s = run_tests(copy_root, args, None)
    if status != "passed":
        sys.exit(f"mutation.py: the unmutated tests of {target.path} do not pass ({detail}); fix them first:\n"
                 f"  python -m pytest {' '.join(PYTEST_ARGS)} {' '.join(args)}")
    limit = timeout if timeout is not None else baseline_s * TIMEOUT_FACTOR + TIMEOUT_MARGIN_S
    log(f"{target.spec}: {len(mutants)} mutants; tests {' '.join(args)} pass unmutated in {baseline_s:.1f} s; "
        f"timeout {limit:.0f} s")
    path = copy_root / target.path
    original = path.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    try:
        for i, mutant in enumerate(mutants, 1):
            path.write_text(mutant.source, encoding="utf-8")
            status, detail, mutant.seconds = run_tests(copy_root, args, limit)
            mutant.status = {"failed": "killed", "passed": "survived"}.get(status, status)
            mutant.killed_by = detail
            log(f"  [{i}/{len(mutants)}] {mutant.status:8s} {mutant.seconds:5.1f} s  {mutant.file}:{mutant.line} "
                f"{mutant.operator}: {mutant.mutated}")
    finally:
        path.write_text(original, encoding="utf-8")
    return {"tests": args, "baseline_s": round(baseline_s, 1), "timeout_s": round(limit),
            "seconds": round(time.perf_counter() - t0, 1)}


# ---- results -----------------------------------------------------------------------------------

def known_equivalent(path: Path) -> set[str]:
    """Ids of mutants marked equivalent: table rows of mutation_results.md whose verdict column
    starts with "equivalent" (or, in any other file, one id per line, `#` comments)."""
    if not path.exists():
        return set()
    ids = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("|"):
            verdict = _verdicts_in(line)
            ids.update(i for i, v in verdict.items() if v.lower().startswith("equivalent"))
        else:
            word = line.split("#")[0].strip()
            if re.fullmatch(ID_PATTERN, word):
                ids.add(word)
    return ids


def _verdicts_in(text: str) -> dict[str, str]:
    """{id: verdict} of the table rows in `text` (the id first, the verdict last)."""
    verdicts = {}
    for line in text.splitlines():
        cells = [c.strip().strip("`") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("|") and len(cells) >= 2 and re.fullmatch(ID_PATTERN, cells[0]):
            verdicts[cells[0]] = cells[-1]
    return verdicts


def update_results_md(path: Path, results: list[dict], date: str) -> None:
    """Rewrite each run target's section of the results file: its score and a row per survivor,
    keeping the verdict already written for an id (new survivors are "not killed yet")."""
    text = path.read_text(encoding="utf-8") if path.exists() else RESULTS_MD_HEADER
    verdicts = _verdicts_in(text)
    cell = lambda s: "`" + s.replace("|", "\\|") + "`" if s else ""  # noqa: E731
    for r in results:
        rows = [f"| {cell(s['id'])} | {s['file']}:{s['line']} {s['function']} | {s['operator']} | "
                f"{cell(s['original'])} | {cell(s['mutated'])} | {verdicts.get(s['id'], NOT_KILLED)} |"
                for s in r["survivors"]]
        # The score as the verdicts written here have it (they may be newer than the run).
        equivalent = sum(verdicts.get(s["id"], "").lower().startswith("equivalent") for s in r["survivors"])
        run, killed = r["mutants_run"], r["killed"]
        section = (f"## {r['target']}\n\n{r.get('date', date)}: killed {killed}/{run} ({100 * killed / max(1, run):.0f}%), "
                   f"killed / non-equivalent {killed}/{run - equivalent} "
                   f"({100 * killed / max(1, run - equivalent):.0f}%); {run} of {r['mutants_found']} mutants run "
                   f"in {r['seconds']:.0f} s; tests: `{' '.join(r['tests'])}`.\n\n" + (
                       "| id | where | operator | original | mutated | verdict |\n|---|---|---|---|---|---|\n"
                       + "\n".join(rows) + "\n" if rows else "No survivors.\n"))
        pattern = re.compile(rf"^## {re.escape(r['target'])}\n.*?(?=^## |\Z)", re.S | re.M)
        if pattern.search(text):
            text = pattern.sub(lambda _: section + "\n", text, count=1)
        else:
            text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n", encoding="utf-8")


def summarise(target: Target, mutants: list[Mutant], run: dict, discarded: int, total_found: int) -> dict:
    killed = sum(m.status in ("killed", "timeout") for m in mutants)
    equivalent = sum(m.equivalent and m.status == "survived" for m in mutants)
    non_equivalent = len(mutants) - equivalent
    return {
        "target": target.spec, **run, "mutants_found": total_found, "mutants_run": len(mutants),
        "discarded": discarded, "killed": killed, "timeouts": sum(m.status == "timeout" for m in mutants),
        "equivalent": equivalent, "survived": len(mutants) - killed - equivalent,
        "score": f"{killed}/{len(mutants)} ({100 * killed / max(1, len(mutants)):.0f}%)",
        "score_non_equivalent": f"{killed}/{non_equivalent} ({100 * killed / max(1, non_equivalent):.0f}%)",
        "survivors": [{k: v for k, v in dataclasses.asdict(m).items() if k not in ("source", "status", "killed_by")}
                      for m in mutants if m.status == "survived"],
        "killed_equivalents": [m.id for m in mutants if m.equivalent and m.status != "survived"],
    }


def main() -> None:
    intro, _, usage = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(description=intro, epilog=usage,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="append", help="path or path:name,name (repeatable; default: all)")
    parser.add_argument("--max-mutants", type=int, help="a deterministic sample of at most N mutants per target")
    parser.add_argument("--seed", type=int, default=SAMPLE_SEED, help="the sample's seed")
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default: 3x the unmutated run + 30 s)")
    parser.add_argument("--list", action="store_true", help="print the mutants without running them")
    parser.add_argument("--json", type=Path, help="write the scores and the survivors here")
    parser.add_argument("--equivalent", type=Path, default=RESULTS_MD,
                        help="known-equivalent mutant ids (default: bench/mutation_results.md)")
    parser.add_argument("--update-results", action="store_true",
                        help="rewrite the run targets' sections of bench/mutation_results.md")
    parser.add_argument("--only-survivors", action="store_true",
                        help="run only the mutants bench/mutation_results.md lists as not killed yet (after "
                             "writing a test: which of them does it kill?)")
    parser.add_argument("--from-json", type=Path, action="append",
                        help="with no run: rewrite bench/mutation_results.md's sections from saved --json files "
                             "(rescored with its current verdicts)")
    args = parser.parse_args()
    if args.from_json:
        results = [dict(t, date=t.get("date", run["date"])) for f in args.from_json
                   for run in [json.loads(f.read_text())] for t in run["targets"]]
        update_results_md(RESULTS_MD, results, time.strftime("%Y-%m-%d"))
        print(f"updated {RESULTS_MD.relative_to(REPO)} from {len(results)} saved target runs")
        return
    # SIGTERM unwinds like Ctrl-C, so the running tests are killed and the temp copy removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("mutation.py: terminated"))
    if args.list:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a listing piped into `head` ends quietly

    targets = [Target.parse(spec) for spec in (args.target or DEFAULT_TARGETS)]
    for target in targets:
        if not (REPO / target.path).is_file():
            sys.exit(f"mutation.py: no file {target.path}")
    equivalent_ids = known_equivalent(args.equivalent)
    open_ids = None
    if args.only_survivors:
        if args.update_results or not RESULTS_MD.exists():
            sys.exit("mutation.py: --only-survivors needs bench/mutation_results.md and does not rewrite it "
                     "(its score counts the survivors only)")
        open_ids = {i for i, v in _verdicts_in(RESULTS_MD.read_text(encoding="utf-8")).items()
                    if v.startswith(NOT_KILLED)}
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    planned = []
    for target in targets:
        found, discarded = find_mutants(target)
        if target.names and not found:
            sys.exit(f"mutation.py: {target.spec} selects no mutant (a misspelt name?)")
        chosen = sample(found, args.max_mutants, args.seed)
        if open_ids is not None:
            chosen = [m for m in chosen if m.id in open_ids]
        for mutant in chosen:
            mutant.equivalent = mutant.id in equivalent_ids
        planned.append((target, chosen, discarded, len(found)))
        if args.list:
            print(f"# {target.spec}: {len(chosen)} of {len(found)} mutants ({discarded} discarded)")
            for m in chosen:
                mark = "  (equivalent)" if m.equivalent else ""
                print(f"{m.id}  {m.file}:{m.line}  {m.function}  {m.operator}{mark}\n    - {m.original}\n"
                      f"    + {m.mutated}")
    if args.list:
        return

    copy_root = make_copy()
    results = []
    try:
        check_copy_imports_itself(copy_root)
        for target, chosen, discarded, total_found in planned:
            run = run_target(target, chosen, copy_root, args.timeout, log)
            results.append(summarise(target, chosen, run, discarded, total_found))
            r = results[-1]
            print(f"{r['target']}: killed {r['score']}, {r['equivalent']} equivalent, killed / non-equivalent "
                  f"{r['score_non_equivalent']} ({r['timeouts']} by timeout; {r['mutants_found']} mutants found, "
                  f"{r['seconds']:.0f} s)", flush=True)
    finally:
        shutil.rmtree(copy_root, ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "targets": results}, indent=1) + "\n")
        log(f"wrote {args.json}")
    if args.update_results:
        update_results_md(RESULTS_MD, results, time.strftime("%Y-%m-%d"))
        log(f"updated {RESULTS_MD.relative_to(REPO)}")


if __name__ == "__main__":
    main()

"""A user's own project, end to end through the installed `lora-ppo` command: conversational
prompts with extra columns, a reward function in a module of the project folder, relative paths
in the recipe, held-out prompts from the user's data; then eval and merge-and-export of the
finished run from another folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REWARD_MODULE = '''
def polite(prompts, completions, tone, **kwargs):
    """1 per completion for a polite ticket, else the completion's length in characters / 100."""
    return [1.0 if t == "polite" else len(c[0]["content"]) / 100 for c, t in zip(completions, tone)]
'''


def _lora_ppo(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # The console script, as a user runs it: no PYTHONPATH, so nothing but the install is on the path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    command = [str(Path(sys.executable).with_name("lora-ppo")), *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_users_project_trains_and_its_run_is_used_from_elsewhere(tmp_path, tiny_model_dir):
    project = tmp_path / "support-bot"
    (project / "data").mkdir(parents=True)
    (project / "my_rewards.py").write_text(REWARD_MODULE, encoding="utf-8")
    rows = [{"messages": [{"role": "user", "content": f"Ticket {i}: my order is late"}],
             "tone": "polite" if i % 2 else "angry", "ticket_id": i} for i in range(24)]
    (project / "data" / "tickets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    recipe = {
        "model": {"name": str(tiny_model_dir), "quantization": "4bit"},
        "adapters": {"policy": {"r": 4, "alpha": 8}, "value": {"r": 4, "alpha": 8}},
        "reward": {"kind": "function", "function": "my_rewards:polite"},
        "data": {"source": "data/tickets.jsonl", "prompt_column": "messages", "eval_size": 4,
                 "max_prompt_tokens": 64},
        "rollout": {"batch_size": 4, "max_new_tokens": 6, "forward_batch_size": 2},
        "ppo": {"num_epochs": 1, "num_minibatches": 2},
        "train": {"steps": 1, "output_dir": "runs/support"},
    }
    (project / "recipe.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")

    trained = _lora_ppo(["train", "recipe.yaml", "--no-progress"], project)
    assert trained.returncode == 0, trained.stderr[-3000:]
    run = project / "runs" / "support"
    written = yaml.safe_load((run / "recipe.yaml").read_text(encoding="utf-8"))
    assert written["data"]["source"] == str(project / "data" / "tickets.jsonl")
    assert written["reward"]["function"] == f"{project / 'my_rewards.py'}:polite"
    # Held out from the user's own tickets, never the quickstart's movie openers.
    held_out = [json.loads(line)["prompt"] for line in (run / "eval_before.jsonl").read_text().splitlines()]
    assert len(held_out) == 4 and all("my order is late" in json.dumps(p) for p in held_out)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    scored = _lora_ppo(["eval", str(run), "--json"], elsewhere)
    assert scored.returncode == 0, scored.stderr[-3000:]
    exported = _lora_ppo(["merge-and-export", str(run), "--out", str(elsewhere / "model")], elsewhere)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (elsewhere / "model" / "config.json").is_file()

    # Started from another folder, the reward module is found beside the recipe.
    again = _lora_ppo(["train", str(project / "recipe.yaml"), "--no-progress", "train.eval=false",
                       f"train.output_dir={elsewhere / 'run2'}", f"data.source={project / 'data' / 'tickets.jsonl'}"],
                      elsewhere)
    assert again.returncode == 0, again.stderr[-3000:]
    written = yaml.safe_load((elsewhere / "run2" / "recipe.yaml").read_text(encoding="utf-8"))
    assert written["reward"]["function"] == f"{project / 'my_rewards.py'}:polite"

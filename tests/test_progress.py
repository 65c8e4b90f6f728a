"""Progress without a terminal: a line per tenth of the work, and the evaluations use it when
there is no bar (a run under --no-progress, CI or nohup used to print nothing for minutes)."""

from __future__ import annotations

import logging

from lora_ppo.progress import LineProgress


def test_a_line_at_every_tenth_and_at_the_end(caplog):
    with caplog.at_level(logging.INFO, logger="lora_ppo.progress"):
        with LineProgress(32, "held-out", "prompts") as bar:
            for _ in range(4):
                bar.update(8)
    done = [r.getMessage().split(" (")[0] for r in caplog.records]
    assert done == ["held-out: 0/32 prompts", "held-out: 8/32 prompts", "held-out: 16/32 prompts",
                    "held-out: 24/32 prompts", "held-out: 32/32 prompts"]


def test_small_updates_print_at_most_ten_lines(caplog):
    with caplog.at_level(logging.INFO, logger="lora_ppo.progress"):
        bar = LineProgress(1000, "held-out")
        for _ in range(1000):
            bar.update(1)
    done = [r.getMessage().split(" (")[0] for r in caplog.records]
    assert done == [f"held-out: {n}/1000" for n in range(0, 1001, 100)]  # the start, then each tenth


def test_a_run_without_a_bar_logs_its_held_out_evaluations(tmp_path, tiny_model_dir, caplog):
    import lora_ppo
    from tests.conftest import tiny_recipe_dict

    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run"), ["train.steps=1"])
    with caplog.at_level(logging.INFO, logger="lora_ppo.progress"):
        lora_ppo.PPOTrainer(recipe, progress=False).train()
    finished = [r.getMessage() for r in caplog.records if r.getMessage().startswith("held-out: 4/4 prompts")]
    assert len(finished) == 2  # before and after training


def test_update_without_a_count_counts_one_as_a_tqdm_bar_does(caplog):
    with caplog.at_level(logging.INFO, logger="lora_ppo.progress"):
        bar = LineProgress(2, "eval")
        bar.update()
        bar.update()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["eval: 0/2", "eval: 1/2", "eval: 2/2"]

"""A checkpoint's files, saved and loaded directly: every process of a data-parallel run gets its
own random streams back; the free-space check refuses before a byte is written, weighing the
checkpoint as large as the one beside it; a write that fails on a nearly full disk is a disk-full
error, any other failure is itself."""

from __future__ import annotations

import dataclasses
import errno
import json
import platform
import random
from collections import namedtuple
from typing import Optional

import numpy as np
import pytest
import torch

from lora_ppo import checkpoint
from lora_ppo.atomic import STAGING_MARK
from lora_ppo.distributed import World
from lora_ppo.errors import RecipeError
from lora_ppo.optimizers import adamw
from lora_ppo.roles import POLICY, VALUE
from lora_ppo.state import TrainState

DiskUsage = namedtuple("DiskUsage", "total used free")
PLENTY = 10**12  # bytes


@pytest.fixture(scope="module")
def roles(make_roles):
    return make_roles(seed=3)


def trainables(roles, generator: Optional[torch.Generator] = None,
               optimizer_state: str = "device") -> checkpoint.Trainables:
    optimizer = adamw([{"params": roles.policy_parameters() + roles.value_parameters(), "lr": 1e-3}],
                      optimizer_state, 1e-8)
    return checkpoint.Trainables(roles, (POLICY, VALUE), optimizer, None, generator or torch.Generator())


def free_space(monkeypatch, folder_free: int, staging_free: int = PLENTY) -> None:
    """What the disk says is free: `staging_free` in a checkpoint's staging folder, `folder_free` elsewhere."""
    def usage(path):
        return DiskUsage(PLENTY, 0, staging_free if STAGING_MARK in str(path) else folder_free)

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", usage)


def raising(error: Exception):
    def write(*args, **kwargs):
        raise error

    return write


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@pytest.fixture
def own_random_streams():
    """The process's random streams as they were before the test, after it."""
    saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
    yield
    torch.set_rng_state(saved[0])
    random.setstate(saved[1])
    np.random.set_state(saved[2])


def test_each_process_of_a_run_resumes_its_own_random_streams(roles, tmp_path, own_random_streams):
    streams = []
    for rank in range(3):  # process r drew from seed 100 + r; its minibatch generator from 200 + r
        seed_everything(100 + rank)
        streams.append(checkpoint.process_rng_state(torch.Generator().manual_seed(200 + rank)))
    folder = checkpoint.save(tmp_path / "step-1", trainables(roles), TrainState(step=1), "recipe\n",
                             process_rngs=streams)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["processes"] == 3
    assert manifest["versions"]["python"] == platform.python_version()  # what a bug report needs
    assert manifest["versions"]["torch"] == torch.__version__
    for rank in (2, 0, 1):
        seed_everything(0)
        generator = torch.Generator()
        checkpoint.load(folder, trainables(roles, generator), TrainState, World(rank=rank, size=3))
        drawn = (torch.rand(4), torch.rand(4, generator=generator), random.random(), np.random.rand())
        torch.manual_seed(100 + rank)
        expected = (torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(200 + rank)),
                    random.Random(100 + rank).random(), np.random.RandomState(100 + rank).rand())
        assert torch.equal(drawn[0], expected[0]) and torch.equal(drawn[1], expected[1]), rank
        assert drawn[2:] == expected[2:], rank
    with pytest.raises(RecipeError, match=r"was written by 3 process\(es\) and resumes exactly only with as many "
                                          r"\(--num-processes 3\); this run has 2$"):
        checkpoint.load(folder, trainables(roles), TrainState, World(rank=0, size=2))


@pytest.mark.parametrize("optimizer_state", ["device", "cpu"])
def test_the_learning_rate_schedule_resumes_where_it_was(roles, tmp_path, optimizer_state):
    """A linear decay over 10 updates: 3 run, 2 skipped (a NaN batch: the schedule moves, the
    optimizer does not), then saved. The resumed run's next update runs at 1e-3 * (1 - 5/10), and
    the one after at 1e-3 * (1 - 6/10), as in a run never stopped; a fresh schedule would say 1e-3."""
    def with_schedule():
        parts = trainables(roles, optimizer_state=optimizer_state)
        schedule = torch.optim.lr_scheduler.LambdaLR(parts.optimizer, lambda i: max(0.0, 1.0 - i / 10))
        return dataclasses.replace(parts, scheduler=schedule)

    saved = with_schedule()
    for update in range(5):
        if update < 3:
            saved.optimizer.step()
        saved.scheduler.step()
    folder = checkpoint.save(tmp_path / "step-1", saved, TrainState(step=1), "recipe\n")
    resumed = with_schedule()
    checkpoint.load(folder, resumed, TrainState)
    assert [group["lr"] for group in resumed.optimizer.param_groups] == pytest.approx([1e-3 * 0.5])
    resumed.optimizer.step()
    resumed.scheduler.step()
    assert [group["lr"] for group in resumed.optimizer.param_groups] == pytest.approx([1e-3 * 0.4])


@pytest.mark.parametrize("needed, free, said", [
    (1_000_000, 999_999, "it needs about 1.0 MB free in {} and 1000 kB are free"),
    (2_500_000, 1_500_000, "it needs about 2.5 MB free in {} and 1.5 MB are free"),
])
def test_a_checkpoint_that_cannot_fit_is_refused_before_a_byte_is_written(roles, tmp_path, monkeypatch,
                                                                          needed, free, said):
    monkeypatch.setattr(checkpoint, "expected_bytes", lambda folder, parts: needed)
    free_space(monkeypatch, free, staging_free=free)
    with pytest.raises(checkpoint.DiskFullError, match="; " + said.format(tmp_path) + "; earlier checkpoints"):
        checkpoint.save(tmp_path / "step-1", trainables(roles), TrainState(step=1), "recipe\n")
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_that_just_fits_is_written(roles, tmp_path, monkeypatch):
    parts = trainables(roles)
    free_space(monkeypatch, checkpoint.expected_bytes(tmp_path / "step-1", parts))
    assert checkpoint.is_checkpoint(checkpoint.save(tmp_path / "step-1", parts, TrainState(step=1), "recipe\n"))


def test_the_next_checkpoint_is_weighed_as_large_as_the_one_beside_it(roles, tmp_path, monkeypatch):
    """Files hold more than the tensors (headers, RNG streams, state): the tensors alone would
    pass the check and fill the disk mid-write."""
    parts = trainables(roles)
    first = checkpoint.save(tmp_path / "step-1", parts, TrainState(step=1), "recipe\n")
    size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
    assert checkpoint.saved_bytes(parts) < size - 1
    free_space(monkeypatch, size - 1)
    with pytest.raises(checkpoint.DiskFullError, match=f"it needs about {size / 1e3:.0f} kB free"):
        checkpoint.save(tmp_path / "step-2", parts, TrainState(step=2), "recipe\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


@pytest.mark.parametrize("failure, staging_free, raised", [
    (RuntimeError("unexpected pos 64 vs 0"), 1_048_575, checkpoint.DiskFullError),  # under 1 MiB left: full
    (RuntimeError("unexpected pos 64 vs 0"), 1_048_576, RuntimeError),  # room left: the failure itself
    (OSError(errno.ENOSPC, "No space left on device"), PLENTY, checkpoint.DiskFullError),
    (OSError(errno.EACCES, "Permission denied"), PLENTY, checkpoint.CheckpointError),
])
def test_a_write_that_fails_is_a_disk_full_error_only_for_want_of_space(roles, tmp_path, monkeypatch, failure,
                                                                        staging_free, raised):
    """torch.save on a full device says "unexpected pos" (no errno): the space left tells."""
    free_space(monkeypatch, PLENTY, staging_free)

    monkeypatch.setattr(checkpoint.torch, "save", raising(failure))
    with pytest.raises(raised) as caught:
        checkpoint.save(tmp_path / "step-1", trainables(roles), TrainState(step=1), "recipe\n")
    assert type(caught.value) is raised
    assert list(tmp_path.iterdir()) == []  # nothing staged is left behind


def test_the_space_a_full_disk_error_reports_is_what_is_free_once_the_staged_files_are_gone(roles, tmp_path,
                                                                                            monkeypatch):
    def usage(path):  # the staging folder's files take all but 10 bytes, until it is removed
        staged = [p for p in tmp_path.iterdir() if STAGING_MARK in p.name]
        return DiskUsage(PLENTY, 0, 10 if staged else 5_000_000)

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", usage)
    monkeypatch.setattr(checkpoint.torch, "save", raising(RuntimeError("unexpected pos 64 vs 0")))
    with pytest.raises(checkpoint.DiskFullError, match=" and 5.0 MB are free;"):
        checkpoint.save(tmp_path / "step-1", trainables(roles), TrainState(step=1), "recipe\n")


def sft_run_with_a_checkpoint(roles, folder, tiny_model_dir, **train):
    """An SFT recipe (`train` settings over the helpers') and a run folder in `folder` that holds
    its recipe.yaml and one checkpoint; returns (recipe, the checkpoint)."""
    from lora_ppo.config import SFTRecipe, recipe_from_dict, recipe_to_yaml
    from tests.sft_helpers import demonstration_rows, sft_recipe_dict, write_jsonl

    data = write_jsonl(folder / "demos.jsonl", demonstration_rows(8))
    recipe = recipe_from_dict(sft_recipe_dict(tiny_model_dir, data, data, folder / "run", **train), schema=SFTRecipe)
    (folder / "run").mkdir()
    (folder / "run" / "recipe.yaml").write_text(recipe_to_yaml(recipe), encoding="utf-8")
    step = checkpoint.save(folder / "run" / "checkpoints" / "step-1", trainables(roles), TrainState(step=1),
                           recipe_to_yaml(recipe))
    return recipe, step


def test_a_stage_opens_its_run_folder_as_a_ppo_run_does(roles, tmp_path, tiny_model_dir):
    """train-sft and train-reward open their folders with open_run's defaults: a folder holding
    another run's checkpoint is refused to a new run, and a one-process checkpoint resumes."""
    recipe, step = sft_run_with_a_checkpoint(roles, tmp_path, tiny_model_dir)
    with pytest.raises(RecipeError, match="^train.output_dir: .* already holds a run"):
        checkpoint.open_run(recipe, None)
    run, resume_from = checkpoint.open_run(recipe, "auto")
    assert run.root == tmp_path / "run" and resume_from == step


@pytest.mark.parametrize("schedule, epochs, warned", [("linear", 3, True), ("linear", 2, False), ("constant", 3, False)])
def test_a_resume_that_moves_the_end_of_a_linear_decay_says_so(roles, tmp_path, tiny_model_dir, caplog, schedule,
                                                               epochs, warned):
    """Two epochs planned, resumed with `epochs`: only a linear schedule changes, and only when the
    end moves."""
    import logging

    from lora_ppo.run_dir import RunDir

    recipe, step = sft_run_with_a_checkpoint(roles, tmp_path, tiny_model_dir, epochs=2, lr_schedule=schedule)
    resumed = recipe.model_copy(update={"train": recipe.train.model_copy(update={"epochs": epochs})})
    with caplog.at_level(logging.WARNING, logger="lora_ppo.checkpoint"):
        assert checkpoint.resolve_resume(RunDir(tmp_path / "run"), "auto", resumed) == step
    said = [r.getMessage() for r in caplog.records]
    assert said == (["train.epochs changed from 2 to 3: the linear learning-rate decay is re-planned to the new end, "
                     "so this is not the run the new recipe makes from the start (with a constant schedule it is)"]
                    if warned else [])

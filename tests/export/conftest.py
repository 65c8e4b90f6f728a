"""A tiny trained run to export (one PPO step on the tiny 4-bit Llama, learning rate high enough
that the policy adapter clearly changes the model), and its default export."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_recipe_dict


@contextlib.contextmanager
def one_cpu_thread():
    """Models this small run fastest on one thread; on a busy 2-core machine OpenMP's
    spin-waiting threads made these tests 3-4x slower (measured 88 s vs 25 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="package", autouse=True)
def _one_cpu_thread_for_export_tests():
    with one_cpu_thread():
        yield


@pytest.fixture(scope="session")
def trained_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished run folder: recipe.yaml, summary.json, final/{policy,value}/."""
    from safetensors.torch import load_file

    from lora_ppo import PPOTrainer, recipe_from_dict

    run = tmp_path_factory.mktemp("export-run") / "run"
    recipe = recipe_from_dict(tiny_recipe_dict(
        tiny_model_dir, run, train={"steps": 1, "sample_every": 0, "eval": False}, ppo={"learning_rate": 5e-2},
    ))
    with one_cpu_thread():  # session-scoped: set up before the package-wide fixture
        PPOTrainer(recipe, progress=False).train()
    # PEFT starts lora_B at zero, so a nonzero B is the step's doing: the adapter changes the model
    # and a merge that drops it is detectable.
    weights = load_file(str(run / "final" / "policy" / "adapter_model.safetensors"))
    assert max(float(t.abs().max()) for k, t in weights.items() if "lora_B" in k) > 1e-2
    return run


@pytest.fixture(scope="session")
def exported(trained_run, tmp_path_factory):
    """(folder, report) of the default export: policy merged into the original base, fp32."""
    from lora_ppo.export import merge_and_export

    out = tmp_path_factory.mktemp("exports") / "merged"
    with one_cpu_thread():
        return out, merge_and_export(trained_run, out)


@pytest.fixture()
def run_copy(trained_run, tmp_path) -> Path:
    """A private copy of the trained run, free to damage."""
    return Path(shutil.copytree(trained_run, tmp_path / "run-copy"))


def _zero_scaled_merge(peft_model):
    # A deliberately wrong merge: every LoRA layer's scale set to 0, so the adapter vanishes.
    for module in peft_model.modules():
        if isinstance(getattr(module, "scaling", None), dict):
            for name in module.scaling:
                module.scaling[name] = 0.0
    return peft_model.merge_and_unload()


@pytest.fixture()
def wrong_merge(monkeypatch):
    """Make merge_and_export merge the adapter with scale 0."""
    from lora_ppo import export

    monkeypatch.setattr(export, "_merge", _zero_scaled_merge)


def safetensors_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))

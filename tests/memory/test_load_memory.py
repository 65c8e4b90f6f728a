"""Loading on CPU must not keep the checkpoint file mapped: that mapping counted the whole
unquantized checkpoint in resident memory after a 4-bit load (0.3 GB on SmolLM2-135M)."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch

from lora_ppo.config import ModelConfig
from lora_ppo.model import load_base_model


@pytest.mark.skipif(not sys.platform.startswith("linux") or torch.cuda.is_available(), reason="reads /proc/self/maps on CPU")
@pytest.mark.parametrize("quantization", ["4bit", "none"])
def test_no_mapping_of_the_checkpoint_file_survives_loading(tiny_model_dir, tmp_path, quantization):
    folder = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, folder)
    model = load_base_model(ModelConfig(name=str(folder), quantization=quantization))
    mapped = [line for line in open("/proc/self/maps") if str(folder) in line]
    assert mapped == []
    # Tied embeddings are still one tensor, and the model still runs.
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 5, 9]])).logits).all()

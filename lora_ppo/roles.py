"""The PPO roles on one backbone: policy and value LoRA adapters, the value score head, and
the reference (adapters disabled, or a named frozen adapter). `as_role` switches between them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Literal, Optional

import torch
from torch import nn

from lora_ppo.config import AdaptersConfig, LoraSettings
from lora_ppo.errors import RecipeError
from lora_ppo.logprobs import token_logprobs
from lora_ppo.bnb_workarounds import keep_4bit_weights_differentiable

Role = Literal["policy", "value", "reference", "reward"]
POLICY: Role = "policy"
VALUE: Role = "value"
REFERENCE: Role = "reference"
TRAINABLE_ADAPTERS = (POLICY, VALUE)
VALUE_HEAD_FILE = "value_head.safetensors"


def lora_config(settings: LoraSettings):
    from peft import LoraConfig

    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        # No dropout: PPO ratios must be exactly 1 before the first update (dropout off everywhere).
        lora_dropout=0.0,
        target_modules=settings.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _check_adapter_dir(path: str, field: str) -> None:
    if not (Path(path) / "adapter_config.json").is_file():
        raise RecipeError(f"{field}: {path!r} is not a PEFT adapter folder (no adapter_config.json)")


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so a left-padded prompt sees the same
    positions as the same prompt unpadded. [B, T]"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class RoleModel:
    """One base model carrying every PPO role.

    Args:
        base_model: the loaded (possibly 4-bit) causal LM, all weights frozen.
        adapters: the recipe's adapters section.
        with_value: create the value adapter and score head (critic-free modes do not).
    """

    def __init__(self, base_model, adapters: AdaptersConfig, with_value: bool = True):
        from peft import PeftModel, get_peft_model

        if adapters.policy.init_from:
            _check_adapter_dir(adapters.policy.init_from, "adapters.policy.init_from")
            self.peft = PeftModel.from_pretrained(
                base_model, adapters.policy.init_from, adapter_name=POLICY, is_trainable=True
            )
        else:
            self.peft = get_peft_model(base_model, lora_config(adapters.policy), adapter_name=POLICY)
        self.has_value = with_value
        if with_value and adapters.value.init_from:
            _check_adapter_dir(adapters.value.init_from, "adapters.value.init_from")
            self.peft.load_adapter(adapters.value.init_from, adapter_name=VALUE, is_trainable=True)
        elif with_value:
            self.peft.add_adapter(VALUE, lora_config(adapters.value))
        # The reference is either the bare base (adapters disabled) or a frozen adapter of its own,
        # e.g. the SFT adapter the policy started from: then the policy trains a copy of it.
        self.reference_adapter: Optional[str] = adapters.reference_adapter_path
        if self.reference_adapter:
            _check_adapter_dir(self.reference_adapter, "adapters.reference")
            self.peft.load_adapter(self.reference_adapter, adapter_name=REFERENCE, is_trainable=False)

        # Eval mode for good: dropout anywhere would make the PPO ratio differ from 1 before
        # any update, and the rollout logprobs would not be those of the policy being trained.
        self.peft.eval()
        keep_4bit_weights_differentiable(self.peft)  # eval() reset it; see its docstring
        base = self.peft.get_base_model()
        self.decoder = base.get_decoder()
        self.lm_head = base.get_output_embeddings()
        hidden_size = base.config.get_text_config().hidden_size
        head_dtype = self.lm_head.weight.dtype if self.lm_head.weight.is_floating_point() else torch.float32
        if head_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            head_dtype = torch.float32
        self.value_head: Optional[nn.Linear] = None
        if with_value:
            self._make_value_head(hidden_size, head_dtype, adapters.value.init_from)

        self._params = {name: self._adapter_params(name) for name in (POLICY, VALUE, REFERENCE)}
        self._active: Optional[str] = None
        self._activate(POLICY)

    def _make_value_head(self, hidden_size: int, head_dtype: torch.dtype, init_from: Optional[str]) -> None:
        self.value_head = nn.Linear(hidden_size, 1, device=self.lm_head.weight.device, dtype=head_dtype)
        # Zero init: every value starts at 0 instead of a random offset of the size of the
        # hidden states, which wrecked the first steps' explained variance.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        if init_from and (Path(init_from) / VALUE_HEAD_FILE).is_file():
            self.load_value_head(Path(init_from) / VALUE_HEAD_FILE)

    # ---- parameters -------------------------------------------------------------------------

    def _adapter_params(self, adapter_name: str) -> list[nn.Parameter]:
        marker = f".{adapter_name}."
        return [p for n, p in self.peft.named_parameters() if marker in n and "lora_" in n]

    def policy_parameters(self) -> list[nn.Parameter]:
        return list(self._params[POLICY])

    def value_parameters(self) -> list[nn.Parameter]:
        if self.value_head is None:
            return []
        return list(self._params[VALUE]) + list(self.value_head.parameters())

    def _fix_requires_grad(self) -> None:
        # PEFT's set_adapter leaves only the active adapter trainable; both trainable roles
        # must keep requires_grad through every switch, and the reference must never get it.
        for name in TRAINABLE_ADAPTERS:
            for p in self._params[name]:
                p.requires_grad_(True)
        for p in self._params[REFERENCE]:
            p.requires_grad_(False)

    def _activate(self, adapter_name: str) -> None:
        if self._active != adapter_name:
            self.peft.set_adapter(adapter_name)
            self._active = adapter_name
            self._fix_requires_grad()

    # ---- roles ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def as_role(self, role: Role) -> Iterator[None]:
        """Run the enclosed forwards as `role` (policy, value or reference)."""
        if role == REFERENCE and self.reference_adapter is None:
            with self.peft.disable_adapter():
                yield
            self._fix_requires_grad()
            return
        if role not in (POLICY, VALUE, REFERENCE):
            raise ValueError(f"role {role!r} does not live on the policy backbone")
        if role == VALUE and not self.has_value:
            raise ValueError("this RoleModel was built without a value adapter (critic-free mode)")
        self._activate(role)
        yield

    @contextlib.contextmanager
    def gradient_checkpointing(self, enabled: bool) -> Iterator[None]:
        """Checkpoint decoder layers inside the block (for updates); generation keeps its KV cache."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        base = self.peft.get_base_model()
        if not enabled or not base.supports_gradient_checkpointing:
            yield
            return
        # transformers checkpoints a layer only while that layer is in training mode, and the
        # model stays in eval mode here (no dropout: ratios must be exactly 1 before the first
        # update). So the layers' own flag is set, not their children's: without this the
        # setting silently did nothing (update peaks were identical with and without it).
        layers = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
        was_training = [m.training for m in layers]
        if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2 name
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in layers:
            layer.training = True
        try:
            yield
        finally:
            for layer, flag in zip(layers, was_training):
                layer.training = flag
            if hasattr(base, "activation_checkpointing_disable"):
                base.activation_checkpointing_disable()
            else:
                base.gradient_checkpointing_disable()

    # ---- forwards ---------------------------------------------------------------------------

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states of the decoder (final norm applied), [B, T, H]; no LM head."""
        out = self.decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_for(attention_mask),
            use_cache=False,
        )
        return out.last_hidden_state

    def response_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_start: int,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs of the response tokens and their entropies under the active role.

        Args:
            input_ids, attention_mask: [B, T] left-padded prompt followed by the response.
            response_start: index of the first response token (the padded prompt length).
        Returns:
            (logprobs, entropy), each [B, T_resp] float32.
        """
        hidden = self.hidden_states(input_ids, attention_mask)
        predicting = hidden[:, response_start - 1 : -1]  # [B, T_resp, H]
        return token_logprobs(self.lm_head, predicting, input_ids[:, response_start:], temperature)

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_start: int) -> torch.Tensor:
        """Value of the state before each response token, [B, T_resp] float32 (value role)."""
        hidden = self.hidden_states(input_ids, attention_mask)
        # The same positions that predict each response token: V_t sees prompt + response[:t].
        predicting = hidden[:, response_start - 1 : -1]  # [B, T_resp, H]
        return self.value_head(predicting.to(self.value_head.weight.dtype)).squeeze(-1).float()

    # ---- saving -----------------------------------------------------------------------------

    def save_adapter(self, adapter_name: str, folder: Path) -> None:
        """Write one adapter as a PEFT folder loadable by `PeftModel.from_pretrained(base, folder)`;
        the value adapter gets its score head beside it."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        # PEFT writes a non-"default" adapter into a subfolder named after it; write to a
        # scratch parent and lift the files up so the folder itself is the adapter.
        scratch = folder / ".peft-save"
        self.peft.save_pretrained(str(scratch), selected_adapters=[adapter_name])
        for item in (scratch / adapter_name).iterdir():
            item.replace(folder / item.name)
        for leftover in sorted(scratch.rglob("*"), reverse=True):
            leftover.unlink() if leftover.is_file() else leftover.rmdir()
        scratch.rmdir()
        if adapter_name == VALUE:
            state = {k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()}
            save_file(state, str(folder / VALUE_HEAD_FILE))

    def load_value_head(self, path: Path) -> None:
        from safetensors.torch import load_file

        state = load_file(str(path))
        self.value_head.load_state_dict({k: v.to(self.value_head.weight.dtype) for k, v in state.items()})

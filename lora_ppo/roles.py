"""The roles on one backbone: policy and value LoRA adapters with the value's score head, the
reference (adapters disabled, or a named frozen adapter), and a frozen reward adapter with its
score head. `as_role` switches between them. `SingleAdapterModel` is the same backbone with one
trainable adapter (`train-sft`), and `RewardModel` one with a head too (`train-reward`).
"""

from __future__ import annotations

import contextlib
import json
import re
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Optional, Sequence, Union

import torch
from torch import nn

from lora_ppo.adapter_switch import AdapterSwitch
from lora_ppo.config import AdaptersConfig, LoraSettings, RewardAdapterSettings
from lora_ppo.errors import RecipeError, first_line, some_of
from lora_ppo.logprobs import token_logprobs
from lora_ppo.bnb_workarounds import eval_on_training_kernel
from lora_ppo.compiled_update import CompiledLayers, layer_step
from lora_ppo.fused_lora import adapters_cast_once, fused_layers, route_lora_layers
from lora_ppo.library_notices import without_peft_rename_notice
from lora_ppo.peft_workarounds import targets_kept_as_named
from lora_ppo.model_checks import (check_logit_path, check_packing, fused_expert_parameters, logit_path_error,
                                   logit_transform_of, probe_ids)
from lora_ppo.quantization import AdapterNumerics
from lora_ppo.run_dir import FINAL_DIR, RECIPE_FILE, is_checkpoint

log = logging.getLogger(__name__)

Role = Literal["policy", "value", "reference", "reward"]
POLICY: Role = "policy"
VALUE: Role = "value"
REFERENCE: Role = "reference"
REWARD: Role = "reward"
TRAINABLE_ADAPTERS = (POLICY, VALUE)
VALUE_HEAD_FILE = "value_head.safetensors"
REWARD_HEAD_FILE = "reward_head.safetensors"
# The scalar head saved beside each adapter that has one (nn.Linear(hidden, 1) on the last
# hidden state): the value's, and a reward adapter's.
HEAD_FILES = {VALUE: VALUE_HEAD_FILE, REWARD: REWARD_HEAD_FILE}
# PEFT's adapter name for "no adapter" in a batch that mixes adapters per row.
BASE = "__base__"
# Adapter settings.init_from may name this instead of a folder: start from the recipe's reward adapter.
FROM_REWARD = "reward"


def lora_config(settings: LoraSettings, base_model: nn.Module, field: str, dropout: float = 0.0):
    """PEFT's LoraConfig for `settings` (the recipe's section `field`) on `base_model`, its target
    modules as `module_targets` reads them."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        # No dropout in PPO: its ratios must be exactly 1 before the first update. Only reward
        # training passes some, and it is active only inside `RewardModel.training_mode()`.
        lora_dropout=dropout,
        target_modules=module_targets(base_model, settings.target_modules, field),
        target_parameters=list(settings.target_parameters) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def module_targets(base_model: nn.Module, target_modules: Union[str, list[str]], section: str) -> Union[str, list[str]]:
    """What PEFT is given for `target_modules` (the recipe's `section`, e.g. `adapters.policy`) on
    `base_model`. As written, except on a model with fused MoE experts, where it becomes the full names
    of the Linear layers meant (for `all-linear`, every one but the LM head): PEFT's `all-linear` would
    also adapt the 3-D expert weights and the router (one adapter per expert, no mixed-adapter batches),
    and PEFT 0.22 reads a leaf name such as `down_proj` on Qwen2-MoE and the model types it converts
    alike (Qwen3-MoE, DeepSeek, GLM-4.5 MoE) as the transformers-4 name of the fused experts too.
    Experts get LoRA only through `target_parameters`. RecipeError naming the field for a name no
    module has (PEFT's matching: the whole name or its dotted end)."""
    head = base_model.get_output_embeddings()
    linears = [name for name, module in base_model.named_modules()
               if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"]  # GPT-2's layers
    if target_modules != "all-linear":
        missing = missing_targets(base_model, target_modules)
        if missing:
            layers = sorted({n.rsplit(".", 1)[-1] for n in linears if base_model.get_submodule(n) is not head})
            experts = sorted(re.sub(r"^.*?\.\d+\.", "", n) for n in fused_expert_parameters(base_model)
                             if any(_names(n, t) for t in missing))
            hint = f"; expert weights go in {section}.target_parameters ({experts[0]})" if experts else ""
            raise RecipeError(f"{section}.target_modules: {', '.join(map(repr, missing))} names no module of this "
                              f"model; its linear layers: {', '.join(layers)}{hint}")
    if not fused_expert_parameters(base_model):
        return target_modules
    if target_modules == "all-linear":
        return sorted(name for name in linears if base_model.get_submodule(name) is not head)
    return sorted(name for name in linears if any(_names(name, t) for t in target_modules)) or target_modules


def _names(name: str, target: str) -> bool:
    """Whether the module `name` is what the target names (PEFT's matching: the whole name or its dotted end)."""
    return name == target or name.endswith(f".{target}")


def missing_targets(base_model: nn.Module, targets: Sequence[str]) -> list[str]:
    """The targets no module of `base_model` answers to."""
    modules = [name for name, _ in base_model.named_modules()]
    return [t for t in targets if not any(_names(m, t) for m in modules)]


@contextlib.contextmanager
def adapter_of_this_model(base_model: nn.Module, folder: str, field: str) -> Iterator[None]:
    """Load the adapter in `folder` (the recipe's `field`) inside this block, or refuse it in one
    line as one trained on another model: PEFT fails with a traceback on layers this model does not
    have (a GPT-2 adapter on a Llama) or on weights of other shapes (another size of the family)."""
    config = json.loads((Path(folder) / "adapter_config.json").read_text(encoding="utf-8"))
    trained_on = f"was trained on {config.get('base_model_name_or_path') or 'another model'}"
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a string is a regular expression: PEFT says what it matched
        missing = sorted(missing_targets(base_model, targets))
        if missing:
            raise RecipeError(f"{field}: {folder} {trained_on}: this model has no layer {some_of(missing)}")
    try:
        yield
    except RuntimeError as err:
        mismatch = re.search(r"size mismatch for (\S+): copying a param with shape (torch\.Size\(\[[\d, ]*\]\)) "
                             r"from checkpoint, the shape in current model is (torch\.Size\(\[[\d, ]*\]\))", str(err))
        if mismatch is None:
            raise
        name, theirs, ours = mismatch.groups()
        raise RecipeError(f"{field}: {folder} {trained_on}: its weights have other shapes than this model's "
                          f"({name.removeprefix('base_model.model.')}: {theirs[11:-1]} there, {ours[11:-1]} here)") from None


def check_adapter_dir(path: str, field: str, head: Optional[str] = None) -> None:
    if not (Path(path) / "adapter_config.json").is_file():
        raise RecipeError(f"{field}: {path!r} is not a PEFT adapter folder (no adapter_config.json)")
    if head is not None and not (Path(path) / head).is_file():
        raise RecipeError(f"{field}: {path!r} has no score head ({head})")


def adapter_folder(path: str, field: str, names: Sequence[str] = (POLICY,), head: Optional[str] = None) -> str:
    """The PEFT adapter folder `path` names: the folder itself, or for a run folder (its final/
    checkpoint) or a checkpoint folder, the first of the adapters `names` it holds (`train-sft` and
    `train` save the policy there, `train-reward` the reward adapter). Raises RecipeError naming
    `field` when there is none."""
    folder = Path(path).expanduser()
    if not (folder / "adapter_config.json").is_file():
        checkpoint = next((f for f in (folder, folder / FINAL_DIR) if is_checkpoint(f)), None)
        if checkpoint is not None:
            found = next((checkpoint / n for n in names if (checkpoint / n / "adapter_config.json").is_file()), None)
            if found is None:
                raise RecipeError(f"{field}: checkpoint {str(checkpoint)!r} holds no {' or '.join(names)} adapter")
            folder = found
        elif (folder / RECIPE_FILE).is_file():
            raise RecipeError(f"{field}: run {path!r} has no complete {FINAL_DIR}/ checkpoint yet (it has not "
                              "finished); name one of its checkpoints/step-N")
    check_adapter_dir(str(folder), field, head)
    return str(folder)


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so a left-padded prompt sees the same
    positions as the same prompt unpadded. [B, T]"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_real_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """The index of each row's last real token, whatever the padding (left, right or both). [B]"""
    T = attention_mask.shape[1]
    return T - 1 - attention_mask.long().flip(-1).argmax(dim=-1)


class Backbone:
    """A frozen base model with LoRA adapters and scalar score heads: the decoder's hidden states
    (no LM head), a head's score at the last real token, gradient checkpointing, and saving."""

    def __init__(self, peft_model, base_name: Optional[str] = None, numerics: AdapterNumerics = AdapterNumerics()):
        self.peft = peft_model
        # model.adapter_autocast: the dtype the adapters' matmuls run in (None: their own float32).
        self.autocast_dtype = numerics.autocast_dtype
        # PEFT's arithmetic less two passes, or model.fused_lora's: after every adapter is added, so
        # each LoRA layer exists.
        route_lora_layers(self.peft, fused=numerics.fused)
        # What saved adapters name as their base (adapter_config.json), so they load elsewhere:
        # the recipe's name (a builtin model's hub id), never a local cache folder.
        self.base_name = base_name
        # Eval mode for good: dropout anywhere would make the PPO ratio differ from 1 before
        # any update, and the rollout logprobs would not be those of the policy being trained.
        eval_on_training_kernel(self.peft)
        base = self.peft.get_base_model()
        self.decoder = base.get_decoder()
        self.lm_head = base.get_output_embeddings()
        # Applied after the LM head wherever lora_ppo computes token logits itself (RoleModel
        # checks it against the model's own forward).
        self.logit_transform = logit_transform_of(base.config)
        self.hidden_size = base.config.get_text_config().hidden_size
        head_dtype = self.lm_head.weight.dtype if self.lm_head.weight.is_floating_point() else torch.float32
        self.head_dtype = head_dtype if head_dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
        self.heads: dict[str, nn.Linear] = {}

    def make_head(self, adapter_name: str, init_from: Optional[Path] = None, trainable: bool = True) -> nn.Linear:
        """A scalar head for `adapter_name`, zero-initialised or loaded from a head file."""
        head = nn.Linear(self.hidden_size, 1, device=self.lm_head.weight.device, dtype=self.head_dtype)
        # Zero init: every score starts at 0 instead of a random offset of the size of the
        # hidden states, which wrecked the first steps' explained variance.
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        self.heads[adapter_name] = head
        if init_from is not None:
            self.load_head(adapter_name, init_from)
        head.requires_grad_(trainable)
        return head

    def token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own next-token logits from hidden states [..., H]: LM head, then the model's
        final transform (soft-cap, scale), in float32. [..., V]"""
        # As rows of one 2-D matmul: a strided slice (a chunk of response positions) would make the LM head a
        # batched matmul, its weight broadcast to every row, twice one matmul's time on CPU
        # (bench/update_pieces.py); so would a chunk of [1, N, H] whose batch stride is N, not the chunk's.
        rows = hidden.reshape(-1, hidden.shape[-1])
        return self.logit_transform(self.lm_head(rows).float()).view(*hidden.shape[:-1], -1)

    def adapter_compute(self) -> contextlib.AbstractContextManager:
        """Where the decoder runs (generation, scoring, the update's forward and its recomputation):
        with `model.adapter_autocast`, autocast to bfloat16, so PEFT skips its float32 casts around
        each adapter (on a GPU) and the adapters' matmuls read bfloat16 copies of their float32 weights. The
        heads and the LM head's logprobs run outside it, in their own dtypes."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.lm_head.weight.device.type, dtype=self.autocast_dtype)

    def adapters_cast_once(self, adapter_names: Sequence[str]) -> contextlib.AbstractContextManager:
        """With `model.fused_lora`: inside, the fused layers read these adapters from copies in the compute
        dtype made by one batched cast, not a cast per layer and call (`fused_lora.adapters_cast_once`). A
        forward and the backward that recomputes its checkpointed layers run inside. Elsewhere nothing."""
        layers = fused_layers(self.peft)
        if not layers:
            return contextlib.nullcontext()
        # The residual stream's dtype, which the base layers answer in (the fused layers check each copy).
        dtype = self.peft.get_base_model().get_input_embeddings().weight.dtype
        return adapters_cast_once(layers, adapter_names, dtype)

    def adapter_params(self, adapter_name: str) -> list[nn.Parameter]:
        marker = f".{adapter_name}."
        return [p for n, p in self.peft.named_parameters() if marker in n and "lora_" in n]

    @contextlib.contextmanager
    def training_mode(self) -> Iterator[None]:
        """LoRA dropout on (when the adapter has any) for a training step; scoring stays dropout-free."""
        self.peft.train()
        try:
            yield
        finally:
            eval_on_training_kernel(self.peft)

    @contextlib.contextmanager
    def gradient_checkpointing(self, enabled: bool, compiled: Optional[CompiledLayers] = None) -> Iterator[None]:
        """Checkpoint decoder layers inside the block (for updates); generation keeps its KV cache.
        With `compiled` (`ppo.compile_update`), layers that compute gradients run its compiled step."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        base = self.peft.get_base_model()
        enabled = enabled and base.supports_gradient_checkpointing
        if not enabled and compiled is None:
            yield
            return
        # transformers checkpoints a layer only in training mode, and training mode turns on the
        # dropout some layers apply themselves (OPT's `dropout(x, training=self.training)`): the
        # ratio would not start at 1. So each layer stays in eval mode and is checkpointed here.
        layers = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
        for layer in layers:
            def checkpointed(*args, layer=layer, **kwargs):
                if not torch.is_grad_enabled():
                    return type(layer).forward(layer, *args, **kwargs)
                return (compiled or layer_step)(layer, enabled, *args, **kwargs)

            layer.forward = checkpointed  # an instance attribute shadows the class's forward
        try:
            yield
        finally:
            for layer in layers:
                del layer.forward

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Last hidden states of the decoder (final norm applied), [B, T, H]; no LM head.
        `attention_mask` None: no padding. The model then counts positions itself: given positions and
        no mask, transformers reads them back from the device to look for packed sequences.
        `position_ids` (packed rows, no mask): each row's positions from 0, which part the rows
        (`check_packing` makes sure this model's attention does)."""
        positions = position_ids if attention_mask is None else position_ids_for(attention_mask)
        with self.adapter_compute():
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                               use_cache=False)
        return out.last_hidden_state

    def check_packing(self, field: str) -> None:
        """Refuse packed rows (`field`: the recipe switch) where this model's attention does not keep
        them apart (`model_checks.check_packing`). Raises RecipeError."""
        vocab = self.lm_head.out_features  # not weight.shape[0]: a 4-bit head's weight is packed
        model_type = self.peft.get_base_model().config.model_type
        check_packing(self.decoder, vocab, self.lm_head.weight.device, model_type, field)

    def sequence_scores(self, head_name: str, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The head's score of each whole sequence, read at its last real token, [B] float32
        (under the active adapter)."""
        hidden = self.hidden_states(input_ids, attention_mask)  # [B, T, H]
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_real_index(attention_mask)]  # [B, H]
        head = self.heads[head_name]
        return head(last.to(head.weight.dtype)).squeeze(-1).float()

    def save_adapter(self, adapter_name: str, folder: Path) -> None:
        """Write one adapter as a PEFT folder loadable by `PeftModel.from_pretrained(base, folder)`,
        with its score head beside it when it has one."""
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
        if self.base_name is not None:
            config_path = folder / "adapter_config.json"
            config = json.loads(config_path.read_text(encoding="utf-8"))
            config["base_model_name_or_path"] = self.base_name
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
        if adapter_name in self.heads:
            state = {k: v.detach().contiguous().cpu() for k, v in self.heads[adapter_name].state_dict().items()}
            save_file(state, str(folder / HEAD_FILES[adapter_name]))

    def load_head(self, adapter_name: str, path: Path) -> None:
        from safetensors.torch import load_file

        head = self.heads[adapter_name]
        state = load_file(str(path))
        head.load_state_dict({k: v.to(head.weight.dtype) for k, v in state.items()})


@dataclass(frozen=True)
class AdapterStarts:
    """What each role of a `RoleModel` starts from: an adapter folder, or None for a fresh adapter
    (the reference: the base model, adapters disabled)."""

    policy: Optional[str]
    value: Optional[str]
    value_head: Optional[Path]  # the value head's weights, beside the value adapter's folder
    reference: Optional[str]
    reward: Optional[str]  # a reward adapter's folder (reward.kind: adapter)


class RoleModel(Backbone):
    """One base model carrying every PPO role.

    Args:
        base_model: the loaded (possibly 4-bit) causal LM, all weights frozen.
        adapters: the recipe's adapters section.
        with_value: create the value adapter and score head (critic-free modes do not).
        reward_adapter: a reward adapter folder (PEFT adapter + reward_head.safetensors, as
            `lora-ppo train-reward` writes it) to score with, frozen, on the same backbone.
    """

    @without_peft_rename_notice
    def __init__(self, base_model, adapters: AdaptersConfig, with_value: bool = True,
                 reward_adapter: Optional[str] = None, base_name: Optional[str] = None,
                 numerics: AdapterNumerics = AdapterNumerics(), trim_padding: bool = True, packing: bool = False):
        from peft import PeftModel, get_peft_model

        starts = self.adapter_starts(adapters, reward_adapter, with_value)
        # Both read off the bare model: once PEFT wraps a layer, its LoRA matrices are Linear layers too.
        policy_config, value_config = lora_config(adapters.policy, base_model, "adapters.policy"), \
            lora_config(adapters.value, base_model, "adapters.value")
        with targets_kept_as_named():  # each adapter after the first keeps its layers on an MoE model
            if starts.policy:
                with adapter_of_this_model(base_model, starts.policy, "adapters.policy.init_from"):
                    peft = PeftModel.from_pretrained(base_model, starts.policy, adapter_name=POLICY, is_trainable=True)
            else:
                peft = get_peft_model(base_model, policy_config, adapter_name=POLICY)
            self.has_value = with_value
            if with_value and starts.value:
                with adapter_of_this_model(base_model, starts.value, "adapters.value.init_from"):
                    peft.load_adapter(starts.value, adapter_name=VALUE, is_trainable=True)
            elif with_value:
                peft.add_adapter(VALUE, value_config)
            # The reference is either the bare base (adapters disabled) or a frozen adapter of its own,
            # e.g. the SFT adapter the policy started from: then the policy trains a copy of it.
            self.reference_adapter: Optional[str] = starts.reference
            if self.reference_adapter:
                with adapter_of_this_model(base_model, self.reference_adapter, "adapters.reference"):
                    peft.load_adapter(self.reference_adapter, adapter_name=REFERENCE, is_trainable=False)
            self.reward_adapter = starts.reward
            if self.reward_adapter:
                with adapter_of_this_model(base_model, self.reward_adapter, "reward.adapter"):
                    peft.load_adapter(self.reward_adapter, adapter_name=REWARD, is_trainable=False)
        super().__init__(peft, base_name, numerics)
        # ppo.trim_padding: the scoring and update micro-batches cut to the columns their rows use.
        self.trim_padding = trim_padding
        # ppo.packing: their rows packed back to back into sequences instead (lora_ppo/packing.py).
        self.packing = packing
        if packing:
            self.check_packing("ppo.packing")
        self.value_head: Optional[nn.Linear] = self.make_head(VALUE, starts.value_head) if with_value else None
        if self.reward_adapter:
            self.make_head(REWARD, Path(self.reward_adapter) / REWARD_HEAD_FILE, trainable=False)

        self._params = {name: self.adapter_params(name) for name in (POLICY, VALUE, REFERENCE, REWARD)}
        self._switch = AdapterSwitch.of(peft)  # None: PEFT's own switches (lora_ppo/adapter_switch.py)
        self._active: Optional[str] = None
        self._activate(POLICY)
        self._check_logit_path()
        # Whether PEFT's per-row adapter batches work on this model, without and with autograd.
        self.mixed_batches = {grad: self._probe_mixed_batches(grad) for grad in (False, True)}

    def _check_logit_path(self) -> None:
        """Refuse a model whose own forward gives other logits than `token_logits` (a transform
        lora_ppo does not know): checked once, on a probe, as the policy."""
        ids = probe_ids(self.lm_head.out_features, self.lm_head.weight.device)
        mask = torch.ones_like(ids)
        error = logit_path_error(lambda x: self.peft(input_ids=x, attention_mask=mask).logits,
                                 lambda x: self.token_logits(self.hidden_states(x, mask)), ids)
        check_logit_path(error, self.logit_transform, self.head_dtype, self.peft.get_base_model().config.model_type)

    def _probe_mixed_batches(self, grad: bool) -> bool:
        """Whether one forward (and, with `grad`, a backward) can run each block of rows under its
        own role here. PEFT refuses it for layers that flatten the batch (OPT), for LoRA on 3-D
        expert parameters, and, with autograd, on 4-bit layers with a bias."""
        roles = [POLICY, REFERENCE] + ([VALUE] if self.has_value else [])
        ids = probe_ids(self.lm_head.out_features, self.lm_head.weight.device)[:, :4]
        try:
            with torch.set_grad_enabled(grad):
                hidden = self.hidden_states_as_roles(ids, torch.ones_like(ids), roles)
                if grad:
                    sum(h.float().sum() for h in hidden).backward()
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
            log.info("mixed-adapter batches %s do not work on this model (%s): each role gets its own pass",
                     "with autograd" if grad else "without autograd", first_line(err).split(". ")[0])
            return False
        finally:
            for p in self.peft.parameters():
                p.grad = None
        return True

    @classmethod
    def adapter_starts(cls, adapters: AdaptersConfig, reward_adapter: Optional[str],
                       with_value: bool = True) -> AdapterStarts:
        """The adapter folders the roles load, from the recipe's paths (RecipeError naming the field
        when one holds no adapter). Only the file system is read: `parts.build` asks before the base
        model's weights load, which takes minutes for a large model."""
        reward = adapter_folder(reward_adapter, "reward.adapter", (REWARD,), REWARD_HEAD_FILE) if reward_adapter else None
        policy = adapters.policy.init_from
        policy = adapter_folder(policy, "adapters.policy.init_from") if policy else None
        value, value_head = cls._value_start(adapters.value.init_from, reward) if with_value else (None, None)
        reference = adapters.reference_adapter_path
        reference = adapter_folder(reference, "adapters.reference") if reference else None
        return AdapterStarts(policy, value, value_head, reference, reward)

    @staticmethod
    def _value_start(init_from: Optional[str], reward_adapter: Optional[str]) -> tuple[Optional[str], Optional[Path]]:
        """(adapter folder, head file) the value role starts from, or (None, None) for a fresh one.
        `init_from: reward` is a trainable copy of the reward adapter and its head, a known way to
        lower the early value loss."""
        if init_from == FROM_REWARD:
            if not reward_adapter:
                raise RecipeError("adapters.value.init_from: 'reward' needs a reward adapter (reward.kind: adapter)")
            return reward_adapter, Path(reward_adapter) / REWARD_HEAD_FILE
        if init_from:
            init_from = adapter_folder(init_from, "adapters.value.init_from", (VALUE,))
            head = Path(init_from) / VALUE_HEAD_FILE
            return init_from, head if head.is_file() else None
        return None, None

    # ---- parameters -------------------------------------------------------------------------

    def policy_parameters(self) -> list[nn.Parameter]:
        return list(self._params[POLICY])

    def value_parameters(self) -> list[nn.Parameter]:
        if self.value_head is None:
            return []
        return list(self._params[VALUE]) + list(self.value_head.parameters())

    def _fix_requires_grad(self) -> None:
        # PEFT's set_adapter leaves only the active adapter trainable; both trainable roles
        # must keep requires_grad through every switch, and the frozen ones must never get it.
        for name in TRAINABLE_ADAPTERS:
            for p in self._params[name]:
                p.requires_grad_(True)
        for name in (REFERENCE, REWARD):
            for p in self._params[name]:
                p.requires_grad_(False)

    def _activate(self, adapter_name: str) -> None:
        if self._active != adapter_name:
            if self._switch is None:
                self.peft.set_adapter(adapter_name)
            else:
                self._switch.activate(adapter_name)
            self._active = adapter_name
            self._fix_requires_grad()

    # ---- roles ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def as_role(self, role: Role) -> Iterator[None]:
        """Run the enclosed forwards as `role` (policy, value, reference or reward)."""
        name = self.adapter_name(role)
        if name == BASE:
            with self.peft.disable_adapter() if self._switch is None else self._switch.adapters_disabled():
                yield
            self._fix_requires_grad()
            return
        self._activate(name)
        yield

    def adapter_name(self, role: Role) -> str:
        """The PEFT adapter `role` computes with; BASE (PEFT's name for none) for a reference by
        disabled adapters."""
        if role not in (POLICY, VALUE, REFERENCE, REWARD):
            raise ValueError(f"role {role!r} does not live on the policy backbone")
        if role == VALUE and not self.has_value:
            raise ValueError("this RoleModel was built without a value adapter (critic-free mode)")
        if role == REWARD and self.reward_adapter is None:
            raise ValueError("this RoleModel was built without a reward adapter")
        return BASE if role == REFERENCE and self.reference_adapter is None else role

    # ---- forwards ---------------------------------------------------------------------------

    def hidden_states_as_roles(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], roles: Sequence[Role],
        position_ids: Optional[torch.Tensor] = None,
    ) -> list[torch.Tensor]:
        """Hidden states of the same batch under several roles, from one forward pass: the batch
        repeated once per role, each copy computed with its role's adapter (PEFT's per-row adapter
        selection), so every base weight is read (and, in 4-bit, dequantized) once for all roles
        instead of once per role. Rows never mix, so each copy equals that role's own forward.
        Returns one [B, T, H] per role, in order."""
        with self.rows_as_roles(roles, input_ids.shape[0]):
            return self.stacked_hidden_states(input_ids, attention_mask, len(roles), position_ids)

    @contextlib.contextmanager
    def rows_as_roles(self, roles: Sequence[Role], batch: int) -> Iterator[None]:
        """Inside: forwards of `len(roles) * batch` rows compute each block of `batch` rows under
        its role's adapter. A backward that recomputes checkpointed layers must run inside too
        (outside, the recomputation would run every row under the active adapter)."""
        names = [self.adapter_name(role) for role in roles for _ in range(batch)]
        if self._switch is not None:
            with self._switch.rows_as_adapters(names):
                yield
            return
        # PeftModel.forward and generate wrap their call in this context to honour `adapter_names`;
        # the decoder is called directly here (no LM head over every position), so it is entered as they do.
        hooks = self.peft._enable_peft_forward_hooks(adapter_names=names)
        hooks.__enter__()
        try:
            yield
        except BaseException:
            # PEFT removes its hooks only after a clean exit: left in place, they would apply these
            # adapter names to every later forward, whatever its batch size.
            _remove_adapter_name_hooks(self.peft)
            raise
        hooks.__exit__(None, None, None)

    def stacked_hidden_states(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                              copies: int, position_ids: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Hidden states of the batch repeated `copies` times in one forward, split back into one
        [B, T, H] per copy (inside `rows_as_roles`, one per role)."""
        mask = None if attention_mask is None else attention_mask.repeat(copies, 1)
        positions = None if position_ids is None else position_ids.repeat(copies, 1)
        hidden = self.hidden_states(input_ids.repeat(copies, 1), mask, positions)
        return list(hidden.split(input_ids.shape[0]))

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
        return self.logprobs_from_hidden(self.hidden_states(input_ids, attention_mask), input_ids, response_start,
                                         temperature)

    def logprobs_from_hidden(self, hidden: torch.Tensor, input_ids: torch.Tensor, response_start: int,
                             temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`response_logprobs` from a role's hidden states [B, T, H] of `input_ids`."""
        return self.predicted_logprobs(hidden[:, response_start - 1 : -1], input_ids[:, response_start:], temperature)

    def predicted_logprobs(self, predicting: torch.Tensor, targets: torch.Tensor,
                           temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs, entropy) of `targets` [B, N] from the hidden states that predict them, [B, N, H]."""
        return token_logprobs(self.token_logits, predicting, targets, temperature)

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_start: int) -> torch.Tensor:
        """Value of the state before each response token, [B, T_resp] float32 (value role)."""
        return self.values_from_hidden(self.hidden_states(input_ids, attention_mask), response_start)

    def values_from_hidden(self, hidden: torch.Tensor, response_start: int) -> torch.Tensor:
        """`values` from the value role's hidden states [B, T, H]."""
        # The same positions that predict each response token: V_t sees prompt + response[:t].
        return self.values_at(hidden[:, response_start - 1 : -1])

    def values_at(self, predicting: torch.Tensor) -> torch.Tensor:
        """The value head's values [B, N] float32 of hidden states [B, N, H]."""
        return self.value_head(predicting.to(self.value_head.weight.dtype)).squeeze(-1).float()

    @torch.no_grad()
    def reward_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The reward adapter's score of each prompt + response, at its last real token. [B]"""
        with self.as_role(REWARD):
            return self.sequence_scores(REWARD, input_ids, attention_mask)


def _remove_adapter_name_hooks(model: nn.Module) -> None:
    """Remove the forward pre-hooks PEFT's `_enable_peft_forward_hooks` registers for per-row
    adapter names."""
    for module in model.modules():
        for key, hook in list(module._forward_pre_hooks.items()):
            if getattr(getattr(hook, "func", None), "__name__", "") == "_adapter_names_pre_forward_hook":
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)


class SingleAdapterModel(Backbone):
    """The backbone with one trainable adapter, for the stages that train one (`train-reward`,
    `train-sft`): fresh, or started from `settings.init_from` (an adapter folder, or a run or
    checkpoint folder holding one of the adapters `start_from`)."""

    # The adapters of a run or checkpoint folder that `adapter.init_from` may name, the first found taken.
    start_from: tuple[str, ...] = (POLICY,)

    @classmethod
    def start_folder(cls, settings: LoraSettings) -> Optional[str]:
        """The adapter folder `settings.init_from` names (None: a fresh adapter); RecipeError when it
        holds none. Only the file system is read: the stages ask before the base model's weights load."""
        return adapter_folder(settings.init_from, "adapter.init_from", cls.start_from) if settings.init_from else None

    @without_peft_rename_notice
    def __init__(self, base_model, settings: LoraSettings, adapter_name: str, base_name: Optional[str] = None,
                 dropout: float = 0.0, numerics: AdapterNumerics = AdapterNumerics()):
        from peft import PeftModel, get_peft_model

        self.start = self.start_folder(settings)
        if self.start:
            with adapter_of_this_model(base_model, self.start, "adapter.init_from"):
                peft = PeftModel.from_pretrained(base_model, self.start, adapter_name=adapter_name, is_trainable=True)
        else:
            peft = get_peft_model(base_model, lora_config(settings, base_model, "adapter", dropout),
                                  adapter_name=adapter_name)
        super().__init__(peft, base_name, numerics)
        self.adapter_name = adapter_name
        self.peft.set_adapter(adapter_name)
        for p in self.adapter_params(adapter_name):
            p.requires_grad_(True)

    def parameters(self) -> list[nn.Parameter]:
        """The trained adapter's parameters (and its head's, when it has one)."""
        head = self.heads.get(self.adapter_name)
        return self.adapter_params(self.adapter_name) + (list(head.parameters()) if head is not None else [])


class RewardModel(SingleAdapterModel):
    """The backbone with one trainable reward adapter and its scalar head, for pairwise reward
    training (`lora-ppo train-reward`). Its saved folder is what `reward.kind: adapter` loads."""

    start_from = (REWARD, POLICY)  # a reward adapter, or the policy (an SFT run's)

    def __init__(self, base_model, settings: RewardAdapterSettings, base_name: Optional[str] = None,
                 numerics: AdapterNumerics = AdapterNumerics()):
        super().__init__(base_model, settings, REWARD, base_name, settings.dropout, numerics)
        head_file = Path(self.start) / REWARD_HEAD_FILE if self.start else None
        self.make_head(REWARD, head_file if head_file is not None and head_file.is_file() else None)

    def scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The score of each sequence at its last real token. [B]"""
        return self.sequence_scores(REWARD, input_ids, attention_mask)

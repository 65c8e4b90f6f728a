"""The parameter layout of a causal LM, counted from its config alone (no weights loaded).

Each architecture's Layout (LAYOUTS, keyed by model_type) says, as data, whether q/k/v and the MLP
are fused, how many norms a layer has, which biases exist and where MoE experts live; ModelShape
turns a config into the linear layers bitsandbytes quantizes and the parts it leaves at the compute
dtype. An architecture not in the table is refused rather than guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Union

from lora_ppo.config import BUILTIN_PREFIX
from lora_ppo.errors import RecipeError, first_line


@dataclass(frozen=True)
class Linear:
    """A linear weight of the model: its module path within a decoder layer (or the decoder), which
    LoRA's target_modules and target_parameters match by suffix; its sizes; how many the model
    holds; whether it has a bias."""

    name: str
    fan_in: int
    fan_out: int
    count: int
    bias: bool = False

    @property
    def params(self) -> int:
        return self.count * self.fan_in * self.fan_out

    def matches(self, target: str) -> bool:
        return self.name == target or self.name.endswith("." + target)  # PEFT matches name suffixes


@dataclass(frozen=True)
class Layout:
    """How an architecture lays out its parameters, as data; the sizes come from its config."""

    attention: tuple[str, ...]  # (q, k, v, out), or (qkv, out) where q, k and v are one fused layer
    mlp: tuple[str, ...]  # gated: (gate, up, down), or (gate_up, down) fused; not gated: (in, out)
    gated: bool = True
    norm_params: int = 1  # per element of a norm: RMSNorm has a weight, LayerNorm a weight and a bias
    norms: Union[int, Callable[[Any], int]] = 2  # hidden-wide norms per decoder layer
    outer_norms: int = 1  # hidden-wide norms outside the layers: the final one (Bloom: and the embeddings')
    qk_norm: str = ""  # "head": one head_dim-wide norm each for q and k; "width": q- and kv-wide ones
    # Biases: fixed, or the name of the config flag that turns them on.
    qkv_bias: Union[bool, str] = "attention_bias"
    out_bias: Union[bool, str] = "attention_bias"
    mlp_bias: Union[bool, str] = "mlp_bias"
    mlp_width: str = "intermediate_size"  # the config key of the dense MLP's width ("", absent or None: 4 x hidden)
    kv_heads: Optional[Callable[[Any], int]] = None  # default: num_key_value_heads, else one per query head
    position_offset: Optional[int] = None  # learned positions: max_position_embeddings + this many rows
    experts: str = ""  # MoE: the config key of the routed expert count
    expert_width: str = "moe_intermediate_size"
    # bitsandbytes converts only exact nn.Linear and Conv1D modules, not subclasses such as FalconLinear.
    converted: bool = True


def _falcon_kv_heads(c) -> int:
    return c.num_kv_heads if c.new_decoder_architecture else 1 if c.multi_query else c.num_attention_heads


def _falcon_norms(c) -> int:
    """Two LayerNorms per layer (before attention and before the MLP) unless attention and MLP run
    in parallel from one; the new architecture has two by default."""
    parallel_norms = c.num_ln_in_parallel_attn or (2 if c.new_decoder_architecture else 1)
    return 2 if not c.parallel_attn else parallel_norms


LLAMA = Layout(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
               ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
_FUSED_SELF_ATTENTION = ("self_attention.query_key_value", "self_attention.dense")
_H_TO_4H = ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
_LAYER_NORM_MLP = {"gated": False, "norm_params": 2}
LAYOUTS: dict[str, Layout] = {
    "llama": LLAMA, "mistral": LLAMA, "granite": LLAMA, "smollm3": LLAMA,
    "qwen2": replace(LLAMA, qkv_bias=True, out_bias=False),
    "qwen3": replace(LLAMA, qk_norm="head"),
    "gemma2": replace(LLAMA, norms=4),
    "gemma3_text": replace(LLAMA, norms=4, qk_norm="head"),
    "phi3": replace(LLAMA, attention=("self_attn.qkv_proj", "self_attn.o_proj"),
                    mlp=("mlp.gate_up_proj", "mlp.down_proj")),
    "olmo2": replace(LLAMA, qk_norm="width"),
    "cohere": replace(LLAMA, norms=1, qk_norm="width"),
    "qwen2_moe": replace(LLAMA, qkv_bias="qkv_bias", out_bias=False, experts="num_experts"),
    "qwen3_moe": replace(LLAMA, qk_norm="head", experts="num_experts"),
    "mixtral": replace(LLAMA, experts="num_local_experts", expert_width="intermediate_size"),
    "gpt2": Layout(("attn.c_attn", "attn.c_proj"), ("mlp.c_fc", "mlp.c_proj"), **_LAYER_NORM_MLP, qkv_bias=True,
                   out_bias=True, mlp_bias=True, mlp_width="n_inner", position_offset=0),
    "gpt_neox": Layout(("attention.query_key_value", "attention.dense"), _H_TO_4H, **_LAYER_NORM_MLP, mlp_bias=True),
    "opt": Layout(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"), ("fc1", "fc2"),
                  **_LAYER_NORM_MLP, qkv_bias="enable_bias", out_bias="enable_bias", mlp_bias="enable_bias",
                  mlp_width="ffn_dim", position_offset=2),
    "falcon": Layout(_FUSED_SELF_ATTENTION, _H_TO_4H, **_LAYER_NORM_MLP, norms=_falcon_norms, qkv_bias="bias",
                     out_bias="bias", mlp_bias="bias", mlp_width="ffn_hidden_size", kv_heads=_falcon_kv_heads,
                     converted=False),
    "bloom": Layout(_FUSED_SELF_ATTENTION, _H_TO_4H, **_LAYER_NORM_MLP, outer_norms=2, qkv_bias=True, out_bias=True,
                    mlp_bias=True, mlp_width=""),
}


# Config keys of routed experts in MoE configs outside LAYOUTS: such a model is never guessed at.
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _llama_shaped(text) -> bool:
    """A dense RMSNorm decoder with a gated MLP width (Gemma 1, InternLM, ...): counted with
    Llama's layout, and the answer says it is approximate."""
    return (getattr(text, "intermediate_size", None) is not None and getattr(text, "rms_norm_eps", None) is not None
            and not any(getattr(text, key, None) for key in MOE_CONFIG_KEYS))


def _attention_linears(layout: Layout, hidden: int, q: int, kv: int, count: int, qkv_bias: bool = False,
                       out_bias: bool = False) -> list[Linear]:
    """The attention's linear layers in `count` decoder layers: q, k and v (or one fused qkv), out."""
    *qkv, out = layout.attention
    widths = [q + 2 * kv] if len(qkv) == 1 else [q, kv, kv]
    return [*(Linear(n, hidden, w, count, qkv_bias) for n, w in zip(qkv, widths)),
            Linear(out, q, hidden, count, out_bias)]


def _mlp_linears(layout: Layout, hidden: int, width: int, count: int, bias: bool = False,
                 prefix: str = "") -> list[Linear]:
    """A dense MLP's linear layers in `count` decoder layers; a gated MLP reads `width` twice from
    the hidden state (gate and up, fused or not)."""
    *into, down = layout.mlp
    widths = [width] if not layout.gated else [2 * width] if len(into) == 1 else [width, width]
    return [*(Linear(prefix + n, hidden, w, count, bias) for n, w in zip(into, widths)),
            Linear(prefix + down, width, hidden, count, bias)]


def _moe_sizes(text, layout: Layout) -> tuple[int, int, int, int, int]:
    """(routed experts, experts per token, expert width, shared expert width, MoE layers); zeros
    for a dense model. transformers puts an MoE block in every decoder_sparse_step-th layer
    except the mlp_only_layers (Qwen-MoE), and in every layer where those are absent (Mixtral)."""
    experts = (getattr(text, layout.experts, 0) or 0) if layout.experts else 0
    if not experts:
        return 0, 0, 0, 0, 0
    step = getattr(text, "decoder_sparse_step", 1) or 1
    dense_only = set(getattr(text, "mlp_only_layers", None) or ())
    moe_layers = sum(1 for i in range(text.num_hidden_layers) if (i + 1) % step == 0 and i not in dense_only)
    return (experts, text.num_experts_per_tok, getattr(text, layout.expert_width),
            getattr(text, "shared_expert_intermediate_size", 0) or 0, moe_layers)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a causal LM's config."""

    hidden: int
    intermediate: int  # the MLP width a token passes through: for an MoE its active experts' (and shared expert's)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    model_type: str = "llama"
    # The rest is filled in from the config by the architecture's Layout; left empty, the shape is a
    # Llama's (seven linear layers and two RMSNorms per decoder layer).
    linears: tuple[Linear, ...] = ()
    fused_experts: tuple[Linear, ...] = ()  # 3-D MoE expert weights: count is experts x MoE layers
    other_params: tuple[tuple[str, int], ...] = ()  # by part: norms, positions, routers (empty: Llama's norms)
    embed_width: int = 0  # the token embeddings' width where it is not `hidden` (OPT's word_embed_proj_dim)
    converted: bool = True  # bitsandbytes converts the linear layers to 4/8-bit
    experts: int = 0
    experts_per_token: int = 0
    approximate: bool = False  # a model type outside LAYOUTS, counted as a Llama-shaped decoder

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_type = getattr(text, "model_type", None) or type(text).__name__
        layout = LAYOUTS.get(model_type) or (LLAMA if _llama_shaped(text) else None)
        if layout is None:
            raise RecipeError(
                f"model.name: the estimate cannot count the parameters of model type {model_type!r}; "
                f"it counts {', '.join(sorted(LAYOUTS))}"
            )
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
                   if getattr(text, k, None) is None]
        if missing:
            raise RecipeError(f"model.name: the {model_type} config lacks {', '.join(missing)}")

        def flag(setting: Union[bool, str]) -> bool:
            return setting if isinstance(setting, bool) else bool(getattr(text, setting, False))

        hidden, layers, heads = text.hidden_size, text.num_hidden_layers, text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        kv_heads = layout.kv_heads(text) if layout.kv_heads else getattr(text, "num_key_value_heads", None) or heads
        q, kv = heads * head_dim, kv_heads * head_dim
        dense_width = getattr(text, layout.mlp_width, None) or 4 * hidden
        experts, per_token, expert_width, shared, moe_layers = _moe_sizes(text, layout)

        linears = _attention_linears(layout, hidden, q, kv, layers, flag(layout.qkv_bias), flag(layout.out_bias))
        linears += _mlp_linears(layout, hidden, dense_width, layers - moe_layers, flag(layout.mlp_bias))
        if shared:  # a dense shared expert beside the routed ones, with a one-output gate (Qwen2-MoE)
            linears += _mlp_linears(layout, hidden, shared, moe_layers, prefix="mlp.shared_expert.")
            linears.append(Linear("mlp.shared_expert_gate", hidden, 1, moe_layers))
        embed_width = getattr(text, "word_embed_proj_dim", None) or hidden
        if embed_width != hidden:  # OPT projects narrower embeddings in and out of the decoder
            linears += [Linear("project_in", embed_width, hidden, 1), Linear("project_out", hidden, embed_width, 1)]
        fused = (Linear("mlp.experts.gate_up_proj", hidden, 2 * expert_width, experts * moe_layers),
                 Linear("mlp.experts.down_proj", expert_width, hidden, experts * moe_layers)) if moe_layers else ()

        norms = layout.norms(text) if callable(layout.norms) else layout.norms
        qk_norm = {"head": 2 * head_dim, "width": q + kv}.get(layout.qk_norm, 0)
        if not getattr(text, "use_qk_norm", True):  # Cohere's are optional
            qk_norm = 0
        positions = (text.max_position_embeddings + layout.position_offset) * hidden \
            if layout.position_offset is not None else 0
        other = {
            "norms": layout.norm_params * hidden * (norms * layers + layout.outer_norms) + qk_norm * layers,
            "positions": positions,
            "routers": experts * hidden * moe_layers,
        }
        active = per_token * expert_width + shared
        return cls(
            hidden=hidden,
            intermediate=max(active, dense_width if layers > moe_layers else 0),
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=text.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))),
            model_type=model_type,
            linears=tuple(lin for lin in linears if lin.count),  # an MoE's dense MLP may be in no layer
            fused_experts=fused,
            other_params=tuple((k, v) for k, v in other.items() if v),
            embed_width=embed_width if embed_width != hidden else 0,
            converted=layout.converted,
            experts=experts,
            experts_per_token=per_token,
            approximate=model_type not in LAYOUTS,
        )

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def all_linears(self) -> tuple[Linear, ...]:
        """Every linear layer of the model but the LM head (a Llama's seven per layer by default)."""
        if self.linears:
            return self.linears
        h, q, kv = self.hidden, self.q_width, self.kv_width
        return tuple(_attention_linears(LLAMA, h, q, kv, self.layers)
                     + _mlp_linears(LLAMA, h, self.intermediate, self.layers))

    @property
    def linear_params(self) -> int:
        """Weights of the linear layers bitsandbytes quantizes (Linear4bit / Linear8bitLt)."""
        return sum(lin.params for lin in self.all_linears) if self.converted else 0

    def unquantized_parts(self) -> dict[str, int]:
        """Parameters bitsandbytes leaves at the compute dtype, by part (none are 0)."""
        embed = self.vocab * (self.embed_width or self.hidden)
        parts = {
            "embeddings": embed,
            "lm_head": 0 if self.tied_embeddings else embed,
            **dict(self.other_params or (("norms", (2 * self.layers + 1) * self.hidden),)),
            "biases": sum(lin.count * lin.fan_out for lin in self.all_linears if lin.bias),
            "moe_experts": sum(e.params for e in self.fused_experts),
            "unconverted_linears": 0 if self.converted else sum(lin.params for lin in self.all_linears),
        }
        return {k: v for k, v in parts.items() if v}

    @property
    def unquantized_params(self) -> int:
        """Embeddings, the LM head when untied, norms, biases, and MoE experts and routers."""
        return sum(self.unquantized_parts().values())

    @property
    def total_params(self) -> int:
        return self.linear_params + self.unquantized_params

    def lora_params(self, r: int, target_modules, target_parameters=()) -> int:
        """LoRA's parameters on the linear layers named (PEFT's `all-linear`: every one but the LM
        head) and on the fused expert weights named (one rank-r pair per expert)."""
        return sum(numel * count for numel, count in self.lora_tensors(r, target_modules, target_parameters))

    def lora_tensors(self, r: int, target_modules, target_parameters=()) -> list[tuple[int, int]]:
        """(elements, how many) of each LoRA tensor `lora_params` counts: A (r x in) and B (out x r).
        A target with a layer's index in it (`model.layers.3.self_attn.q_proj`: PEFT 0.22 saves `all-linear`
        so in adapter_config.json, and lora_ppo names an MoE model's layers so) is that one layer's module."""
        if target_modules == "all-linear":
            linears = [(lin, lin.count) for lin in self.all_linears]
        else:
            def layers_named(lin: Linear) -> int:
                named = [t for t in target_modules if lin.matches(t) or t.endswith("." + lin.name)]
                return lin.count if any(not re.search(r"\.\d+\.", t) for t in named) else len(named)

            linears = [(lin, layers_named(lin)) for lin in self.all_linears]
        experts = [(e, e.count) for e in self.fused_experts if any(e.matches(p) for p in target_parameters)]
        return [pair for lin, count in linears + experts if count
                for pair in ((r * lin.fan_in, count), (r * lin.fan_out, count))]


def load_shape(name: str, trust_remote_code: bool = False) -> ModelShape:
    """The config of a hub id, a local folder or a builtin model, without loading weights."""
    from transformers import AutoConfig

    from lora_ppo.builtin_model import BUILTIN_MODELS, cache_dir, find_packaged_gguf
    from lora_ppo.model import resolve_model_path

    try:
        if name.startswith(BUILTIN_PREFIX):
            key = name[len(BUILTIN_PREFIX):]
            if key in BUILTIN_MODELS and not (cache_dir() / key / "config.json").is_file():
                gguf = find_packaged_gguf(BUILTIN_MODELS[key].distribution, BUILTIN_MODELS[key].filename)  # metadata only: no conversion
                return ModelShape.from_config(AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
        config = AutoConfig.from_pretrained(resolve_model_path(name), trust_remote_code=trust_remote_code)
    except RecipeError:
        raise
    except Exception as err:  # noqa: BLE001 - hub/network/parse errors become one line
        raise RecipeError(f"model.name: cannot read the config of {name!r}: {first_line(err)}") from None
    return ModelShape.from_config(config)


def classifier_shape(name: str, trust_remote_code: bool) -> ModelShape:
    """Reward classifiers are often encoders (BERT-like): count their parameters the same way."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001
        raise RecipeError(f"reward.model: cannot read the config of {name!r}: {first_line(err)}") from None
    hidden, layers = config.hidden_size, config.num_hidden_layers
    inter = getattr(config, "intermediate_size", 4 * hidden)
    heads = config.num_attention_heads
    return ModelShape(hidden, inter, layers, heads, heads, hidden // heads, config.vocab_size, True)

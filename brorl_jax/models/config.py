"""ModelConfig: the frozen, hashable description of a decoder-only transformer.

It covers the Hugging Face families used by BroRL-style RLVR runs (Qwen2/Qwen2.5, Qwen3,
Llama 3.x, and the mixture-of-experts Qwen3-MoE and Qwen2-MoE) and converts to and from a HF ``config.json``
dict. Being a frozen dataclass of plain hashable fields, a ``ModelConfig`` can be a static
argument of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pallas_kernels.swiglu_mlp import IMPLS as MLP_IMPLS

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe")
# Families whose MLP is a sparse mixture of experts (models/moe.py).
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
# MoE families with a shared expert beside the routed ones (shared_expert_intermediate_size).
SHARED_EXPERT_MODEL_TYPES = ("qwen2_moe",)
# Families whose attention_bias is on q/k/v only (HF's Qwen2 always, Qwen2-MoE's qkv_bias);
# for the others HF's attention_bias also adds an o_proj bias.
_QKV_BIAS_ONLY = ("qwen2", "qwen2_moe")
# The experts' grouped GEMM (models/moe.py): "ragged" (jax.lax.ragged_dot over the tokens
# sorted by expert), "dense" (the reference: every expert on every token, masked by the gates).
MOE_IMPLS = ("grouped", "ragged", "dense")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION_IMPLS = ("reference", "xla", "cudnn", "flash")
SUPPORTED_DTYPES = ("float32", "bfloat16")
# The rollout copy's weights and KV cache (models/precision.py)
ROLLOUT_PRECISIONS = ("bf16", "fp8")

# HF's RotaryEmbeddingConfigMixin.default_theta: used when a config.json names no theta.
_DEFAULT_ROPE_THETA = 10_000.0
# Per-family defaults for fields that old or minimal config.json files may omit.
_DEFAULTS = {
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False},
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                  "tie_word_embeddings": False},
    "qwen2_moe": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                  "tie_word_embeddings": False},
}
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen2 / Qwen3 / Llama-style decoder-only transformer.

    Attributes follow HF ``config.json`` names. ``rope_scaling`` is the hashable form of HF's rope
    scaling dict without ``rope_type == "default"`` (then ``None``), as a sorted tuple of
    ``(key, value)`` pairs, e.g. ``(("factor", 8.0), ..., ("rope_type", "llama3"))``.
    ``attention_bias`` means bias on q/k/v projections; for qwen2 and qwen2_moe (HF's ``qkv_bias``)
    that is the only bias (o_proj has none), for qwen3/llama HF's ``attention_bias=True`` also
    adds an o_proj bias (``o_proj_bias``).
    ``param_dtype`` is the storage dtype of the params, ``dtype`` the compute dtype; logits are
    always float32.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: tuple | None
    rms_norm_eps: float
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    param_dtype: str = "float32"
    dtype: str = "float32"
    # Full-sequence attention in forward(): "reference" (plain masked softmax, materialises the
    # [B, H, T, T] scores), "xla" or "cudnn" (jax.nn.dot_product_attention; cuDNN flash attention
    # on GPU, no T x T buffer for unpacked rows), "flash" (pallas_kernels.packed_attention:
    # causal flash attention over segments, the kernel on GPU/TPU, its jnp reference on CPU).
    # Not part of the checkpoint: set it with dataclasses.replace.
    attention_impl: str = "reference"
    # The SwiGLU MLP in forward(): "auto" (pallas_kernels.swiglu_mlp: Triton kernels with the
    # elementwise work inside the GEMMs on GPU; the plain XLA expression on CPU and TPU),
    # "pallas" (the kernels; interpreted on CPU), "reference" (always the XLA expression); under
    # fp8 rollout weights likewise pallas_kernels.fp8_gemm's kernels or qwix's GEMMs. Not saved.
    mlp_impl: str = "auto"
    # The rollout copy's precision (models/precision.py; keys rollout.weight_dtype and
    # rollout.kv_dtype): "bf16" = the compute dtype, "fp8" = e4m3 values with scales. Set only on
    # the rollout engine's config (models.precision.with_precision); the update's stays "bf16".
    # Not part of the checkpoint, like attention_impl.
    weight_precision: str = "bf16"
    kv_precision: str = "bf16"
    # Mixture of experts (model_type "qwen3_moe"; all 0 for the dense families): every layer's
    # MLP is num_experts SwiGLU experts of width moe_intermediate_size, num_experts_per_tok of
    # them per token, their gates renormalised to sum to 1 when norm_topk_prob (HF's names).
    # router_aux_loss_coef is the checkpoint's load-balancing weight, kept for the round trip.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    # Qwen2-MoE's shared expert (SHARED_EXPERT_MODEL_TYPES; HF's name): a SwiGLU MLP of this
    # width on every token, scaled by sigmoid(shared_expert_gate(h)) and added to the routed
    # experts' output; 0 = none (Qwen3-MoE, the dense families).
    shared_expert_intermediate_size: int = 0
    # The experts' grouped GEMM, one of MOE_IMPLS (models/moe.py: "grouped" = the Pallas kernels
    # on an sm_90 GPU / TPU, jax.lax.ragged_dot elsewhere); not part of the checkpoint.
    moe_impl: str = "grouped"
    # Expert parallelism's capacity (parallel/expert_parallel.py; the run config's
    # mesh.expert_capacity_factor): 0 = exact, else rows past factor x tokens x K / P dropped.
    expert_capacity_factor: float = 0.0
    # LoRA adapters (models/lora.py; the run config's model.lora_*): rank 0 = off; alpha / rank
    # scales A @ B; the targeted projections' short names (lora.TARGETS). Not part of the
    # checkpoint, like attention_impl.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()

    @property
    def is_moe(self) -> bool:
        """True when every layer's MLP is a sparse mixture of experts."""
        return self.model_type in MOE_MODEL_TYPES

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj has a bias (attention_bias, except for the q/k/v-only families)."""
        return self.attention_bias and self.model_type not in _QKV_BIAS_ONLY

    @property
    def mlp_width(self) -> int:
        """A token's MLP width (what the memory plans count per token): intermediate_size, or
        the widths of the num_experts_per_tok experts it goes to and of the shared expert."""
        if self.is_moe:
            return (self.num_experts_per_tok * self.moe_intermediate_size
                    + self.shared_expert_intermediate_size)
        return self.intermediate_size

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"ModelConfig.model_type={self.model_type!r} is not supported; "
                f"supported model_type values: {SUPPORTED_MODEL_TYPES}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attention_impl={self.attention_impl!r}; use one of "
                             f"{ATTENTION_IMPLS}")
        if self.mlp_impl not in MLP_IMPLS:
            raise ValueError(f"ModelConfig.mlp_impl={self.mlp_impl!r}; use one of {MLP_IMPLS}")
        for name in ("weight_precision", "kv_precision"):
            if getattr(self, name) not in ROLLOUT_PRECISIONS:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; use one of "
                                 f"{ROLLOUT_PRECISIONS}")
        self._check_moe()
        if self.lora_rank < 0 or (self.lora_rank > 0 and not (self.lora_alpha > 0
                                                              and self.lora_targets)):
            raise ValueError(f"ModelConfig.lora_rank={self.lora_rank} needs rank >= 0, and with "
                             f"rank > 0 lora_alpha > 0 (got {self.lora_alpha}) and lora_targets "
                             f"(got {self.lora_targets})")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r}; use one of {SUPPORTED_DTYPES}"
                )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"ModelConfig.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            rope_type = dict(self.rope_scaling).get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"ModelConfig.rope_scaling rope_type={rope_type!r} is not supported; "
                    f"supported: {SUPPORTED_ROPE_TYPES}"
                )

    def _check_moe(self) -> None:
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"ModelConfig.moe_impl={self.moe_impl!r}; use one of {MOE_IMPLS}")
        if not self.expert_capacity_factor >= 0:
            raise ValueError(f"ModelConfig.expert_capacity_factor={self.expert_capacity_factor}"
                             "; use 0 (exact) or a positive factor")
        if self.shared_expert_intermediate_size and (
                self.model_type not in SHARED_EXPERT_MODEL_TYPES
                or self.shared_expert_intermediate_size < 0):
            raise ValueError(
                f"ModelConfig.shared_expert_intermediate_size={self.shared_expert_intermediate_size}"
                f" for model_type={self.model_type!r}: a shared expert (width >= 1) is for "
                f"{SHARED_EXPERT_MODEL_TYPES} only; use 0 (none)")
        if not self.is_moe:
            if self.num_experts or self.num_experts_per_tok or self.moe_intermediate_size:
                raise ValueError(f"ModelConfig.num_experts={self.num_experts}: model_type="
                                 f"{self.model_type!r} is dense; use one of {MOE_MODEL_TYPES}")
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"[1, num_experts={self.num_experts}] for model_type={self.model_type!r}")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"ModelConfig.moe_intermediate_size={self.moe_intermediate_size} "
                             f"must be >= 1 for model_type={self.model_type!r}")

    # ----------------------------------------------------------------------------------------
    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (e.g. ``cfg.replace(dtype="bfloat16")``)."""
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(
        cls,
        hf: dict[str, Any],
        *,
        param_dtype: str = "float32",
        dtype: str = "float32",
        source: str = "config.json",
    ) -> "ModelConfig":
        """Build from a HF ``config.json`` dict (qwen2, qwen3, llama, qwen3_moe or qwen2_moe).

        Accepts both the transformers-5 ``rope_parameters`` layout and the older
        ``rope_theta`` + ``rope_scaling`` layout. ``source`` names the file in error messages.
        """
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type={model_type!r} is not supported; "
                f"supported model_type values: {SUPPORTED_MODEL_TYPES}"
            )
        defaults = _DEFAULTS[model_type]

        def need(key: str) -> Any:
            if hf.get(key) is None:
                raise ValueError(f"{source}: required field {key!r} is missing")
            return hf[key]

        hidden_size = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        head_dim = int(hf.get("head_dim") or hidden_size // num_heads)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r}; only 'silu' is supported")
        if hf.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        if hf.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported")

        rope_theta, rope_scaling = _parse_rope(hf, source)

        if model_type == "qwen2":
            # transformers' Qwen2Attention always has q/k/v biases and no o_proj bias.
            attention_bias = True
        elif model_type == "qwen2_moe":   # q/k/v biases unless qkv_bias=false (HF's default true)
            attention_bias = bool(hf.get("qkv_bias", True))
        else:
            attention_bias = bool(hf.get("attention_bias", False))

        eos = hf.get("eos_token_id")
        eos_list = [] if eos is None else (eos if isinstance(eos, list) else [eos])
        eos_ids = tuple(int(e) for e in eos_list)
        bos = hf.get("bos_token_id")
        tie = hf.get("tie_word_embeddings")
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps") or defaults["rms_norm_eps"]),
            attention_bias=attention_bias,
            qk_norm=(model_type in ("qwen3", "qwen3_moe")),
            tie_word_embeddings=bool(defaults["tie_word_embeddings"] if tie is None else tie),
            max_position_embeddings=int(
                hf.get("max_position_embeddings") or defaults["max_position_embeddings"]
            ),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            param_dtype=param_dtype,
            dtype=dtype,
            **(_parse_moe(hf, source) if model_type in MOE_MODEL_TYPES else {}),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same architecture."""
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update(dict(self.rope_scaling))
        eos: int | list[int] | None
        if not self.eos_token_ids:
            eos = None
        elif len(self.eos_token_ids) == 1:
            eos = self.eos_token_ids[0]
        else:
            eos = list(self.eos_token_ids)
        hf: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.model_type == "qwen2":
            hf["use_sliding_window"] = False
        elif self.model_type == "qwen2_moe":
            hf["qkv_bias"] = self.attention_bias
        else:
            hf["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = False
        if self.is_moe:
            hf.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      moe_intermediate_size=self.moe_intermediate_size,
                      norm_topk_prob=self.norm_topk_prob,
                      router_aux_loss_coef=self.router_aux_loss_coef,
                      decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
        if self.model_type in SHARED_EXPERT_MODEL_TYPES:
            hf["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return hf


def _parse_moe(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelConfig's mixture-of-experts fields from a qwen3_moe or qwen2_moe ``config.json``.

    transformers writes ``num_local_experts`` (its attribute map for ``num_experts``). Only
    checkpoints whose every layer is sparse load: the layers run as one ``lax.scan`` over
    identically shaped params, so dense MLP layers among them (mlp_only_layers,
    decoder_sparse_step > 1) are refused; Qwen3-MoE's and Qwen2-MoE's (Qwen1.5-MoE-A2.7B,
    Qwen2-57B-A14B) released checkpoints have none. A qwen2_moe config.json must name its
    shared expert's width (shared_expert_intermediate_size).
    """
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    required = [("num_experts", num_experts),
                ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                ("moe_intermediate_size", hf.get("moe_intermediate_size"))]
    shared = hf.get("model_type") in SHARED_EXPERT_MODEL_TYPES
    if shared:
        required.append(("shared_expert_intermediate_size",
                         hf.get("shared_expert_intermediate_size")))
    for key, value in required:
        if value is None:
            raise ValueError(f"{source}: required field {key!r} is missing")
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step") or 1) != 1:
        raise ValueError(
            f"{source}: mlp_only_layers={hf.get('mlp_only_layers')}, decoder_sparse_step="
            f"{hf.get('decoder_sparse_step')}: dense layers among the sparse ones are not "
            "supported; every layer must be sparse (mlp_only_layers=[], decoder_sparse_step=1)")
    return {
        "num_experts": int(num_experts),
        "num_experts_per_tok": int(hf["num_experts_per_tok"]),
        "moe_intermediate_size": int(hf["moe_intermediate_size"]),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef") or 0.0),
        "shared_expert_intermediate_size": (int(hf["shared_expert_intermediate_size"])
                                            if shared else 0),
    }


def _parse_rope(hf: dict[str, Any], source: str) -> tuple[float, tuple | None]:
    """(rope_theta, hashable rope_scaling or None) from either HF rope layout.

    Priority mirrors transformers' ``convert_rope_params_to_dict``: a legacy ``rope_scaling`` dict
    wins over ``rope_parameters``; theta comes from the dict, else top-level ``rope_theta``.
    """
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{source}: per-layer-type rope parameters are not supported")
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or _DEFAULT_ROPE_THETA
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor != 1 is not supported")
    params.pop("partial_rotary_factor", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope_type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
        required = (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"
        )
        missing = [k for k in required if params.get(k) is None]
        if missing:
            raise ValueError(f"{source}: llama3 rope scaling is missing {missing}")
        keep = {k: params[k] for k in required}
    else:  # linear
        if params.get("factor") is None:
            raise ValueError(f"{source}: linear rope scaling is missing 'factor'")
        keep = {"factor": params["factor"]}
    keep = {
        k: int(v) if k == "original_max_position_embeddings" else float(v)
        for k, v in keep.items()
    }
    keep["rope_type"] = rope_type
    return float(theta), tuple(sorted(keep.items()))

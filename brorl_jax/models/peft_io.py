"""LoRA adapters as a PEFT adapter directory (what `peft.PeftModel.from_pretrained` loads onto
the base model): adapter_config.json and adapter_model.safetensors.

    save_peft([adapters, ...], cfg, out_dir, base_model_path)

Key names are PEFT's for Llama / Qwen2 / Qwen3 causal LMs:
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r] (torch's [out, in] layout: our A [in, r] and B [r, out] transposed).

Several adapter sets (the ones merged at reference resets, then the live one) are exported as one
adapter of rank r x sets: sum_i s A_i B_i = s [A_1 ... A_n] [B_1; ...; B_n], with alpha scaled by
the same factor so alpha / rank stays s. The run's own base took each merge rounded to its dtype;
in float32 that rounding is below 1e-6 of the weights.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np
from safetensors.numpy import save_file

from . import lora
from .config import ModelConfig

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def stacked(adapter_sets: Sequence[dict]) -> dict:
    """One adapter tree of rank r x len(adapter_sets) whose A @ B is the sum of theirs."""
    targets = adapter_sets[0].keys()
    cat = lambda key, axis: {t: np.concatenate([np.asarray(s[t][key], np.float32)
                                                for s in adapter_sets], axis=axis)
                             for t in targets}
    a, b = cat("a", -1), cat("b", -2)
    return {t: {"a": a[t], "b": b[t]} for t in targets}


def peft_tensors(adapters: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """PEFT's state dict of an adapter tree (A [L, in, r], B [L, r, out] per target)."""
    out = {}
    for t, ab in adapters.items():
        a, b = np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)
        for i in range(cfg.num_hidden_layers):
            name = f"base_model.model.model.layers.{i}.{lora.HF_MODULES[t]}"
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    return out


def peft_config(cfg: ModelConfig, rank: int, alpha: float, base_model: str) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": sorted(lora.TARGETS[t] for t in cfg.lora_targets),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
            "base_model_name_or_path": base_model}


def save_peft(adapter_sets: Sequence[dict], cfg: ModelConfig, path: str, base_model: str) -> None:
    """Writes the adapters (the merged ones, oldest first, then the live one) to `path`."""
    sets = len(adapter_sets)
    os.makedirs(path, exist_ok=True)
    save_file(peft_tensors(stacked(adapter_sets), cfg), os.path.join(path, WEIGHTS_NAME),
              metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(peft_config(cfg, cfg.lora_rank * sets, cfg.lora_alpha * sets, base_model), f,
                  indent=2)

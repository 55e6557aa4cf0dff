"""Load and save Hugging Face checkpoints (config.json + safetensors) as brorl_jax params.

``load_directory`` reads a LOCAL HF model directory (nothing is downloaded; the public
``brorl_jax.models.from_pretrained`` in pretrained.py also takes ``.gguf`` files and built-in
names and ends here):
    config.json                   -> ModelConfig (qwen2 | qwen3 | llama | qwen3_moe | qwen2_moe)
    model.safetensors, or shards listed in model.safetensors.index.json -> params
    generation_config.json (optional)    -> Model.generation_eos_ids
    tokenizer files (optional)           -> Model.tokenizer (transformers AutoTokenizer)
``save_pretrained`` writes the same layout, which transformers loads back with the same logits.

Weight names (HF -> params; torch Linear weights are [out, in], our Dense kernels [in, out]):
    model.embed_tokens.weight [V,D]                    -> embed/embedding [V,D]
    model.layers.{i}.input_layernorm.weight            -> layers/input_norm/scale[i]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   -> layers/{q,k,v,o}_proj/kernel[i] (T)
    model.layers.{i}.self_attn.{q,k,v,o}_proj.bias     -> layers/{q,k,v,o}_proj/bias[i]
    model.layers.{i}.self_attn.{q,k}_norm.weight       -> layers/{q,k}_norm/scale[i]   (qwen3)
    model.layers.{i}.post_attention_layernorm.weight   -> layers/post_attn_norm/scale[i]
    model.layers.{i}.mlp.{gate,up,down}_proj.weight    -> layers/{gate,up,down}_proj/kernel[i] (T)
    qwen3_moe, qwen2_moe (every layer sparse), what transformers 5 writes and Qwen's checkpoints
    hold (transformers fuses the experts in memory, not on disk):
    model.layers.{i}.mlp.gate.weight [E,D]             -> layers/moe/router[i] [D,E] (T)
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight -> layers/moe/{...}_proj[i, e] (T)
    qwen2_moe's shared expert:
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight -> layers/moe/shared_{...}[i] (T)
    model.layers.{i}.mlp.shared_expert_gate.weight [1,D] -> layers/moe/shared_expert_gate[i] (T)
    model.norm.weight                                  -> final_norm/scale
    lm_head.weight [V,D]                               -> lm_head/kernel [D,V] (T; untied only)
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file as _save_safetensors

from .config import ModelConfig
from .transformer import forward, init_params

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
GENERATION_CONFIG_NAME = "generation_config.json"
# A directory with a model's config and tokenizer files but no weights (a run's copy of its base
# model, brorl_jax/workdir/saved_config.py) holds this file; it loads with zero parameters, for
# restores whose checkpoint holds every weight (has_no_weights()).
NO_WEIGHTS_MARKER = "brorl_no_weights.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# (our per-layer leaf path) -> (HF name inside model.layers.{i}., transpose)
_LAYER_NAMES: dict[tuple[str, str], tuple[str, bool]] = {
    ("input_norm", "scale"): ("input_layernorm.weight", False),
    ("q_proj", "kernel"): ("self_attn.q_proj.weight", True),
    ("q_proj", "bias"): ("self_attn.q_proj.bias", False),
    ("k_proj", "kernel"): ("self_attn.k_proj.weight", True),
    ("k_proj", "bias"): ("self_attn.k_proj.bias", False),
    ("v_proj", "kernel"): ("self_attn.v_proj.weight", True),
    ("v_proj", "bias"): ("self_attn.v_proj.bias", False),
    ("o_proj", "kernel"): ("self_attn.o_proj.weight", True),
    ("o_proj", "bias"): ("self_attn.o_proj.bias", False),
    ("q_norm", "scale"): ("self_attn.q_norm.weight", False),
    ("k_norm", "scale"): ("self_attn.k_norm.weight", False),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", False),
    ("gate_proj", "kernel"): ("mlp.gate_proj.weight", True),
    ("up_proj", "kernel"): ("mlp.up_proj.weight", True),
    ("down_proj", "kernel"): ("mlp.down_proj.weight", True),
}
# (our per-layer leaf path) -> (HF name inside model.layers.{i}., transpose); "{e}" marks a
# per-expert tensor, stored at [i, e] of our [L, E, ...] leaf.
_MOE_NAMES: dict[tuple[str, str], tuple[str, bool]] = {
    ("moe", "router"): ("mlp.gate.weight", True),
    ("moe", "gate_proj"): ("mlp.experts.{e}.gate_proj.weight", True),
    ("moe", "up_proj"): ("mlp.experts.{e}.up_proj.weight", True),
    ("moe", "down_proj"): ("mlp.experts.{e}.down_proj.weight", True),
    ("moe", "shared_gate_proj"): ("mlp.shared_expert.gate_proj.weight", True),
    ("moe", "shared_up_proj"): ("mlp.shared_expert.up_proj.weight", True),
    ("moe", "shared_down_proj"): ("mlp.shared_expert.down_proj.weight", True),
    ("moe", "shared_expert_gate"): ("mlp.shared_expert_gate.weight", True),
}
_TOP_NAMES: dict[tuple[str, str], tuple[str, bool]] = {
    ("embed", "embedding"): ("model.embed_tokens.weight", False),
    ("final_norm", "scale"): ("model.norm.weight", False),
    ("lm_head", "kernel"): ("lm_head.weight", True),
}

# jnp.bfloat16 is the numpy-compatible ml_dtypes.bfloat16 scalar type.
_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}
_forward_jit = jax.jit(forward, static_argnums=1, static_argnames=("return_hidden", "remat"))


class Model:
    """A loaded model: config, params (stacked-layer pytree), tokenizer, stop token ids."""

    def __init__(
        self,
        config: ModelConfig,
        params: dict,
        tokenizer: Any = None,
        generation_eos_ids: tuple[int, ...] = (),
    ) -> None:
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.generation_eos_ids = tuple(int(e) for e in generation_eos_ids)

    def __call__(
        self,
        tokens: Any,
        *,
        positions: Any = None,
        attention_mask: Any = None,
        params: dict | None = None,
    ) -> jax.Array:
        """Logits f32[B,T,V] for tokens int32[B,T] (see transformer.forward)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        return _forward_jit(
            self.params if params is None else params,
            self.config,
            tokens,
            positions=None if positions is None else jnp.asarray(positions, jnp.int32),
            attention_mask=None if attention_mask is None else jnp.asarray(attention_mask, bool),
        )

    def with_params(self, params: dict) -> "Model":
        """The same model (config, tokenizer, eos ids) with other params, e.g. after training."""
        return Model(self.config, params, self.tokenizer, self.generation_eos_ids)

    def __repr__(self) -> str:
        n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(self.params))
        has_tokenizer = self.tokenizer is not None
        return f"Model({self.config.model_type}, {n:,} params, tokenizer={has_tokenizer})"


def _flat_names(
    cfg: ModelConfig, shapes: dict
) -> list[tuple[tuple[str, ...], str, bool, tuple[int, ...]]]:
    """Every HF tensor as (our path, HF name, transpose, its index in our leaf): () for a
    top-level leaf, (i,) for layer i's slice of a stacked leaf, (i, e) for expert e's."""
    out: list[tuple[tuple[str, ...], str, bool, tuple[int, ...]]] = []
    for (module, leaf), (hf_name, transpose) in _TOP_NAMES.items():
        if module in shapes and leaf in shapes[module]:
            out.append(((module, leaf), hf_name, transpose, ()))
    for (module, leaf), (hf_name, transpose) in {**_LAYER_NAMES, **_MOE_NAMES}.items():
        if module in shapes["layers"] and leaf in shapes["layers"][module]:
            experts = range(cfg.num_experts) if "{e}" in hf_name else (None,)
            for i in range(cfg.num_hidden_layers):
                for e in experts:
                    name = f"model.layers.{i}." + hf_name.replace("{e}", str(e))
                    index = (i,) if e is None else (i, e)
                    out.append((("layers", module, leaf), name, transpose, index))
    return out


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def param_shapes(cfg: ModelConfig) -> dict:
    """The param pytree of ``cfg`` as jax.ShapeDtypeStruct leaves (nothing allocated)."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))


def _read_json(file: Path) -> dict:
    try:
        with open(file) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e


def _weight_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it (single file or sharded index)."""
    index_file = path / WEIGHTS_INDEX_NAME
    single_file = path / WEIGHTS_NAME
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_file}: missing the 'weight_map' dict")
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise FileNotFoundError(f"{shard} (a shard listed in {index_file}) not found")
        return files
    if single_file.is_file():
        try:
            with safe_open(single_file, framework="np") as f:
                names = list(f.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{single_file}: cannot read safetensors file ({e})") from e
        return {name: single_file for name in names}
    raise FileNotFoundError(
        f"no weights in {path}: expected {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} (safetensors)"
    )


def _load_params(path: Path, cfg: ModelConfig) -> dict:
    """Read, shape-check, transpose, cast and stack every tensor the config needs.

    Done in numpy (one device transfer at the end) so loading compiles no per-shape XLA ops.
    """
    files = _weight_files(path)
    shapes = param_shapes(cfg)
    pdt = _NUMPY_DTYPES[cfg.param_dtype]
    entries = _flat_names(cfg, shapes)
    for our_path, hf_name, _, _ in entries:
        if hf_name not in files:
            index = path / WEIGHTS_INDEX_NAME
            where = index if index.is_file() else path / WEIGHTS_NAME
            raise ValueError(
                f"{where}: tensor {hf_name!r} is missing (needed for {'/'.join(our_path)})"
            )

    by_file: dict[Path, list] = {}
    for entry in entries:
        by_file.setdefault(files[entry[1]], []).append(entry)

    params: dict = {}
    for our_path in dict.fromkeys(entry[0] for entry in entries):
        _set(params, our_path, np.empty(_get(shapes, our_path).shape, pdt))
    for file, file_entries in by_file.items():
        for our_path, tensor, transpose, index in _read_file(file, file_entries, shapes, cfg):
            tensor = tensor.astype(pdt)
            _get(params, our_path)[index] = tensor.T if transpose else tensor
    return jax.tree.map(jnp.asarray, params)


def _read_file(file: Path, entries: list, shapes: dict, cfg: ModelConfig):
    """Yield (our path, numpy tensor, transpose, index) for ``entries`` of one safetensors file,
    checking each stored shape against the config before reading its data."""
    try:
        with safe_open(file, framework="np") as f:
            stored = {name: f.get_slice(name) for _, name, _, _ in entries}
            meta = {name: (tuple(sl.get_shape()), sl.get_dtype()) for name, sl in stored.items()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{file}: cannot read safetensors file ({e})") from e
    for our_path, hf_name, transpose, index in entries:
        expected = tuple(_get(shapes, our_path).shape)[len(index):]
        hf_expected = expected[::-1] if transpose else expected
        got = meta[hf_name][0]
        if got != hf_expected:
            raise ValueError(
                f"{file}: tensor {hf_name!r} has shape {list(got)}, expected "
                f"{list(hf_expected)} from {CONFIG_NAME} ({cfg.model_type}, "
                f"hidden_size={cfg.hidden_size}, heads={cfg.num_attention_heads}/"
                f"{cfg.num_key_value_heads}, head_dim={cfg.head_dim}, "
                f"intermediate_size={cfg.intermediate_size}, vocab_size={cfg.vocab_size}"
                + (f", num_experts={cfg.num_experts}, moe_intermediate_size="
                   f"{cfg.moe_intermediate_size}, shared_expert_intermediate_size="
                   f"{cfg.shared_expert_intermediate_size})" if cfg.is_moe else ")")
            )
    # safetensors' numpy backend has no bfloat16: such files are read through its flax backend
    # and converted to numpy (ml_dtypes bfloat16).
    has_bf16 = any(dtype == "BF16" for _, dtype in meta.values())
    try:
        with safe_open(file, framework="flax" if has_bf16 else "np") as f:
            for our_path, hf_name, transpose, index in entries:
                yield our_path, np.asarray(f.get_tensor(hf_name)), transpose, index
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise ValueError(f"{file}: cannot read tensor data ({e})") from e


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def _load_tokenizer(path: Path) -> Any:
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    # Imported lazily: transformers is slow to import.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    declared = None
    if (path / "tokenizer_config.json").is_file():
        declared = _read_json(path / "tokenizer_config.json").get("tokenizer_class")
    try:
        generic = declared in ("TokenizersBackend", "PreTrainedTokenizerFast")
        if generic and (path / "tokenizer.json").is_file():
            # A generic tokenizer.json (e.g. the demo's character tokenizer) is loaded as
            # declared: transformers 5 AutoTokenizer would force Qwen2Tokenizer's byte-level
            # pre-tokenizer onto any model_type "qwen2" directory and drop its spaces.
            return PreTrainedTokenizerFast.from_pretrained(str(path))
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types; name the directory and the cause
        raise ValueError(f"{path}: tokenizer files present but AutoTokenizer failed: {e}") from e


def read_directory_config(
    path: str | os.PathLike, dtype: str = "float32", param_dtype: str | None = None
) -> ModelConfig:
    """The ModelConfig of a HF checkpoint directory from its config.json alone (no weights
    read); errors as ``load_directory``."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} not found")
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: {path} is not a HF model directory")
    return ModelConfig.from_hf_config(
        _read_json(config_file), param_dtype=param_dtype or dtype, dtype=dtype,
        source=str(config_file)
    )


def load_directory(
    path: str | os.PathLike, dtype: str = "float32", param_dtype: str | None = None
) -> Model:
    """Load a local Hugging Face checkpoint directory as a ``Model`` (``from_pretrained`` also
    takes ``.gguf`` files and built-in names and ends here).

    dtype: compute dtype ("float32" | "bfloat16"); param_dtype: storage dtype (default: dtype).
    generation_eos_ids come from generation_config.json, else config.json, else the tokenizer.
    Raises FileNotFoundError for a missing directory/config/weights file and ValueError for an
    unsupported model_type, a corrupt file, or a missing or wrongly shaped tensor (the message
    names the file, the tensor and the expected shape).
    """
    path = Path(path).expanduser()
    cfg = read_directory_config(path, dtype=dtype, param_dtype=param_dtype)
    if has_no_weights(path):
        params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), param_shapes(cfg))
    else:
        params = _load_params(path, cfg)
    tokenizer = _load_tokenizer(path)

    eos: tuple[int, ...] = ()
    gen_file = path / GENERATION_CONFIG_NAME
    if gen_file.is_file():
        eos = _eos_ids(_read_json(gen_file).get("eos_token_id"))
    if not eos:
        eos = cfg.eos_token_ids
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = (int(tokenizer.eos_token_id),)
    return Model(cfg, params, tokenizer, eos)


def has_no_weights(path: str | os.PathLike) -> bool:
    """Whether `path` is a config-and-tokenizer directory without weights (NO_WEIGHTS_MARKER)."""
    return os.path.isfile(os.path.join(path, NO_WEIGHTS_MARKER))


def save_pretrained(model: Model, path: str | os.PathLike) -> None:
    """Write ``model`` as a HF checkpoint: config.json, generation_config.json,
    model.safetensors (params in cfg.param_dtype), and the tokenizer files if it has one."""
    cfg = model.config
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    shapes = param_shapes(cfg)
    pdt = _NUMPY_DTYPES[cfg.param_dtype]
    tensors: dict[str, np.ndarray] = {}
    host: dict[tuple[str, ...], np.ndarray] = {}  # each stacked leaf copied to numpy once
    for our_path, hf_name, transpose, index in _flat_names(cfg, shapes):
        if our_path not in host:
            try:
                host[our_path] = np.asarray(_get(model.params, our_path))
            except KeyError as e:
                raise ValueError(f"save_pretrained: params lack {'/'.join(our_path)}") from e
        value = host[our_path][index].astype(pdt)
        tensors[hf_name] = np.ascontiguousarray(value.T) if transpose else value
    # Write beside the target and rename, so a crash never leaves a half-written weights file.
    fd, tmp = tempfile.mkstemp(dir=path, suffix=".safetensors.tmp")
    os.close(fd)
    try:
        _save_safetensors(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, path / WEIGHTS_NAME)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    with open(path / CONFIG_NAME, "w") as f:
        json.dump(cfg.to_hf_config(), f, indent=2)
    gen = {"bos_token_id": cfg.bos_token_id}
    if model.generation_eos_ids:
        eos = list(model.generation_eos_ids)
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if model.tokenizer is not None and model.tokenizer.pad_token_id is not None:
        gen["pad_token_id"] = int(model.tokenizer.pad_token_id)
    with open(path / GENERATION_CONFIG_NAME, "w") as f:
        json.dump(gen, f, indent=2)
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(path))

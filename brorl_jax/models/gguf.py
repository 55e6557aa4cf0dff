"""GGUF checkpoints (llama.cpp's format, possibly quantised) as Hugging Face directories.

transformers dequantises them through the optional packages ``gguf`` and ``accelerate``
(``pip install 'brorl_jax[gguf]'``); ``convert_gguf`` writes the result as a normal HF directory
(float32 weights, config without the quantisation entry, tokenizer with its chat template,
generation config), which ``hf.load_directory`` reads.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from pathlib import Path

GGUF_SUFFIX = ".gguf"
GGUF_PACKAGES = ("gguf", "accelerate")  # what transformers needs to dequantise a GGUF file
GGUF_EXTRA = "pip install 'brorl_jax[gguf]'"


def require_gguf_packages(what: str = "reading a GGUF file") -> None:
    """ImportError naming the extra when transformers' GGUF support cannot work here."""
    missing = [name for name in GGUF_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"{what} needs the packages {', '.join(GGUF_PACKAGES)} (transformers dequantises "
            f"GGUF through them); missing: {', '.join(missing)}. Install them with: {GGUF_EXTRA}"
        )


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Dequantise ``gguf_file`` with transformers and write it to ``out_dir`` as a normal HF
    directory (float32 safetensors, config.json without quantization_config, tokenizer files with
    the chat template, generation_config.json). Returns ``out_dir`` as a string.

    transformers loads GGUF as a model flagged as quantised, which it refuses to save; the
    weights are therefore copied into a model re-created from the same config without the
    quantisation entry, and that one is saved.
    """
    gguf_file = Path(gguf_file).expanduser()
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} not found")
    require_gguf_packages(f"converting {gguf_file}")
    import torch
    import transformers

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        with _read_once():
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = transformers.AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32
            )
    except Exception as e:  # transformers raises many types; name the file and the cause
        raise ValueError(f"{gguf_file}: transformers could not read this GGUF file: {e}") from e
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return str(out)


@contextlib.contextmanager
def _read_once():
    """transformers parses the GGUF file three times (tokenizer, config, weights: the parse of
    the vocabulary fields alone is ~5 s for SmolLM2's 49k tokens) and rebuilds gguf's tensor
    name map for every tensor (~400 times, 16 ms each). Inside this context ``gguf.GGUFReader``
    returns one reader per file (read-only: a memory map) and ``gguf.get_tensor_name_map`` is
    memoised; transformers imports both from ``gguf`` when it calls them. The same files come
    out, byte for byte; SmolLM2's conversion took 23 s, now 15 s, imports included (2-core AMD
    EPYC dev VM, 2026-12-03)."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if mode != "r":
            return real_reader(path, mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map

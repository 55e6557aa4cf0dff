"""Where built-in models are materialised once, atomically (model directories, not a KV cache)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence


def default_cache_dir() -> Path:
    """$BRORL_JAX_CACHE if set, else ~/.cache/brorl_jax."""
    root = os.environ.get("BRORL_JAX_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "brorl_jax"


def is_complete(path: Path, files: Sequence[str]) -> bool:
    return all((path / name).is_file() for name in files)


def materialize(target: Path, files: Sequence[str], write: Callable[[Path], None],
                what: str) -> str:
    """`target` as a directory holding `files`: returned as is when complete; otherwise
    write(tmp) fills a private sibling directory that is then renamed into place, so concurrent
    callers never see a partial directory (when another process finishes first, its copy is
    used). A non-empty incomplete `target` is an error naming what is missing."""
    if is_complete(target, files):
        return str(target)
    if target.exists() and any(target.iterdir()):
        raise ValueError(f"{target} exists but is not a complete {what} (needs "
                         f"{', '.join(files)}); delete it or pass another path")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=target.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp made it private; the cache is meant to be shared
        if target.exists():  # an empty directory left by someone: replace it
            target.rmdir()
        os.rename(tmp, target)
    except OSError:
        # Another process finished first (rename onto a non-empty directory fails): use theirs.
        if not is_complete(target, files):
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)

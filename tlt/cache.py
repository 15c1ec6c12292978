"""The local cache ($TLT_CACHE or ~/.cache/tlt) and atomic builds into it.

Everything tlt builds once (the converted default model, its warm-up drafter, the tiny smoke-test model) is written
into a temporary sibling directory and renamed into place, so a crash or a concurrent builder never leaves a
half-written entry behind.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    root = os.environ.get("TLT_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "tlt"


def build_atomically(out: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool]) -> Path:
    """Return `out`, first running build(tmp_dir) and renaming tmp_dir to `out` when `out` is not complete."""
    if is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is an ordinary shared directory
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists() and not is_complete(out):
            # a leftover of an interrupted or another build: moved aside whole (a concurrent builder may be doing
            # the same: then the other's move wins), then removed
            aside = out.with_name(f"{tmp.name}.old")
            try:
                out.rename(aside)
            except FileNotFoundError:
                pass
            else:
                shutil.rmtree(aside, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:
            if not is_complete(out):  # not a concurrent builder that won the race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out

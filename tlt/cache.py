"""The local cache ($TLT_CACHE or ~/.cache/tlt) and atomic, verified builds into it.

Everything tlt builds once (the converted default model, its warm-up drafter, the tiny smoke-test model, compiled
kernels) is written into a temporary sibling directory, its manifest written last (tlt.integrity: every file's
size and CRC-32), and renamed into place, so a crash or a concurrent builder never leaves a half-written entry
behind. A complete entry is verified each time it is reused (its manifest and headers, plus the builder's own
check); one that fails is set aside as <name>.corrupt-<time> (kept for a look, never deleted) and rebuilt, with a
message saying so.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from tlt.integrity import CorruptFileError, check_directory, write_manifest

REBUILD = "tlt rebuilds it"


def cache_root() -> Path:
    root = os.environ.get("TLT_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "tlt"


def build_atomically(out: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool],
                     verify: Callable[[Path, str], object] | None = None) -> Path:
    """Return `out`, first running build(tmp_dir) and renaming tmp_dir to `out` when `out` is not complete or does
    not verify (check_directory, then verify(out, fix) if given, raising CorruptFileError)."""
    if is_complete(out):
        try:
            check_directory(out, REBUILD)
            if verify is not None:
                verify(out, REBUILD)
            return out
        except CorruptFileError as e:
            _set_aside(out, e)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is an ordinary shared directory
        for f in tmp.iterdir():
            if f.is_file():
                f.chmod(0o644)
        write_manifest(tmp)
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


def _set_aside(out: Path, problem: CorruptFileError) -> None:
    aside = out.with_name(f"{out.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        out.rename(aside)
    except FileNotFoundError:  # a concurrent builder set it aside first
        return
    print(f"tlt: the cached {out} fails verification ({problem.path} {problem.problem}): rebuilding it; the bad "
          f"copy is kept as {aside.name} (delete it once you no longer need it)", file=sys.stderr, flush=True)

"""Checks that a file tlt wrote earlier (a checkpoint, a cached build, a drafter) is whole before it is trusted.

A directory tlt writes records what it holds in `manifest.json`, written last: every file's size and CRC-32.
`check_manifest` compares the directory with it; the structural checks need no manifest, so that directories of
earlier versions are checked too: a safetensors file's header (safetensors' own parser, which refuses a file its
header does not cover exactly), a torch.save archive's zip directory, a JSON file's syntax. They read headers
only; checksums read every byte, at zlib's CRC-32 speed (about 5 GB/s on one core, where sha256 does about 1).

A bad file raises CorruptFileError: a UserError, so the command line prints one message naming the file and what
to do, with exit code 2. Nothing here deletes or changes a file it checks.
"""
from __future__ import annotations

import json
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any

from tlt.schema import UserError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "tlt-manifest-v1"
CHUNK = 16 * 2**20


class CorruptFileError(UserError):
    """A file tlt reads back is damaged or is not what its directory says; `path` and `problem` name it."""

    def __init__(self, path: str | os.PathLike, problem: str, fix: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path} {problem}. {fix}")


def crc32_of(path: Path) -> str:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path) -> None:
    """manifest.json listing every file below `directory` (size and CRC-32), written atomically: call it last."""
    files = {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "crc32": crc32_of(p)}
             for p in _files(directory)}
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as fh:
        json.dump({"format": MANIFEST_FORMAT, "files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / MANIFEST)


def read_manifest(directory: Path, fix: str) -> dict[str, dict] | None:
    """{relative path: {"bytes", "crc32"}}, or None for a directory without a manifest (written before them)."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    manifest = check_json(path, fix)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CorruptFileError(path, f"is not a {MANIFEST_FORMAT} manifest", fix)
    return manifest["files"]


def manifest_bytes(directory: Path) -> int:
    """What a directory's manifest says it holds (0 without one): what its checksums would read."""
    try:
        return sum(int(f["bytes"]) for f in (read_manifest(directory, "") or {}).values())
    except (CorruptFileError, KeyError, TypeError, ValueError):
        return 0


def check_manifest(directory: Path, fix: str, checksums: bool = True) -> bool:
    """Every file the manifest lists is there with its size (and CRC-32 when `checksums`); False when there is no
    manifest to check against."""
    files = read_manifest(directory, fix)
    if files is None:
        return False
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            raise CorruptFileError(path, f"is missing: {directory / MANIFEST} lists it", fix)
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CorruptFileError(path, f"is {size} bytes where {MANIFEST} recorded {entry['bytes']} (cut short, "
                                         f"or replaced after it was written)", fix)
        if checksums and crc32_of(path) != entry["crc32"]:
            raise CorruptFileError(path, f"does not match its checksum in {MANIFEST} (its bytes changed after it "
                                         f"was written)", fix)
    return True


def _nonempty(path: Path, fix: str) -> None:
    if not path.is_file():
        raise CorruptFileError(path, "is missing", fix)
    if path.stat().st_size == 0:
        raise CorruptFileError(path, "is empty (0 bytes)", fix)


def check_safetensors(path: Path, fix: str, shapes: dict[str, tuple[int, ...]] | None = None,
                      optional: tuple[str, ...] = ()) -> dict[str, tuple[int, ...]]:
    """The file's tensor shapes from its header; with `shapes`, each named tensor must be there (unless
    `optional`) with that shape. Reads the header only."""
    from safetensors import SafetensorError, safe_open
    _nonempty(path, fix)
    try:
        with safe_open(str(path), framework="pt") as fh:
            held = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except (SafetensorError, OSError) as e:
        raise CorruptFileError(path, f"is not a readable safetensors file ({e})", fix) from None
    for name, shape in (shapes or {}).items():
        if name not in held:
            if name in optional:
                continue
            raise CorruptFileError(path, f"has no tensor {name!r}", fix)
        if held[name] != tuple(shape):
            raise CorruptFileError(path, f"holds {name!r} of shape {list(held[name])} where {list(shape)} is "
                                         "expected", fix)
    return held


def check_torch_archive(path: Path, fix: str) -> None:
    """A torch.save file: its zip directory reads and every record it lists lies inside the file."""
    _nonempty(path, fix)
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError) as e:
        raise CorruptFileError(path, f"is not a complete torch.save archive ({e})", fix) from None
    if not any(r.filename.endswith("data.pkl") for r in records):
        raise CorruptFileError(path, "is a zip file but not a torch.save archive (no data.pkl)", fix)
    for r in records:
        if r.header_offset + r.compress_size > size:
            raise CorruptFileError(path, f"is cut short: its record {r.filename} runs past the end", fix)


def check_json(path: Path, fix: str) -> Any:
    """The parsed contents of a JSON file."""
    _nonempty(path, fix)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptFileError(path, f"is not valid JSON ({e})", fix) from None


def check_directory(directory: Path, fix: str, checksums: bool = True) -> None:
    """A directory tlt built: its manifest when it has one, then every safetensors header and JSON file in it."""
    check_manifest(directory, fix, checksums)
    for path in _files(directory):
        if path.suffix == ".safetensors":
            check_safetensors(path, fix)
        elif path.suffix == ".json":
            check_json(path, fix)

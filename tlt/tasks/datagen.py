"""`tlt data`: write train/val files in verl's schema from reasoning-gym generators.

    tlt data --out data/arith                         # the default task's graded mix
    tlt data --out data/logic --tasks letter_counting,spell_backward --n-train 5000 --n-val 200

With no task names the default mix of `tlt.tasks.default_task` is written; any other reasoning-gym dataset name
is generated with its default config. Files: <out>/train.<fmt> and <out>/val.<fmt>, fmt "parquet" or "jsonl".
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tlt.tasks.default_task import DEFAULT_MIX, Level, make_examples

FORMATS = ("parquet", "jsonl")


def levels_for(tasks: list[str] | None) -> tuple[Level, ...]:
    """The default mix for no names (or "default"); otherwise one default-config level per reasoning-gym name."""
    import reasoning_gym.factory

    if not tasks or list(tasks) == ["default"]:
        return DEFAULT_MIX
    unknown = sorted(set(tasks) - set(reasoning_gym.factory.DATASETS))
    if unknown:
        raise ValueError(f"unknown reasoning-gym task(s) {unknown}; available: "
                         f"{', '.join(sorted(reasoning_gym.factory.DATASETS))}")
    return tuple(Level(name, "default") for name in tasks)


def write_rows(rows: list[dict], path: Path, fmt: str) -> None:
    """Write rows atomically (temp file then rename), as parquet or JSON lines."""
    tmp = path.with_name(f".{path.name}.tmp")
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), tmp)
    else:
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def write_dataset(out_dir: str | os.PathLike, tasks: list[str] | None = None, n_train: int = 10000,
                  n_val: int = 500, seed: int = 0, fmt: str = "parquet") -> dict[str, Path]:
    """Generate and write <out_dir>/train.<fmt> and <out_dir>/val.<fmt>; returns {split: path}."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {FORMATS}")
    if n_train < 1 or n_val < 0:
        raise ValueError(f"need n_train >= 1 and n_val >= 0, got n_train={n_train}, n_val={n_val}")
    levels = levels_for(tasks)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("val", n_val)):
        paths[split] = out / f"{split}.{fmt}"
        write_rows(list(make_examples(split, n, seed, levels)), paths[split], fmt)
    return paths


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="tlt data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--tasks", default=None, help="comma-separated reasoning-gym task names (default: the default mix)")
    ap.add_argument("--n-train", type=int, default=10000)
    ap.add_argument("--n-val", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", choices=FORMATS, default="parquet")
    a = ap.parse_args(argv)
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()] if a.tasks else None
    paths = write_dataset(a.out, tasks, a.n_train, a.n_val, a.seed, a.format)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0

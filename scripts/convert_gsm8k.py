"""Convert a local GSM8K copy (openai/gsm8k parquet or jsonl: question, answer with the result after '####')
into verl-schema train/test files with a boxed-answer instruction. Nothing is downloaded.

    python scripts/convert_gsm8k.py --src path/to/gsm8k/main --out data/gsm8k [--fmt parquet|jsonl]

--src is a file or a directory; in a directory, files whose names contain "train" / "test" are used.
Reward: the default task's scorer understands \\boxed{...} answers, or use math-verify on data_source openai/gsm8k.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tlt.tasks.datagen import FORMATS, write_rows

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def read_records(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    raise ValueError(f"{path}: expected a .parquet or .jsonl file")


def final_answer(solution: str) -> str:
    """GSM8K's number after '####', without thousands separators ("#### 1,200" -> "1200")."""
    if "####" not in solution:
        raise ValueError(f"GSM8K answer has no '####' line: {solution[-80:]!r}")
    return solution.split("####")[-1].strip().replace(",", "")


def to_row(record: dict, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{record['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final_answer(record["answer"])},
        "extra_info": {"split": split, "index": index, "question": record["question"],
                       "answer": record["answer"]},
    }


def split_files(src: Path) -> dict[str, Path]:
    if src.is_file():
        return {"test" if "test" in src.name else "train": src}
    files = sorted(p for p in src.iterdir() if p.suffix in (".parquet", ".jsonl", ".json"))
    found = {split: [p for p in files if split in p.name] for split in ("train", "test")}
    if not any(found.values()):
        raise FileNotFoundError(f"{src} has no *train* / *test* .parquet or .jsonl files")
    return {split: paths[0] for split, paths in found.items() if paths}


def convert(src: str | Path, out_dir: str | Path, fmt: str = "parquet") -> dict[str, Path]:
    """Convert every split found under src; returns {split: written path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, path in split_files(Path(src)).items():
        rows = [to_row(r, split, i) for i, r in enumerate(read_records(path))]
        written[split] = out / f"{split}.{fmt}"
        write_rows(rows, written[split], fmt)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="GSM8K file or directory (parquet or jsonl)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--fmt", default="parquet", choices=FORMATS)
    args = ap.parse_args(argv)
    for split, path in convert(args.src, args.out, args.fmt).items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

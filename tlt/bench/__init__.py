"""Benchmarks: `tlt bench NAME [ARGS]` runs `tlt.bench.NAME.main(ARGS)`; each prints a table, then one JSON line.

    tlt bench decode [--quick] [--dtype float32,bfloat16] ...   plain decode tokens/s: tlt vs transformers
    tlt bench attention [--contexts 512,2048,8192] ...          decode at long contexts: flex vs sdpa attention
    tlt bench spec [...]                                        speculative decoding vs plain decoding
    tlt bench e2e [...]                                         end-to-end RL step time
    tlt bench NAME --help                                       the options of one benchmark

Benchmarks are not tests: they assert nothing about the numbers they print.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

HELPERS = {"common", "random_model"}  # modules here that are not benchmarks


def available() -> list[str]:
    """Benchmark module names present in this install (tlt/bench/<name>.py with a main(argv))."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in HELPERS)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print(f"available: {', '.join(names)}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"tlt bench: unknown benchmark {name!r}; available: {', '.join(names) or 'none'}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"tlt.bench.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

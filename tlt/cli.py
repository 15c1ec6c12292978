"""`tlt` command line: each subcommand lives in its own module and takes the remaining arguments.

    tlt train [CONFIG.yaml] [key=value ...]   GRPO training (no arguments: the embedded default task and model)
    tlt eval CHECKPOINT [key=value ...]       accuracy (mean@k, pass@k) of a checkpoint on a dataset
    tlt data [--out DIR] ...                  write reasoning-gym datasets in verl's schema
    tlt train-drafter [key=value ...]         offline drafter warm-up: sample with the target, train the drafter
    tlt export-drafter DIR --out OUT          the drafter as a vLLM EAGLE draft model, with a test vector
    tlt bench decode|spec|e2e [...]           benchmarks (a table, then one JSON line)
    tlt plan [CONFIG.yaml] [key=value ...]    per-device memory of a training config (exit 2 if it will not fit)

A mistake in what you gave (config key or value, data row, model or drafter directory, reward function, output
directory) is one message naming it and saying what to do, with exit code 2; add --debug (anywhere) or set
TLT_DEBUG=1 to see the traceback as well.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback

from tlt.schema import UserError

COMMANDS = {
    "train": ("tlt.rl.trainer", "main"),
    "eval": ("tlt.rl.evaluate", "main"),
    "data": ("tlt.tasks.datagen", "main"),
    "train-drafter": ("tlt.drafter_train.offline", "main"),
    "export-drafter": ("tlt.export.command", "main"),
    "bench": ("tlt.bench", "main"),
    "plan": ("tlt.plan", "main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("TLT_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        if not argv:  # `tlt` alone is `tlt train` with the defaults: the out-of-the-box main job
            argv = ["train"]
        else:
            print(__doc__)
            return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        import difflib
        near = difflib.get_close_matches(cmd, COMMANDS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        print(f"tlt: unknown command {cmd!r}{hint}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, fn = COMMANDS[cmd]
    try:
        return int(getattr(importlib.import_module(module), fn)(rest) or 0)
    except UserError as e:
        if debug:
            traceback.print_exc()
        print(f"tlt {cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

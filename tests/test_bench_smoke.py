"""`tlt bench decode --quick` runs on a tiny random model and ends with a parseable JSON line (numbers unchecked:
benchmarks are not tests); `tlt bench` names the available benchmarks when given an unknown one."""
from __future__ import annotations

import json

from tests.conftest import make_tiny_checkpoint
from tlt import bench
from tlt.bench import decode


def test_decode_quick_prints_table_and_json(tmp_path, capsys):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    assert decode.main(["--quick", "--models", model_dir]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any("ours_tok_s" in line for line in out)  # the table header
    result = json.loads(out[-1])
    assert result["benchmark"] == "decode"
    assert [(r["bs"], r["dtype"]) for r in result["rows"]] == [(1, "float32"), (2, "float32")]
    assert all(r["ours_tok_s"] > 0 and r["hf_tok_s"] > 0 for r in result["rows"])


def test_bench_dispatch_lists_available(capsys):
    assert "decode" in bench.available() and "common" not in bench.available()
    assert bench.main(["no-such-bench"]) == 2
    assert "available: " in capsys.readouterr().err

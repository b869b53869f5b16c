"""`spd-bench bench stage`: one record per stage and width, with what a branch costs in linear-attention state."""

import json

from click.testing import CliRunner

from harness.cli import main


def test_stage_bench_times_every_stage_at_every_width_and_sizes_a_branch(tmp_path):
    out = tmp_path / "stage.jsonl"
    result = CliRunner().invoke(main, ["bench", "stage", "--random", "tiny-qwen3.5", "--n", "2", "--width", "1,4",
                                       "--prompt-len", "8", "--repeats", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["stage"], r["width"]) for r in rows) == [(0, 1), (0, 4), (1, 1), (1, 4)]
    assert all(r["median_ms"] > 0 and r["linear_layers"] > 0 for r in rows)
    assert len({r["config_key"] for r in rows}) == 4  # a results file the report's reader accepts
    # tiny Qwen3.5 per linear layer: conv (2 key + 4 value heads of 16) channels x kernel 4, recurrent 4 x 16 x 16, fp32
    per_layer = (2 * 2 * 16 + 4 * 16) * 4 * 4 + 4 * 16 * 16 * 4
    assert all(r["linear_bytes_per_branch"] == per_layer * r["linear_layers"] for r in rows)
    assert "vs width 1" in result.output


def test_stage_bench_refuses_layers_without_a_random_model():
    result = CliRunner().invoke(main, ["bench", "stage", "--layers", "2"])
    assert result.exit_code == 2 and "--random" in result.output

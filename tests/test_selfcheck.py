"""The GPU self-check's own path, on a CPU with tiny shapes: every method, HF generate and the distributed executor."""

import json

from click.testing import CliRunner

from harness.cli import main


def test_selfcheck_runs_every_method_against_ar_and_records_it(tmp_path):
    out = tmp_path / "selfcheck.jsonl"
    result = CliRunner().invoke(main, ["selfcheck", "--device", "cpu", "--shapes", "tiny", "--prompts", "1",
                                       "--max-new-tokens", "8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    methods = {(r["model"].split()[0], r["method"]) for r in rows}
    assert ("qwen3", "spd n=4 ls=1 input w=4") in methods and ("qwen3_5", "eagle3 m=3 w=1") in methods
    assert ("qwen3_5", "spd n=4 ls=1 input w=4") in methods and ("qwen3_5", "eagle3 m=3 w=4") in methods
    assert ("qwen3", "ssd k=3 fan_out=2") in methods and ("qwen3_5", "ssd k=3 fan_out=2") in methods
    assert any(m.startswith("spd n=2 distributed") for _, m in methods)
    assert any(m.startswith("ssd k=3 fan_out=2 distributed") for _, m in methods)
    assert all(r["ok"] for r in rows) and "verdict" in result.output


def test_selfcheck_on_a_missing_gpu_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["selfcheck", "--device", "cuda", "--out", str(tmp_path / "s.jsonl")])
    assert result.exit_code == 2 and "CUDA is not available" in result.output
    assert not (tmp_path / "s.jsonl").exists()

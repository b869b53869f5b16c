"""The GPU self-check's own path, on a CPU with tiny shapes: every method, HF generate and the distributed executor."""

import json

import torch
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
    assert all(r["dtype"] == "float32" for r in rows)
    assert f"torch {torch.__version__}, CUDA None, float32, --compile off: {len(rows)} of {len(rows)} checks pass, " \
           f"0 numerics flips" in result.output  # the line to paste into an issue


def test_selfcheck_on_a_missing_gpu_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["selfcheck", "--device", "cuda", "--out", str(tmp_path / "s.jsonl")])
    assert result.exit_code == 2 and "CUDA is not available" in result.output
    assert not (tmp_path / "s.jsonl").exists()


def test_a_failing_check_is_one_line_in_its_record_and_the_others_still_run_and_are_written(tmp_path, monkeypatch):
    """Fails on a16459a: the self-check wrote its records only after every check returned, so `make gpu-check`'s
    last step crashing (a bare "cuda" in torch.cuda.set_device) lost everything it had measured."""
    from harness.bench import selfcheck

    def broken(*args, **kwargs):
        raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")

    monkeypatch.setattr(selfcheck, "time_against_hf", broken)
    monkeypatch.setattr(selfcheck, "check_distributed", broken)
    monkeypatch.setattr(selfcheck, "_methods", lambda target: [])  # AR alone runs before and after: enough here
    out = tmp_path / "selfcheck.jsonl"
    result = CliRunner().invoke(main, ["selfcheck", "--device", "cpu", "--shapes", "tiny", "--prompts", "1",
                                       "--max-new-tokens", "4", "--out", str(out)])
    assert result.exit_code == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    failed = [r for r in rows if not r["ok"]]
    assert [(r["method"], r["error"]) for r in failed] == [
        ("HF generate", "ValueError: Expected a torch.device with a specified index or an integer, but got:cuda"),
        ("HF generate", "ValueError: Expected a torch.device with a specified index or an integer, but got:cuda"),
        ("distributed", "ValueError: Expected a torch.device with a specified index or an integer, but got:cuda")]
    assert [(r["model"].split()[0], r["method"]) for r in rows if r["ok"]] == [("qwen3_5", "autoregressive"),
                                                                               ("qwen3", "autoregressive")]
    assert result.output.count("FAIL: ") == 3  # each printed as it finished


def test_a_bare_cuda_device_is_indexed_where_it_is_parsed(monkeypatch):
    """torch refuses an index-less CUDA device in set_device (fails on a16459a: `--device cuda` reached it bare)."""
    import torch

    from harness.runtime.devices import indexed
    from harness.runtime.distributed import backend_for

    assert indexed("cuda") == "cuda:0" and indexed("cuda:2") == "cuda:2" and indexed("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed("cuda") == "cuda:3"
    assert torch.device(indexed("cuda")).index == 3
    assert backend_for("cuda", ["cuda:3"]) == "gloo"  # one GPU for two ranks: NCCL refuses it

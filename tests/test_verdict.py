"""The losslessness verdict: a numerics flip told from a logic divergence (harness/runtime/verdict.py), on
controlled logits and through a real run with a planted verifier bug."""

import json
from contextlib import contextmanager

import pytest
import torch
from click.testing import CliRunner

from harness.cli import main
from harness.runtime.verdict import classify

VOCAB = 8


class Watched:
    """What classify needs of a runtime: its dtype and a way to watch the logits it computes."""

    dtype = torch.float32

    def __init__(self):
        self.watchers = []

    @contextmanager
    def watching(self, watcher):
        self.watchers.append(watcher)
        yield
        self.watchers.remove(watcher)

    def emit(self, rows: torch.Tensor) -> None:
        for watcher in self.watchers:
            watcher(rows)


def _step_rows() -> torch.Tensor:
    """AR's one-token step logits at four positions; at the last, tokens 2 and 5 are 0.001 apart."""
    rows = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    for j, token in enumerate([1, 4, 3]):
        rows[j, token] = 6.0
    rows[3, 2], rows[3, 5] = 6.0, 5.999
    return rows


def _case(method_rows: torch.Tensor, output: list[int], replayed: list[int] | None = None):
    target, step = Watched(), _step_rows()
    reference = step.argmax(-1).tolist()

    def run_ar(n):
        for row in step[:n]:
            target.emit(row[None])
        return reference[:n]

    def run_method():
        target.emit(method_rows)  # one verify block holding every position's row
        return replayed or output

    return classify(target, run_method, run_ar, output, reference, 3)


def _noise(scale: float) -> torch.Tensor:
    return scale * torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)).clamp(-1, 1)


def test_a_near_tie_that_the_two_forms_round_apart_is_a_flip():
    rows = _step_rows() + _noise(0.004)
    rows[3, 2], rows[3, 5] = 5.999, 6.001  # the method's own logits put 5 first, by less than they differ
    verdict, evidence = _case(rows, [1, 4, 3, 5])
    assert verdict == "flip", evidence
    assert evidence.gap == pytest.approx(0.001, abs=1e-5) and evidence.difference <= evidence.bound


def test_a_token_its_own_logits_never_chose_is_a_logic_divergence():
    """A verifier that accepts a rejected draft: the method emits 6 where every row it computed says 2."""
    verdict, evidence = _case(_step_rows() + _noise(0.004), [1, 4, 3, 6])
    assert verdict == "logic" and "argmax" in evidence.reason


def test_a_row_from_another_prefix_is_a_logic_divergence():
    """The method's row has its token first, but differs from AR's step by far more than on the earlier positions
    (a wrong prefix, a stale cache): not rounding."""
    rows = _step_rows() + _noise(0.004)
    rows[3] = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2))
    rows[3, 5] = 9.0
    verdict, evidence = _case(rows, [1, 4, 3, 5])
    assert verdict == "logic" and evidence.difference > evidence.bound


def test_a_gap_wider_than_the_difference_can_move_is_a_logic_divergence():
    rows = _step_rows() + _noise(0.004)
    rows[3, 2], rows[3, 5] = 5.0, 6.1  # the method's row puts 5 first by a margin rounding cannot make
    step = _step_rows()
    step_gap = float(step[3, 2] - step[3, 5])
    verdict, evidence = _case(rows, [1, 4, 3, 5])
    assert verdict == "logic" and evidence.gap == pytest.approx(step_gap)


def test_a_replay_that_decodes_other_tokens_is_a_logic_divergence():
    rows = _step_rows() + _noise(0.004)
    rows[3, 2], rows[3, 5] = 5.999, 6.001
    verdict, evidence = _case(rows, [1, 4, 3, 5], replayed=[1, 4, 3, 7])
    assert verdict == "logic" and "not deterministic" in evidence.reason


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_planted_verifier_bug_is_a_logic_divergence_in_the_record_and_on_the_bar(tiny_dir, eval_dir, tmp_path,
                                                                                  cache, monkeypatch):
    """Prompt lookup whose greedy verify also accepts the first draft the target rejected: its wrong tokens are
    logic divergences, marked DIVERGED on the bar; the same run without the bug is identical."""
    import methods.rounds as rounds
    from methods.verify import greedy_chain

    def accepts_a_rejected_draft(draft, argmax):
        count = torch.clamp(greedy_chain(draft, argmax)[0] + 1, max=len(draft))
        return torch.stack([count, argmax[count]])

    args = ["run", "--model", str(tiny_dir), "--method", "lookup", "--k", "4", "--dataset", "humaneval",
            "--limit", "4", "--max-new-tokens", "24", "--data-dir", str(eval_dir)]
    clean = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "clean.jsonl")])
    assert clean.exit_code == 0, clean.output
    assert all(r["lossless"]["verdict"] == "identical" for r in _records(tmp_path / "clean.jsonl"))
    monkeypatch.setattr(rounds, "greedy_chain", accepts_a_rejected_draft)
    planted = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "bug.jsonl")])
    assert planted.exit_code == 0, planted.output
    lossless = [r["lossless"] for r in _records(tmp_path / "bug.jsonl")]
    assert any(not row["identical"] for row in lossless)
    assert all(row["verdict"] == "logic" for row in lossless if not row["identical"])
    assert "DIVERGED@" in planted.output and "flip@" not in planted.output

"""Typed stats: what a family records, reads back and pools; and the generic reporting layer naming no family."""

import ast
from dataclasses import fields
from pathlib import Path

import methods  # noqa: F401  (fills the registry)
from methods.base import REGISTRY
from methods.eagle3.method import EagleStats
from methods.pipeline.stats import PipelineShape, PipelineStats
from methods.rounds import DraftShape
from methods.stats import Executor, Stats

ROOT = Path(__file__).resolve().parents[1]


def _pipeline(fills, runs, forward=None) -> PipelineStats:
    executor = Executor() if forward is None else Executor("distributed", "gloo", 3, ["cpu", "cpu"], forward)
    return PipelineStats(fill_drafts=fills, stage_runs=runs, drafter_calls=4, verifications=sum(fills),
                         pipeline=PipelineShape(30, 2, 15, 1, "input", 1), executor=executor)


def test_a_record_reads_back_as_the_family_wrote_it_and_leaves_out_what_was_not_counted():
    stats = _pipeline([3, 1], 12, [0.5, 0.25])
    raw = stats.record()
    assert raw["pipeline"] == {"num_layers": 30, "n": 2, "largest_stage": 15, "ls": 1, "schedule": "input", "width": 1}
    assert "expected_accepts" not in raw  # executed runs have no expected acceptance
    assert PipelineStats.read({**raw, "drafter": "abc", "finished_at": "now"}) == stats  # the runner's keys ignored
    replayed = EagleStats(2.5, draft=DraftShape(30, 1, 3)).record()
    assert replayed == {"expected_accepts": 2.5, "draft": {"num_layers": 30, "ls": 1, "m": 3, "width": 1}}


def test_pooling_adds_counts_element_wise_and_keeps_what_every_sample_shares():
    pooled = _pipeline([3, 1], 12, [0.5, 0.25]).pooled(_pipeline([2, 2, 1], 8, [0.25, 0.25]))
    assert pooled.fill_drafts == [5, 3, 1] and pooled.stage_runs == 20 and pooled.verifications == 9
    assert pooled.pipeline == PipelineShape(30, 2, 15, 1, "input", 1)  # a shape is not summed
    assert pooled.executor.world_size == 3 and pooled.executor.devices == ["cpu", "cpu"]
    assert pooled.executor.stage_forward_s == [0.75, 0.5]  # each rank's seconds add up
    assert Stats(1.0).pooled(Stats()).expected_accepts == 1.0  # a sample that did not count keeps the other's


def test_draft_positions_default_to_one_per_step_and_the_pipeline_counts_its_fills():
    assert Stats().drafts(steps=5, positions=3) == [5, 5, 5]
    assert _pipeline([3, 1], 12).drafts(steps=9, positions=2) == [3, 1]


def test_every_family_reads_the_stats_of_its_committed_records():
    import json

    for path in sorted((ROOT / "results").glob("*/*.jsonl")):
        for line in path.read_text().splitlines()[:5]:
            row = json.loads(line)
            if "stats" in row and row.get("method") in REGISTRY:
                stats = REGISTRY[row["method"]].Stats.read(row["stats"])
                assert {k: v for k, v in stats.record().items()} == {
                    k: v for k, v in row["stats"].items() if k in {f.name for f in fields(stats)}}, path


def _named(path: Path) -> tuple[set[str], set[str]]:
    """The string constants of a module and the modules it imports from."""
    tree = ast.parse(path.read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    modules = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return strings, modules


# `bench stage` times the target's own n-way stage split; "n" is a field of its committed records.
OWN_WORDS = {"speed_stage.py": {"n"}}


def test_the_generic_layers_name_no_family_and_no_family_parameter():
    """Families own their figures, options, formats and checks (Method hooks); bench/, training/, reporting/ and cli/
    neither import a family nor spell its name or a parameter of its own; the paper's configurations live in
    reporting/paper.py alone."""
    names = {cls.name for cls in REGISTRY.values() if cls.name != "autoregressive"}
    parameters = {f.name for cls in REGISTRY.values() for f in fields(cls.Params)} - {"width"}  # every table's axis
    families = {cls.__module__.split(".")[1] for cls in REGISTRY.values()} - {"autoregressive"}
    for layer in ("bench", "training", "reporting", "cli"):
        for path in sorted((ROOT / "harness" / layer).glob("*.py")):
            if path.name == "paper.py":
                continue
            strings, modules = _named(path)
            assert not strings & ({"pipeline", "draft"} | names | parameters) - OWN_WORDS.get(path.name, set()), path
            assert not {m for m in modules if m.split(".")[:2] in [["methods", f] for f in families]}, path

"""Sweep grids: expansion over each method's own parameters, PPSD's single schedule, the paper preset."""

import pytest

from harness.bench.sweep import grid
from harness.reporting.paper import paper_grid
from harness.runtime.errors import HarnessError


def test_grid_expands_each_methods_own_parameters_and_skips_schedules_a_method_lacks():
    points = grid(["spd", "ppsd", "eagle3"], {"n": [4, 8], "ls": [1], "schedule": ["input", "output"], "m": [3]},
                  [0.0, 1.0], [1, 4])
    labels = {p.label() for p in points}
    assert len([p for p in points if p.method == "spd"]) == 2 * 2 * 2 * 2  # n x schedule x T x width
    assert len([p for p in points if p.method == "ppsd"]) == 2 * 2 * 2  # output schedule only
    assert "eagle3 m=3 width=4 T=1" in labels and not any("eagle3 ls" in label for label in labels)
    assert points[0].run_command().startswith("spd-bench run --method spd --ls 1 --n 4 --schedule input --width 1")
    truncated = grid(["eagle3"], {"m": [3]}, [0.0, 1.0], [1], truncation=(50, 0.95))
    assert [(p.temperature, p.top_k, p.top_p) for p in truncated] == [(0.0, 0, 1.0), (1.0, 50, 0.95)]


def test_bad_values_are_an_error_not_a_silent_drop():
    with pytest.raises(HarnessError, match="n must be >= 1"):
        grid(["spd"], {"n": [0]}, [0.0], [1])


def test_paper_preset():
    points = paper_grid()
    assert len(points) == len(set(points)) == 19 * 2 * 2
    spd = {(p.param_dict["n"], p.param_dict["ls"]) for p in points if p.method == "spd" and
           p.param_dict["schedule"] == "input"}
    assert spd == {(n, ls) for n in (4, 8, 16) for ls in (1, 2, 3, 4)}
    assert {p.param_dict["m"] for p in points if p.method == "eagle3"} == {3, 7, 15}
    assert {p.param_dict["n"] for p in points if p.method == "ppsd"} == {4, 8, 16}
    assert {(p.temperature, p.param_dict["width"]) for p in points} == {(0, 1), (0, 4), (1, 1), (1, 4)}
    # T=1 samples as the reference does: top-k 50 within top-p 0.95 (records carry both), T=0 is plain greedy
    assert {(p.temperature, p.top_k, p.top_p) for p in points} == {(0, 0, 1.0), (1, 50, 0.95)}
    sampled = next(p for p in points if p.temperature == 1)
    assert sampled.run_command().endswith("--temperature 1 --top-k 50 --top-p 0.95")

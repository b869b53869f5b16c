"""The paper's evaluation grid (`spd-bench sweep --preset paper`) and its published reference numbers, which the
report prints beside ours wherever model and configuration match."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from harness.bench.sweep import GridPoint
from methods.sampling import NO_TRUNCATION

MEAN = "mean"


def paper_grid() -> list[GridPoint]:
    """EAGLE-3 m in {3, 7, 15}; PPSD n in {4, 8, 16}; SPD n in {4, 8, 16} x Ls in {1..4} (input schedule) plus the
    output-state ablation at n=16, Ls=4; each at T in {0, 1} (T=1 with the reference's top-k and top-p) and draft
    width in {1, 4}."""
    configs = [("eagle3", {"m": m}) for m in (3, 7, 15)]
    configs += [("ppsd", {"n": n, "ls": 1, "schedule": "output"}) for n in (4, 8, 16)]
    configs += [("spd", {"n": n, "ls": ls, "schedule": "input"}) for n in (4, 8, 16) for ls in (1, 2, 3, 4)]
    configs += [("spd", {"n": 16, "ls": 4, "schedule": "output"})]
    return [replace(GridPoint.of(method, t, **params, width=w), **(PAPER_SAMPLING if t > 0 else {}))
            for t in (0, 1) for w in (1, 4) for method, params in configs]


# The reference samples at T=1 from the top 50 tokens within top-p 0.95, on target and drafter alike (the verifiers
# compare the truncated distributions, so decoding stays lossless with respect to the truncated target).
PAPER_SAMPLING = {"top_k": 50, "top_p": 0.95}


def paper_truncation(temperature: float) -> tuple[int, float]:
    """The (top-k, top-p) of the paper's runs at a temperature."""
    return (PAPER_SAMPLING["top_k"], PAPER_SAMPLING["top_p"]) if temperature > 0 else NO_TRUNCATION


@dataclass(frozen=True)
class Reference:
    """A number the paper reports, for a model, configuration, dataset (or the mean over the three) and metric."""

    model: str  # matched against our model's name, ignoring case and punctuation
    method: str
    params: dict = field(hash=False)
    temperature: float
    dataset: str
    metric: str  # a Summary property: l_acc, theoretical_speedup, reference_theoretical, wall_clock_speedup
    value: float
    source: str

    def matches_model(self, name: str) -> bool:
        return _norm(self.model) in _norm(name)


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


MAIN = "paper, main table (4B, mean of MT-Bench/GSM8K/HumanEval)"


def _chain(method: str, **params) -> dict:
    defaults = {"ls": 1, "schedule": "output"} if method == "ppsd" else {"schedule": "input"} if method == "spd" else {}
    return {**defaults, **params, "width": 1}


# The reference repository's BENCHMARK_RESULTS (v11, width 1, 80 prompts per dataset, 512 tokens), per model,
# configuration and temperature: (theoretical, wall-clock on n+1 GPUs vs one-GPU AR).
REPO_ROWS = (
    ("Qwen3.5-4B", "eagle3", _chain("eagle3", m=3), 0, 2.47, 1.88),
    ("Qwen3.5-4B", "eagle3", _chain("eagle3", m=7), 0, 2.72, 1.97),
    ("Qwen3.5-4B", "eagle3", _chain("eagle3", m=15), 0, 2.39, 1.62),
    ("Qwen3.5-4B", "ppsd", _chain("ppsd", n=4), 0, 1.54, 1.28),
    ("Qwen3.5-4B", "ppsd", _chain("ppsd", n=8), 0, 1.68, 1.25),
    ("Qwen3.5-4B", "ppsd", _chain("ppsd", n=16), 0, 1.40, 0.89),
    ("Qwen3.5-4B", "spd", _chain("spd", n=4, ls=4), 0, 2.64, 2.27),
    ("Qwen3.5-4B", "spd", _chain("spd", n=8, ls=4), 0, 3.51, 2.41),
    ("Qwen3.5-4B", "spd", _chain("spd", n=8, ls=3), 0, 3.39, 2.53),
    ("Qwen3.5-4B", "spd", _chain("spd", n=8, ls=2), 0, 3.32, 2.47),
    ("Qwen3.5-4B", "spd", _chain("spd", n=16, ls=2), 0, 3.70, 1.43),
    ("Qwen3.5-4B", "eagle3", _chain("eagle3", m=7), 1, 2.06, 1.46),
    ("Qwen3.5-4B", "ppsd", _chain("ppsd", n=8), 1, 1.44, 0.95),
    ("Qwen3.5-4B", "spd", _chain("spd", n=4, ls=4), 1, 2.48, 1.95),
    ("Qwen3.5-4B", "spd", _chain("spd", n=8, ls=3), 1, 3.05, 2.05),
    ("Qwen3.5-9B", "eagle3", _chain("eagle3", m=7), 0, 3.17, 2.54),
    ("Qwen3.5-9B", "spd", _chain("spd", n=8, ls=3), 0, 3.61, 2.67),
    ("Qwen3.5-9B", "spd", _chain("spd", n=4, ls=4), 0, 2.70, 2.32),
)
REPO = ("paper's reference code v11 (T=0 overall; pipeline theoretical = its n * N / S per-sample mean; wall-clock "
        "on n+1 GPUs vs one-GPU AR)")
REPO_T1 = "paper's reference code v11 (T=1 with top-k 50, top-p 0.95; otherwise as at T=0)"
REFERENCES = (
    Reference("Qwen3.5-4B", "spd", {"n": 8, "ls": 4, "schedule": "input", "width": 4}, 1, MEAN, "l_acc", 3.43, MAIN),
    Reference("Qwen3.5-4B", "eagle3", {"m": 7, "width": 4}, 1, MEAN, "theoretical_speedup", 2.79, MAIN),
    Reference("Qwen3.5-4B", "ppsd", {"n": 8, "ls": 1, "schedule": "output", "width": 4},
              1, MEAN, "theoretical_speedup", 1.67, MAIN),
    Reference("Qwen3.5-4B", "eagle3", {"m": 7, "width": 4}, 0, MEAN, "theoretical_speedup", 3.61, MAIN),
    Reference("Qwen3.5-4B", "spd", {"n": 8, "ls": 4, "schedule": "input", "width": 4}, 0, MEAN, "l_acc", 2.91, MAIN),
    Reference("Qwen3.5-9B", "spd", {"n": 8, "ls": 4, "schedule": "input", "width": 4},
              1, "humaneval", "l_acc", 5.97, "paper, 9B HumanEval"),
    Reference("Qwen3.5-4B", "eagle3", {"m": 7, "width": 1},
              0, MEAN, "theoretical_speedup", 2.72, "paper, EAGLE-3 over m"),
    Reference("Qwen3.5-4B", "eagle3", {"m": 15, "width": 1},
              0, MEAN, "theoretical_speedup", 2.39, "paper, EAGLE-3 over m"),
    Reference("Qwen3.5-4B", "spd", {"n": 16, "ls": 4, "schedule": "output", "width": 4},
              1, MEAN, "l_acc", 4.78, "paper, ablation (raw acceptance)"),
    Reference("Qwen3.5-4B", "spd", {"n": 16, "ls": 4, "schedule": "output", "width": 4},
              1, MEAN, "theoretical_speedup", 2.39, "paper, ablation"),
    Reference("Qwen3.5-4B", "spd", {"n": 16, "ls": 4, "schedule": "input", "width": 4},
              1, MEAN, "theoretical_speedup", 3.44, "paper, ablation"),
    *(entry for model, method, params, t, theoretical, wall in REPO_ROWS for entry in (
        Reference(model, method, params, t, "overall",
                  "theoretical_speedup" if method == "eagle3" else "reference_theoretical", theoretical,
                  REPO if t == 0 else REPO_T1),
        Reference(model, method, params, t, "overall", "wall_clock_speedup", wall, REPO if t == 0 else REPO_T1))),
)

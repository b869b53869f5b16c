"""The paper's qualitative claims, each checked against the records: what was measured and whether it agrees.

A claim compares configurations pooled over datasets at width 1, per model, at the paper's sampling (T=1: top-k 50,
top-p 0.95), measured the same way where it can (all executed, else all simulated). Its verdict is "agrees",
"disagrees", "mixed" (some comparisons each way) or "not measured" with the runs that would measure it; the figures
compared are printed beside it either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from harness.reporting.metrics import OVERALL, Summary, find
from harness.reporting.paper import paper_truncation

Comparison = tuple[str, bool]  # what was compared (figures), and whether it went the claimed way


@dataclass(frozen=True)
class Claim:
    text: str
    compare: Callable[[list[Summary], str], list[Comparison]]  # (summaries, model) -> comparisons found
    measure: str  # the runs that measure it


@dataclass
class Verdict:
    claim: str
    model: str
    measured: str
    verdict: str


def _value(s: Summary, metric: str) -> str:
    return f"{getattr(s, metric):.2f}" + (" (sim)" if s.simulated else "")


def _spd(n: int, ls: int, schedule: str) -> dict:
    return {"n": n, "ls": ls, "schedule": schedule, "width": 1}


def _pair(summaries: list[Summary], model: str, method: str, params: tuple[dict, dict], temperature: float
          ) -> tuple[Summary | None, Summary | None]:
    """Two configurations measured the same way: both executed, else both simulated (same prompt budget), else
    whatever each has."""
    truncation = paper_truncation(temperature)
    for simulated in (False, True):
        first, second = (find(summaries, method, p, temperature, model=model, simulated=simulated,
                              truncation=truncation) for p in params)
        if first and second:
            return first, second
    first, second = (find(summaries, method, p, temperature, model=model, truncation=truncation) for p in params)
    return first, second


def _lacc_rises_with_n(summaries: list[Summary], model: str) -> list[Comparison]:
    out = []
    for ls in (1, 2, 3, 4):
        four, eight = _pair(summaries, model, "spd", (_spd(4, ls, "input"), _spd(8, ls, "input")), 0.0)
        if four and eight and four.l_acc is not None and eight.l_acc is not None:
            out.append((f"Ls={ls}: n=4 {_value(four, 'l_acc')} -> n=8 {_value(eight, 'l_acc')}",
                        eight.l_acc > four.l_acc))
    return out


def _output_schedule_tradeoff(summaries: list[Summary], model: str) -> list[Comparison]:
    out = []
    for n in (4, 8, 16):
        for ls in (1, 2, 3, 4):
            inp, outp = _pair(summaries, model, "spd", (_spd(n, ls, "input"), _spd(n, ls, "output")), 0.0)
            if inp and outp and None not in (inp.tokens_per_step, outp.tokens_per_step):
                out.append((f"n={n} Ls={ls}: alpha input {_value(inp, 'tokens_per_step')} / output "
                            f"{_value(outp, 'tokens_per_step')}, theoretical input "
                            f"{_value(inp, 'theoretical_speedup')}x / output {_value(outp, 'theoretical_speedup')}x",
                            outp.tokens_per_step > inp.tokens_per_step
                            and outp.theoretical_speedup < inp.theoretical_speedup))
    return out


def _best(summaries: list[Summary], model: str, method: str, temperature: float, simulated: bool
          ) -> Summary | None:
    found = [s for s in summaries if s.model == model and s.dataset == OVERALL and s.method == method
             and s.temperature == temperature and s.truncation == paper_truncation(temperature) and s.width == 1
             and s.simulated == simulated and s.theoretical_speedup is not None]
    return max(found, key=lambda s: s.theoretical_speedup, default=None)


def _order_at_t1(summaries: list[Summary], model: str) -> list[Comparison]:
    for simulated in (False, True):  # all three executed, else all three simulated
        best = [(m, _best(summaries, model, m, 1.0, simulated)) for m in ("spd", "eagle3", "ppsd")]
        if all(s is not None for _, s in best):
            break
    else:
        return []
    text = " > ".join(f"{m} {' '.join(f'{k}={v}' for k, v in sorted(s.params.items()))} "
                      f"{_value(s, 'theoretical_speedup')}x" for m, s in best)
    speedups = [s.theoretical_speedup for _, s in best]
    return [(f"best of each: {text}", speedups[0] > speedups[1] > speedups[2])]


def _eagle_m7_over_m15(summaries: list[Summary], model: str) -> list[Comparison]:
    out = []
    for temperature in (0.0, 1.0):
        seven, fifteen = _pair(summaries, model, "eagle3", ({"m": 7, "width": 1}, {"m": 15, "width": 1}), temperature)
        if seven and fifteen:
            out.append((f"T={temperature:g}: m=7 {_value(seven, 'theoretical_speedup')}x, m=15 "
                        f"{_value(fifteen, 'theoretical_speedup')}x",
                        seven.theoretical_speedup > fifteen.theoretical_speedup))
    return out


CLAIMS = (
    Claim("L'acc rises from n=4 to n=8 (SPD, input schedule, T=0)", _lacc_rises_with_n,
          "spd-bench sweep --method spd --n 4,8 --ls 1,2,3,4 --temperature 0"),
    Claim("The output schedule has higher alpha but lower theoretical speedup than the input schedule (SPD, T=0)",
          _output_schedule_tradeoff, "spd-bench sweep --method spd --n 8 --ls 4 --schedule input,output"),
    Claim("At T=1: SPD > EAGLE-3 > PPSD (theoretical speedup, best configuration of each)", _order_at_t1,
          "spd-bench sweep --method spd,eagle3,ppsd --temperature 1 --top-k 50 --top-p 0.95"),
    Claim("EAGLE-3 m=7 beats m=15 (theoretical speedup)", _eagle_m7_over_m15,
          "spd-bench sweep --method eagle3 --m 7,15"),
)


def verdicts(summaries: list[Summary]) -> list[Verdict]:
    """Every claim on every model with records (a claim with no records on any model is listed once)."""
    models = sorted({s.model for s in summaries}) or ["—"]
    out = []
    for claim in CLAIMS:
        for model in models:
            comparisons = claim.compare(summaries, model)
            if not comparisons:
                out.append(Verdict(claim.text, model, f"not measured: `{claim.measure}`", "not measured"))
                continue
            held = [ok for _, ok in comparisons]
            verdict = "agrees" if all(held) else "disagrees" if not any(held) else "mixed"
            out.append(Verdict(claim.text, model, "; ".join(text for text, _ in comparisons), verdict))
    return out

"""Pooled metrics over result records: sums per dataset and overall, never means of per-sample ratios."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

OVERALL = "overall"


@dataclass
class Summary:
    method: str
    params: dict
    model: str
    temperature: float
    dataset: str
    samples: int = 0
    new_tokens: int = 0
    steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    checked: int = 0
    identical: int = 0

    def add(self, row: dict) -> None:
        self.samples += 1
        self.new_tokens += row["new_tokens"]
        self.steps += row["steps"]
        self.prefill_s += row["timing"].get("prefill", 0.0)
        self.decode_s += row["timing"].get("decode", 0.0)
        self.checked += bool(row["lossless"].get("checked"))
        self.identical += bool(row["lossless"].get("identical"))

    @property
    def tokens_per_second(self) -> float | None:
        """Decode throughput: tokens produced after prefill over decode time."""
        return (self.new_tokens - self.samples) / self.decode_s if self.decode_s > 0 else None

    @property
    def tokens_per_step(self) -> float | None:
        return self.new_tokens / self.steps if self.steps else None

    @property
    def lossless_pct(self) -> float | None:
        return 100.0 * self.identical / self.checked if self.checked else None


def _group(row: dict) -> tuple:
    return row["config_key"], row["method"], row["model"]["name"], row["temperature"]


def summarize(rows: list[dict]) -> list[Summary]:
    """One Summary per (configuration, dataset) and one per configuration over all its datasets."""
    table: dict[tuple, Summary] = {}
    datasets_per_config: dict[tuple, set] = defaultdict(set)
    for row in rows:
        group = _group(row)
        datasets_per_config[group].add(row["dataset"])
        for dataset in (row["dataset"], OVERALL):
            key = (*group, dataset)
            if key not in table:
                table[key] = Summary(row["method"], row["params"], row["model"]["name"], row["temperature"], dataset)
            table[key].add(row)
    order = {OVERALL: "~"}  # overall sorts after the datasets of its configuration
    return sorted(table.values(), key=lambda s: (s.model, s.method, str(s.params), s.temperature, order.get(s.dataset, s.dataset)))

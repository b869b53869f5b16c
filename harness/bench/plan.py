"""The plan of a sweep: its work items, so that a cluster scheduler can run the grid.

A work item is one configuration of the grid, or with `per_dataset` one configuration on one dataset. Each has a
file-safe name, its own results file (<root>/<model>/<method>/<name>.jsonl, so jobs never share a file), the exact
`spd-bench run` command that does it, and a rough cost (prompts x tokens x its family's relative cost). The plan
orders items by cost, largest first, then by name: the order, and so every item's index, depends only on the set of
items, not on how the command line listed them. Shards take items largest first, each to the shard with the least
cost so far, so N jobs with the same options cover the grid exactly once and about evenly.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from harness.bench.config import RunConfig, drafter_fingerprint, load_prompts, validate
from harness.bench.runner import run_key, sample_keys
from harness.bench.sweep import GridPoint, recorded_samples
from harness.runtime.errors import HarnessError
from harness.runtime.models import load_identity, model_name
from methods.base import REGISTRY, parse_params
from methods.capabilities import Serves, sample_cost


@dataclass(frozen=True)
class WorkItem:
    point: GridPoint
    dataset: str | None = None  # None: every dataset of the sweep
    cost: float = 0.0

    @property
    def name(self) -> str:
        """Stable and file-safe: the configuration's parameters, sampling and (per dataset) the dataset."""
        parts = [f"{k}{v}" for k, v in self.point.params] + [f"T{self.point.temperature:g}"]
        if self.point.truncation != (0, 1.0):
            parts += [f"topk{self.point.top_k}", f"topp{self.point.top_p:g}"]
        parts += [self.dataset] if self.dataset else []
        raw = "-".join(parts)
        safe = re.sub(r"[^A-Za-z0-9._=+-]", "_", raw)
        # a value that had to be escaped (a draft model "org/name", say) keeps its item apart from "org_name"'s
        return safe if safe == raw else f"{safe}-{hashlib.sha256(raw.encode()).hexdigest()[:8]}"

    def label(self) -> str:
        return self.point.label() + (f" on {self.dataset}" if self.dataset else "")

    def config(self, base: RunConfig, root: Path) -> RunConfig:
        return replace(base, method=self.point.method, params=self.point.param_dict,
                       temperature=self.point.temperature, top_k=self.point.top_k, top_p=self.point.top_p,
                       datasets=(self.dataset,) if self.dataset else base.datasets, out=self.out(base, root))

    def out(self, base: RunConfig, root: Path) -> Path:
        turns = "" if base.turns == "first" else f"-turns-{base.turns}"
        return root / model_name(base.model).replace("/", "--") / self.point.method / f"{self.name}{turns}.jsonl"

    def command(self, base: RunConfig, root: Path) -> str:
        """The `spd-bench run` command line that does this item alone (the base options spelled out)."""
        c = self.config(base, root)
        words = ["spd-bench", "run", *shlex.split(self.point.run_command())[2:], "--model", c.model,
                 "--dataset", ",".join(c.datasets), "--max-new-tokens", str(c.max_new_tokens), "--seed", str(c.seed),
                 "--device", c.device]
        words += ["--limit", str(c.limit)] if c.limit is not None else []
        words += ["--dtype", c.dtype] if c.dtype else []
        words += ["--data-dir", c.data_dir] if c.data_dir else []
        words += ["--simulate"] if c.simulate else []
        words += ["--compile", c.compile] if c.compile != "off" else []
        words += ["--kernels", c.kernels] if c.kernels != "auto" else []
        words += ["--turns", c.turns] if c.turns != "first" else []
        return shlex.join([*words, "--out", str(c.out)])


def plan(points: list[GridPoint], base: RunConfig, per_dataset: bool = False) -> list[WorkItem]:
    """The work items of a sweep, largest cost first (ties by name): the stable order shards are cut from."""
    prompts: dict[str, int] = {}
    for sample in load_prompts(base):
        prompts[sample.dataset] = prompts.get(sample.dataset, 0) + 1
    items = []
    for point in set(points):
        cls = REGISTRY[point.method]
        params = parse_params(cls, point.param_dict)
        cost = cls.relative_cost(params, base.simulate) if issubclass(cls, Serves) else sample_cost(base.simulate)
        per_sample = cost * base.max_new_tokens
        for dataset in (sorted(prompts) if per_dataset else [None]):
            count = prompts[dataset] if dataset else sum(prompts.values())
            items.append(WorkItem(point, dataset, per_sample * count))
    items.sort(key=lambda item: (-item.cost, item.name, item.point.method))
    return items


def parse_shard(text: str) -> tuple[int, int]:
    """"I/N" with 1 <= I <= N."""
    index, sep, count = text.partition("/")
    if not (sep and index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise HarnessError(f"--shard {text!r} must look like I/N with 1 <= I <= N, e.g. --shard 2/8")
    return int(index), int(count)


def assign(items: list[WorkItem], count: int) -> list[int]:
    """Each item's shard (1-based) of `count`: in plan order, each goes to the least loaded shard so far (shards
    beyond the number of items get none, so only that many are tracked)."""
    used = min(count, len(items))
    loads, owners = [0.0] * used, []
    for item in items:
        lightest = min(range(used), key=lambda i: (loads[i], i))
        loads[lightest] += item.cost
        owners.append(lightest + 1)
    return owners


def shard(items: list[WorkItem], index: int, count: int) -> list[WorkItem]:
    """The items of shard `index` (1-based) of `count` (see `assign`)."""
    return [item for item, owner in zip(items, assign(items, count)) if owner == index]


def incomplete(items: list[WorkItem], base: RunConfig, root: Path) -> list[WorkItem]:
    """The items whose records under `root` (any file: a shard's, a one-process sweep's) do not yet hold every
    prompt, keyed as their runs would key them (the model's and drafters' weights included)."""
    identity = load_identity(base.model)
    recorded = recorded_samples(root)
    samples = load_prompts(base)
    found = []
    for item in items:
        config = item.config(base, root)
        validate(config)
        key = run_key(config, identity, torch.device(base.device).type, drafter_fingerprint(config, identity))
        if any(k not in recorded for s in samples if item.dataset in (None, s.dataset)
               for k in sample_keys(key, s, base.turns)):
            found.append(item)
    return found

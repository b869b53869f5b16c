"""`spd-bench parity`: the train/decode parity check of a pipeline drafter over benchmark prompts.

Per prompt, the greedy AR output is the trajectory; methods/pipeline/parity.py computes the drafter's top-1 through
the training layout, the decoding engine and the replay. This module runs that over prompts, prints one line per
fill level and appends one record to results/<model>/parity.jsonl.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from harness.bench.config import REFERENCE_METHOD, RunConfig, load_prompts, validate
from harness.bench.data import render_prompt
from harness.bench.runner import Runner
from harness.runtime.errors import HarnessError
from harness.runtime.models import load_model
from harness.runtime.results import ResultStore
from methods.pipeline.parity import Parity, compare
from methods.pipeline.scheduler import PipelineEngine


def check(config: RunConfig, root: Path = Path("results")) -> Parity:
    """Parity of the configuration's drafter over its prompts (T=0, width 1); records it under `root`."""
    validate(config)
    if config.params.get("width", 1) != 1 or not config.sampling().greedy:
        raise HarnessError("parity compares chains at T=0: drop --width and --temperature")
    samples = load_prompts(config)
    loaded = load_model(config.model, config.device, config.dtype)
    runner = Runner(config, loaded)
    prompts = [render_prompt(loaded.tokenizer, s.prompt) for s in samples]
    method = runner.load_method(config.method, config.params, prompts)
    engine = getattr(method, "engine", None)
    if not isinstance(engine, PipelineEngine):
        raise HarnessError(f"method {config.method} has no pipeline drafter; parity checks spd and ppsd")
    reference = runner.load_method(REFERENCE_METHOD, {}, prompts)
    found = []
    for prompt in tqdm(prompts, desc=f"parity {config.method}", unit="prompt", dynamic_ncols=True):
        with torch.inference_mode():
            trajectory = runner.greedy_reference(prompt, reference)
        found.append(compare(engine, prompt, trajectory, config.max_new_tokens))
    parity = found[0]
    for other in found[1:]:
        parity.add(other)
    _record(root, loaded.identity, config, runner, parity)
    return parity


def table(parity: Parity) -> str:
    """One line per fill level: decoding's states and hits beside the training layout's on the same states."""
    from tabulate import tabulate

    rows = [(fill, f.states, f.disagree, f.ties, _rate(f.decode_hits, f.states), _rate(f.train_hits, f.states), "|",
             f.all_states, _rate(f.all_train_hits, f.all_states), f.replay_disagree)
            for fill, f in enumerate(parity.fills)]
    lines = [tabulate(rows, headers=["fill", "states", "disagree", "ties", "decode_acc", "train_acc", "|",
                                     "all_states", "train_acc_all", "replay_disagree"], disable_numparse=True)]
    for m in parity.mismatches[:10]:
        lines.append(f"mismatch at position {m['position']} fill {m['fill']}: decode {m['decode']} train {m['train']} "
                     f"(decode margin {m['margin']})")
    if not parity.lossless:
        lines.append("the engine's output differs from greedy AR: the comparison covers its own trajectory only")
    return "\n".join(lines)


def _rate(hits: int, total: int) -> str:
    return f"{hits / total:.3f}" if total else "—"


def _record(root: Path, identity, config: RunConfig, runner: Runner, parity: Parity) -> None:
    store = ResultStore(root / identity.name.replace("/", "--") / "parity.jsonl")
    store.append({"kind": "parity", "config_key": runner.key, "method": config.method, "params": config.params,
                  "model": identity.to_dict(), "datasets": list(config.datasets), "limit": config.limit,
                  "max_new_tokens": config.max_new_tokens, "drafter": runner.drafter,
                  "fills": [asdict(f) for f in parity.fills], "mismatches": parity.mismatches,
                  "lossless": parity.lossless, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})

"""`spd-bench parity`: the train/decode parity check of a drafter over benchmark prompts.

Per prompt, the greedy AR output is the trajectory; the method's family compares its drafter's predictions on it
through the training layout and through decoding (`ChecksParity.parity`, for the families that declare it). This module
runs that over prompts, pools the figures and appends one record to results/<model>/parity.jsonl.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from harness.bench.config import REFERENCE_METHOD, RunConfig, load_prompts, validate
from harness.bench.data import render_prompt
from harness.bench.runner import Runner
from harness.runtime.errors import HarnessError
from harness.runtime.models import load_model
from harness.runtime.results import ResultStore
from methods.base import REGISTRY
from methods.capabilities import ChecksParity, ParityCheck


def parity_methods() -> list[str]:
    return [name for name, cls in REGISTRY.items() if issubclass(cls, ChecksParity)]


def check(config: RunConfig, root: Path = Path("results")) -> ParityCheck:
    """Parity of the configuration's drafter over its prompts (T=0, width 1); records it under `root`."""
    validate(config)
    if not issubclass(REGISTRY[config.method], ChecksParity):
        raise HarnessError(f"method {config.method} has no parity check; --method takes {', '.join(parity_methods())}")
    if config.params.get("width", 1) != 1 or not config.sampling().greedy:
        raise HarnessError("parity compares chains at T=0: drop --width and --temperature")
    samples = load_prompts(config)
    loaded = load_model(config.model, config.device, config.dtype)
    runner = Runner(config, loaded)
    prompts = [render_prompt(loaded.tokenizer, s.prompt) for s in samples]
    method = runner.load_method(config.method, config.params, max(map(len, prompts)))
    reference = runner.load_method(REFERENCE_METHOD, {}, max(map(len, prompts)))
    found = []
    for prompt in tqdm(prompts, desc=f"parity {config.method}", unit="prompt", dynamic_ncols=True):
        with torch.inference_mode():
            trajectory = runner.greedy_reference(prompt, reference)
        found.append(method.parity(prompt, trajectory, config.max_new_tokens))
    parity = found[0]
    for other in found[1:]:
        parity.add(other)
    _record(root, loaded.identity, config, runner, parity)
    return parity


def _record(root: Path, identity, config: RunConfig, runner: Runner, parity: ParityCheck) -> None:
    store = ResultStore(root / identity.name.replace("/", "--") / "parity.jsonl")
    store.append({"kind": "parity", "config_key": runner.key, "method": config.method, "params": config.params,
                  "model": identity.to_dict(), "datasets": list(config.datasets), "limit": config.limit,
                  "max_new_tokens": config.max_new_tokens, "drafter": runner.drafter, **parity.record(),
                  "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})

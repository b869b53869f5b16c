"""Validation the way decoding counts: a drafter's acceptance replayed on the target's own greedy continuations.

Teacher-forced top-1 on corpus text scores the drafter on human-written contexts at every position, while decoding
feeds it the target's own output and verifies only the drafts the pipeline or round reaches (after a rejection,
fill level 0; after accepts, deeper fills). So the trainer also decodes a few held-out prompts greedily once (cached
with the losslessness references), keeps their teacher-forced states and, at every validation, replays each
drafter's cycles or rounds on them (the exact replay that `--simulate` uses): per-fill (or per-step) acceptance,
tokens per step and the pooled acceptance rate, counted as `spd-bench report` counts executed runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.runtime.lossless import ReferenceCache
from harness.runtime.models import LoadedModel
from harness.runtime.target import TargetRuntime
from harness.training.corpus import prompt_ids
from methods.autoregressive import Autoregressive
from methods.base import Generation
from methods.sampling import Sampler, SamplingConfig
from methods.teacher import Teacher


@dataclass
class Trajectories:
    """Teacher-forced passes over held-out prompts plus their greedy continuations."""

    teachers: list[Teacher]
    new_tokens: int
    stop_ids: set[int]


def first_turns(loaded: LoadedModel, convs: list[list[dict]], count: int, max_prompt: int) -> list[list[int]]:
    """Up to `count` first user turns (with the generation prompt) of at most `max_prompt` tokens."""
    prompts = []
    for messages in convs:
        if len(prompts) >= count:
            break
        ids = prompt_ids(loaded.tokenizer, messages[:1])
        if len(ids) <= max_prompt:
            prompts.append(ids)
    return prompts


def greedy_trajectories(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int, capture: tuple[int, ...],
                        stop_ids: set[int]) -> Trajectories:
    """The target's greedy continuation of each prompt (from the reference cache when there) and its states."""
    target = TargetRuntime(loaded.model, max_len=max(len(p) for p in prompts) + new_tokens + 8,
                           identity=loaded.identity)
    references = ReferenceCache(loaded, str(loaded.dtype).removeprefix("torch."), stop_ids, target.numerics())
    ar, greedy = Autoregressive(target, None, stop_ids), Sampler(SamplingConfig())
    teachers = []
    with torch.inference_mode():
        for prompt in prompts:
            trajectory = references.get(prompt, new_tokens)
            if trajectory is None:
                trajectory = ar.generate(prompt, new_tokens, greedy).output_ids
                references.put(prompt, new_tokens, trajectory)
            teacher = Teacher.run(target, prompt, trajectory, capture, greedy)
            teacher.features = {layer: h.float() for layer, h in teacher.features.items()}  # drafters train in fp32
            teachers.append(teacher)
    return Trajectories(teachers, new_tokens, stop_ids)


def decoding_figures(spec, module, trajectories: Trajectories) -> dict:
    """The drafter's replayed decoding, pooled over the trajectories as the report pools runs."""
    with torch.no_grad():
        runs: list[Generation] = [spec.replay(module, t, trajectories.new_tokens, trajectories.stop_ids)
                                  for t in trajectories.teachers]
    new_tokens, steps = sum(len(r.output_ids) for r in runs), sum(r.steps for r in runs)
    accepts = [sum(v) for v in zip(*(r.position_accepts for r in runs))]
    drafts = [sum(v) for v in zip(*(r.stats.drafts(r.steps, len(r.position_accepts)) for r in runs))]
    return {
        f"accept_by_{spec.group_name}": [round(a / d, 4) if d else None for a, d in zip(accepts, drafts)],
        f"drafts_by_{spec.group_name}": drafts,
        "acceptance": round(sum(accepts) / max(1, sum(drafts)), 4),
        "tokens_per_step": round(new_tokens / max(1, steps), 4),
        "prompts": len(runs),
        "new_tokens": new_tokens,
    }

"""`spd-bench bench lookup`: prompt lookup as users run it today (HF `generate(prompt_lookup_num_tokens=k)`) beside
the harness's, both beside greedy decoding, on the same prompts, model and dtype, paired prompt by prompt."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from harness.bench.data import load_samples, render_prompt
from harness.bench.speed_ar import timed
from harness.runtime.models import load_model, stop_ids
from harness.runtime.provenance import versions
from harness.runtime.results import ResultStore, config_key
from harness.runtime.target import TargetRuntime
from methods.base import build_method
from methods.sampling import Sampler, SamplingConfig

# The sides of one pair, in the order the first prompt runs them (each next prompt rotates it by one, so no side
# always runs first on a cold cache or last on a warm one).
SIDES = ("hf-greedy", "hf-lookup", "ar", "lookup")


@dataclass
class LookupBench:
    kind: str
    model: dict
    dtype: str
    device: str
    datasets: list[str]
    max_new_tokens: int
    k: int  # HF's prompt_lookup_num_tokens and the harness lookup's most drafts per round
    params: dict  # the harness lookup's parameters
    prompts: list[str]  # "dataset/index" of each pair
    seconds: dict[str, list[float]]  # side -> decode-and-prefill seconds per prompt (index as `prompts`)
    tokens: list[int]  # generated per prompt (the same for every side when identical)
    identical: bool  # every side produced greedy AR's tokens on every prompt
    steps: dict[str, list[int]] = field(default_factory=dict)  # harness sides: target forwards per prompt
    versions: dict = field(default_factory=dict)
    config_key: str = ""


def bench_lookup(model: str, datasets: list[str], prompts: int, max_new_tokens: int, params: dict, device: str,
                 dtype: str | None, data_dir: str | None) -> LookupBench:
    loaded = load_model(model, device, dtype)
    reference = load_model(model, device, dtype)  # HF generate runs on an untouched copy, as a user would load it
    samples = [(name, i, s) for name in datasets for i, s in enumerate(load_samples(name, data_dir, prompts))]
    prompt_ids = [render_prompt(loaded.tokenizer, s.prompt) for _, _, s in samples]
    target = TargetRuntime(loaded.model, max_len=max(map(len, prompt_ids)) + max_new_tokens + 8)
    stops = sorted(stop_ids(loaded))
    greedy = Sampler(SamplingConfig())
    ours = {"ar": build_method("autoregressive", target, {}, set(stops)),
            "lookup": build_method("lookup", target, params, set(stops))}
    k = ours["lookup"].params.k

    def hf(ids, **extra):
        out = reference.model.generate(torch.tensor([ids], device=loaded.device), max_new_tokens=max_new_tokens,
                                       do_sample=False, eos_token_id=stops, pad_token_id=stops[0], **extra)
        return out[0, len(ids):].tolist(), None

    def harness(name, ids):
        generation = ours[name].generate(ids, max_new_tokens, greedy)
        return generation.output_ids, generation.steps

    sides = {"hf-greedy": hf, "hf-lookup": lambda ids: hf(ids, prompt_lookup_num_tokens=k),
             "ar": lambda ids: harness("ar", ids), "lookup": lambda ids: harness("lookup", ids)}
    seconds = {side: [] for side in SIDES}
    steps = {"ar": [], "lookup": []}
    tokens, identical = [], True
    with torch.inference_mode():
        for side in SIDES:  # warm-up every path
            sides[side](prompt_ids[0][:16])
        for i, ids in enumerate(tqdm(prompt_ids, desc="bench lookup vs hf prompt lookup", unit="prompt")):
            outputs = {}
            for side in SIDES[i % len(SIDES):] + SIDES[: i % len(SIDES)]:
                elapsed, (outputs[side], forwards) = timed(sides[side], ids)
                seconds[side].append(elapsed)
                if forwards is not None:
                    steps[side].append(forwards)
            identical &= all(out == outputs["hf-greedy"] for out in outputs.values())
            tokens.append(len(outputs["hf-greedy"]))
    spec = {"kind": "bench-lookup", "model": loaded.identity.to_dict(), "datasets": datasets, "prompts": prompts,
            "max_new_tokens": max_new_tokens, "params": params, "dtype": str(loaded.dtype),
            "device": loaded.device.type}
    return LookupBench(
        kind="bench-lookup", model=loaded.identity.to_dict(), dtype=str(loaded.dtype).removeprefix("torch."),
        device=loaded.device.type, datasets=datasets, max_new_tokens=max_new_tokens, k=k,
        params=asdict(ours["lookup"].params), prompts=[f"{name}/{i}" for name, i, _ in samples], seconds=seconds,
        tokens=tokens, identical=identical, steps=steps, versions=versions(), config_key=config_key(spec),
    )


def save(result: LookupBench, path) -> None:
    ResultStore(path).append(asdict(result))

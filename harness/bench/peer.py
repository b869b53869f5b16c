"""`spd-bench bench peer`: a method as users run it today in HF `generate` (its `hf_peer` arguments) beside the
harness's implementation, both beside greedy decoding, on the same prompts, model and dtype, paired prompt by
prompt."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from harness.bench.config import REFERENCE_METHOD, RunConfig, validate
from harness.bench.data import load_samples, render_prompt
from harness.bench.speed_ar import hf_generate, timed
from harness.runtime.compiled import warm
from harness.runtime.errors import HarnessError
from harness.runtime.models import load_model, stop_ids
from harness.runtime.provenance import versions
from harness.runtime.results import ResultStore, config_key
from harness.runtime.target import TargetRuntime
from methods.base import REGISTRY, build_method
from methods.capabilities import HFPeer
from methods.sampling import Sampler, SamplingConfig

# The sides of one pair, in the order the first prompt runs them (each next prompt rotates it by one, so no side
# always runs first on a cold cache or last on a warm one): HF greedy, HF's implementation of the method, the
# harness's greedy decode and the harness's method.
SIDES = ("hf-greedy", "hf-peer", "reference", "method")


@dataclass
class PeerBench:
    kind: str
    method: str
    model: dict
    dtype: str
    device: str
    datasets: list[str]
    max_new_tokens: int
    params: dict  # the harness method's parameters
    hf_peer: dict  # the keyword arguments HF generate ran the method with
    prompts: list[str]  # "dataset/index" of each pair
    seconds: dict[str, list[float]]  # side -> prefill-and-decode seconds per prompt (index as `prompts`)
    tokens: list[int]  # generated per prompt (the same for every side when identical)
    identical: bool  # every side produced greedy decoding's tokens on every prompt
    steps: dict[str, list[int]] = field(default_factory=dict)  # harness sides: target forwards per prompt
    versions: dict = field(default_factory=dict)
    config_key: str = ""
    engine: dict | None = None  # how the harness's target ran (TargetRuntime.engine: kernels, compiled step)


def peers() -> list[str]:
    """Methods HF generate also implements."""
    return [name for name, cls in REGISTRY.items() if issubclass(cls, HFPeer) and cls.hf_peer(cls.Params()) is not None]


def bench_peer(method: str, model: str, datasets: list[str], prompts: int, max_new_tokens: int, params: dict,
               device: str, dtype: str | None, data_dir: str | None, compile: str = "off") -> PeerBench:
    if method not in peers():
        raise HarnessError(f"HF generate implements no {method!r}; bench peer takes {', '.join(peers())}")
    validate(RunConfig(method=method, params=dict(params), model=model, device=device, dtype=dtype))  # before loading
    loaded = load_model(model, device, dtype)
    reference = load_model(model, device, dtype)  # HF generate runs on an untouched copy, as a user would load it
    samples = [(name, i, s) for name in datasets for i, s in enumerate(load_samples(name, data_dir, prompts))]
    prompt_ids = [render_prompt(loaded.tokenizer, s.prompt) for _, _, s in samples]
    target = TargetRuntime(loaded.model, max_len=max(map(len, prompt_ids)) + max_new_tokens + 8, compile=compile)
    stops = sorted(stop_ids(loaded))
    greedy = Sampler(SamplingConfig())
    ours = {"reference": build_method(REFERENCE_METHOD, target, {}, set(stops)),
            "method": build_method(method, target, params, set(stops))}
    hf_peer = ours["method"].hf_peer(ours["method"].params)

    def hf(ids, **options):
        return hf_generate(reference.model, ids, max_new_tokens, stops, **options), None

    def harness(side, ids):
        generation = ours[side].generate(ids, max_new_tokens, greedy)
        return generation.output_ids, generation.steps

    sides = {"hf-greedy": hf, "hf-peer": lambda ids: hf(ids, **hf_peer),
             "reference": lambda ids: harness("reference", ids), "method": lambda ids: harness("method", ids)}
    seconds = {side: [] for side in SIDES}
    steps = {"reference": [], "method": []}
    tokens, identical = [], True
    with torch.inference_mode():
        for side in SIDES:  # warm-up every path
            sides[side](prompt_ids[0][:16])
        for i, ids in enumerate(tqdm(prompt_ids, desc=f"bench peer: {method} vs HF generate's", unit="prompt")):
            outputs = {}
            for side in SIDES[i % len(SIDES):] + SIDES[: i % len(SIDES)]:
                elapsed, (outputs[side], forwards) = warm(target.compiled, lambda: timed(sides[side], ids))
                seconds[side].append(elapsed)
                if forwards is not None:
                    steps[side].append(forwards)
            identical &= all(out == outputs["hf-greedy"] for out in outputs.values())
            tokens.append(len(outputs["hf-greedy"]))
    spec = {"kind": "bench-peer", "method": method, "model": loaded.identity.to_dict(), "datasets": datasets,
            "prompts": prompts, "max_new_tokens": max_new_tokens, "params": params, "dtype": str(loaded.dtype),
            "device": loaded.device.type, **({"compile": compile} if compile != "off" else {})}
    return PeerBench(
        kind="bench-peer", method=method, model=loaded.identity.to_dict(),
        dtype=str(loaded.dtype).removeprefix("torch."), device=loaded.device.type, datasets=datasets,
        max_new_tokens=max_new_tokens, params=asdict(ours["method"].params), hf_peer=hf_peer,
        prompts=[f"{name}/{i}" for name, i, _ in samples], seconds=seconds, tokens=tokens, identical=identical,
        steps=steps, versions=versions(), config_key=config_key(spec), engine=target.engine(),
    )


def save(result: PeerBench, path) -> None:
    ResultStore(path).append(asdict(result))

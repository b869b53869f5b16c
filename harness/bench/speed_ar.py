"""`spd-bench bench ar`: the harness's AR decode against HF `generate` on the same prompts, model and dtype."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from harness.bench.data import load_samples, render_prompt
from harness.runtime.models import load_model, stop_ids
from harness.runtime.provenance import versions
from harness.runtime.results import ResultStore, config_key
from harness.runtime.target import TargetRuntime
from methods.base import build_method
from methods.sampling import Sampler, SamplingConfig


@dataclass
class BenchResult:
    kind: str
    model: dict
    dtype: str
    device: str
    dataset: str
    prompts: int
    repeats: int
    max_new_tokens: int
    ours_seconds: list[float]
    hf_seconds: list[float]
    ratios: list[float]  # HF time / our time for the same prompt and tokens; > 1 means ours is faster
    median_ratio: float
    identical: bool
    tokens: int  # generated per prompt and repeat, summed (the same for both sides when identical)
    weights_bytes: int  # every parameter the decode step reads once
    read_gb_s: float  # this machine's measured read bandwidth (a sum over a weights-sized buffer)
    floor_tok_s: float  # read_gb_s / weights: the tokens/s a decode step bound by reading its weights reaches
    ours_tok_s: float
    hf_tok_s: float
    versions: dict
    config_key: str
    engine: dict | None = None  # how the harness's target ran (TargetRuntime.engine: kernels, compiled step)


def read_bandwidth(size_bytes: int, device: torch.device, repeats: int = 5) -> float:
    """Bytes/s read by a sum over a buffer of `size_bytes` (the best of `repeats`: the machine's reachable rate)."""
    buffer = torch.ones(max(1, size_bytes // 4), dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first touches the pages
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        buffer.sum().item()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def hf_generate(model, ids: list[int], max_new_tokens: int, stops: list[int], **options) -> list[int]:
    """HF `generate`'s greedy new tokens for one prompt (`options`: its own speculative decoding, if any), with our
    stopping rule: the run ends after the first end-of-turn id or max_new_tokens."""
    out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=stops, pad_token_id=stops[0], **options)
    return out[0, len(ids):].tolist()


def timed(fn, ids: list[int]):
    start = time.perf_counter()
    output = fn(ids)
    return time.perf_counter() - start, output


def bench_ar(model: str, dataset: str, prompts: int, max_new_tokens: int, repeats: int, device: str, dtype: str | None,
             data_dir: str | None, compile: str = "off") -> BenchResult:
    loaded = load_model(model, device, dtype)
    reference = load_model(model, device, dtype)  # HF generate runs on an untouched copy, as a user would load it
    samples = load_samples(dataset, data_dir, prompts)
    prompt_ids = [render_prompt(loaded.tokenizer, s.prompt) for s in samples]
    target = TargetRuntime(loaded.model, max_len=max(map(len, prompt_ids)) + max_new_tokens + 8, compile=compile)
    stops = sorted(stop_ids(loaded))
    ours = build_method("autoregressive", target, {}, set(stops))
    greedy = Sampler(SamplingConfig())

    def run_ours(ids):
        return ours.generate(ids, max_new_tokens, greedy).output_ids

    def run_hf(ids):
        return hf_generate(reference.model, ids, max_new_tokens, stops)

    ours_s, hf_s, ratios, identical, tokens = [], [], [], True, 0
    with torch.inference_mode():
        run_ours(prompt_ids[0][:16]), run_hf(prompt_ids[0][:16])  # warm-up both paths (and compile ours)
        pairs = [(r, ids) for r in range(repeats) for ids in prompt_ids]
        for r, ids in tqdm(pairs, desc="bench ar vs hf generate", unit="pair"):
            if r % 2 == 0:  # alternate who goes first so neither always runs on a warmer cache
                t_ours, out_ours = timed(run_ours, ids)
                t_hf, out_hf = timed(run_hf, ids)
            else:
                t_hf, out_hf = timed(run_hf, ids)
                t_ours, out_ours = timed(run_ours, ids)
            identical &= out_ours == out_hf
            tokens += len(out_ours)
            ours_s.append(t_ours)
            hf_s.append(t_hf)
            ratios.append(t_hf / t_ours)
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    bandwidth = read_bandwidth(weights, loaded.device)
    spec = {"kind": "bench-ar", "model": loaded.identity.to_dict(), "dataset": dataset, "prompts": prompts,
            "max_new_tokens": max_new_tokens, "dtype": str(loaded.dtype), "device": loaded.device.type,
            **({"compile": compile} if compile != "off" else {})}
    return BenchResult(
        kind="bench-ar", model=loaded.identity.to_dict(), dtype=str(loaded.dtype).removeprefix("torch."),
        device=loaded.device.type, dataset=dataset, prompts=len(prompt_ids), repeats=repeats,
        max_new_tokens=max_new_tokens, ours_seconds=ours_s, hf_seconds=hf_s, ratios=ratios,
        median_ratio=statistics.median(ratios), identical=identical, tokens=tokens, weights_bytes=weights,
        read_gb_s=round(bandwidth / 1e9, 2), floor_tok_s=round(bandwidth / weights, 2),
        ours_tok_s=round(tokens / sum(ours_s), 2), hf_tok_s=round(tokens / sum(hf_s), 2),
        versions=versions(), config_key=config_key(spec), engine=target.engine(),
    )


def save(result: BenchResult, path: Path) -> None:
    ResultStore(path).append(asdict(result))

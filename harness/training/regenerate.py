"""Self-distillation corpus: the target's own greedy replies to ShareGPT first turns.

Decoding feeds a drafter the target's own output, which for a small model is far more repetitive and predictable
than the ChatGPT replies of the corpus; a drafter distilled on the target's replies learns the states it meets
when decoding (EAGLE-3 and Medusa-2 train on regenerated data for the same reason). Replies are generated greedily
in batches and appended to a JSONL file in the cache, one line per conversation, so every later run (and every
drafter) reuses them and an interrupted generation continues where the file ends. Only the reply text is kept:
the teacher pass recomputes features and targets, so generating in bf16 on a float32 CPU target (twice as fast
here) changes which replies are trained on, never what a token teaches.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

import torch
from tqdm import tqdm

from harness.runtime.models import LoadedModel
from harness.runtime.paths import cache_dir
from harness.runtime.results import append_line
from harness.training.corpus import prompt_ids
from harness.training.ranks import ALONE, Ranks

BATCH = 32  # prompts generated together: 175-196 target tokens/s in bf16 on 2 cores (batch 32-64) vs 84-89 in fp32
MAX_PROMPT = 256  # longer first turns are skipped: their tokens cost teacher time and carry no loss


def replies_path(loaded: LoadedModel, reply_tokens: int, max_prompt: int) -> Path:
    return cache_dir() / "corpus" / loaded.identity.slug / f"greedy-{reply_tokens}-prompt{max_prompt}.jsonl"


def self_distilled(loaded: LoadedModel, convs: Iterable[list[dict]], reply_tokens: int, stop: set[int],
                   max_prompt: int = MAX_PROMPT, ranks: Ranks = ALONE) -> Iterator[list[dict]]:
    """[user, assistant] conversations, in corpus order, for every first turn of at most `max_prompt` tokens,
    the assistant message being the target's greedy reply of at most `reply_tokens` tokens. The replies still
    missing are shared out over the ranks a batch each; rank 0 merges them into the one file, each once."""
    path = replies_path(loaded, reply_tokens, max_prompt)
    cached = ranks.from_lead(_read(path) if ranks.lead else None)  # every rank sees rank 0's file
    prompts = ((index, messages[:1]) for index, messages in enumerate(convs))
    prompts = ((index, turn) for index, turn in prompts if len(prompt_ids(loaded.tokenizer, turn)) <= max_prompt)
    generator, bar = None, None
    while batch := list(islice(prompts, BATCH * ranks.world)):
        missing = [(index, turn) for index, turn in batch if cached.get(index, (None, None))[0] != _sha(turn)]
        if missing:
            mine, replies = missing[ranks.rank::ranks.world], []
            if mine:
                if generator is None:
                    generator = _generation_model(loaded)
                    bar = tqdm(unit="tok", desc="regenerate replies", dynamic_ncols=True, disable=not ranks.lead)
                replies = _generate(generator, loaded, mine, reply_tokens, stop, bar)
            turns = dict(missing)
            for part in ranks.gather([(index, reply) for (index, _), reply in zip(mine, replies)]):
                for index, reply in part:
                    if ranks.lead:
                        append_line(path, {"conversation": index, "prompt_sha256": _sha(turns[index]),
                                           "reply": reply})
                    cached[index] = (_sha(turns[index]), reply)
        for index, turn in batch:
            if cached[index][1].strip():  # a reply that ends at once teaches nothing
                yield [turn[0], {"role": "assistant", "content": cached[index][1]}]
    if bar is not None:
        bar.close()


def _sha(turn: list[dict]) -> str:
    return hashlib.sha256(turn[0]["content"].encode("utf-8")).hexdigest()[:16]


def _read(path: Path) -> dict[int, tuple[str, str]]:
    """Cached replies by conversation index; a torn last line (a killed run) is generated again."""
    cached = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            cached[row["conversation"]] = (row["prompt_sha256"], row["reply"])
    return cached


def _generation_model(loaded: LoadedModel) -> torch.nn.Module:
    if loaded.device.type == "cpu" and loaded.dtype == torch.float32:
        return copy.deepcopy(loaded.model).to(torch.bfloat16)
    return loaded.model


def _generate(model: torch.nn.Module, loaded: LoadedModel, batch: list[tuple[int, list[dict]]], reply_tokens: int,
              stop: set[int], bar: tqdm) -> list[str]:
    """Greedy replies for a left-padded batch of prompts, cut at the first stop token."""
    prompts = [prompt_ids(loaded.tokenizer, turn) for _, turn in batch]
    width = max(len(p) for p in prompts)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else min(stop)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=loaded.device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=loaded.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=reply_tokens, do_sample=False,
                             temperature=None, top_p=None, top_k=None, eos_token_id=sorted(stop), pad_token_id=pad)
    replies = []
    for row in out[:, width:].tolist():
        cut = next((i for i, token in enumerate(row) if token in stop), len(row))
        bar.update(cut)
        replies.append(loaded.tokenizer.decode(row[:cut], skip_special_tokens=True))
    return replies

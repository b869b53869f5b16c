"""The self-distillation corpus: the target's greedy replies, generated once, cached, resumed after a kill."""

import json
from itertools import islice

import pytest
import torch

from harness.runtime.models import load_model, stop_ids
from harness.training import regenerate
from harness.training.corpus import conversations, prompt_ids

REPLY = 6


@pytest.fixture
def loaded(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    return load_model(str(tiny_dir))


def _short_turns(loaded, count):
    """The first `count` ShareGPT conversations whose first turn fits the prompt limit."""
    return list(islice((c for c in conversations()
                        if len(prompt_ids(loaded.tokenizer, c[:1])) <= regenerate.MAX_PROMPT), count))


def _greedy_alone(model, loaded, turn, stop) -> str:
    """The reply to one prompt generated on its own (no padding), as the batched generation must reproduce."""
    ids = torch.tensor([prompt_ids(loaded.tokenizer, turn)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=REPLY, do_sample=False,
                         temperature=None, top_p=None, top_k=None, eos_token_id=sorted(stop), pad_token_id=min(stop))
    row = out[0, ids.shape[1]:].tolist()
    row = row[:next((i for i, t in enumerate(row) if t in stop), len(row))]
    return loaded.tokenizer.decode(row, skip_special_tokens=True)


def test_replies_are_the_targets_greedy_ones_for_the_first_turns(loaded):
    convs, stop = _short_turns(loaded, 3), stop_ids(loaded)
    out = list(regenerate.self_distilled(loaded, convs, REPLY, stop))
    model = regenerate._generation_model(loaded)
    assert model.dtype == torch.bfloat16 and loaded.model.dtype == torch.float32  # a bf16 copy; the target untouched
    assert [c[0] for c in out] == [c[0] for c in convs]
    assert all(len(c) == 2 and c[1]["role"] == "assistant" for c in out)
    assert [c[1]["content"] for c in out] == [_greedy_alone(model, loaded, c[:1], stop) for c in convs]


def test_long_first_turns_are_skipped(loaded, monkeypatch):
    convs = _short_turns(loaded, 2)
    long_turn = [{"role": "user", "content": "word " * (2 * regenerate.MAX_PROMPT)}, convs[0][1]]
    out = list(regenerate.self_distilled(loaded, [convs[0], long_turn, convs[1]], REPLY, stop_ids(loaded)))
    assert [c[0] for c in out] == [convs[0][0], convs[1][0]]


def test_cached_replies_are_reused_and_a_torn_or_stale_line_regenerated(loaded, monkeypatch):
    convs, stop = _short_turns(loaded, 4), stop_ids(loaded)
    first = list(regenerate.self_distilled(loaded, convs, REPLY, stop))
    path = regenerate.replies_path(loaded, REPLY, regenerate.MAX_PROMPT)
    lines = path.read_text().splitlines()
    assert [json.loads(line)["conversation"] for line in lines] == [0, 1, 2, 3]

    def no_generation(*args):
        raise AssertionError("a cached reply was generated again")

    monkeypatch.setattr(regenerate, "_generate", no_generation)
    assert list(regenerate.self_distilled(loaded, convs, REPLY, stop)) == first

    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])  # a kill mid-write
    edited = [*convs[:1], [{"role": "user", "content": convs[1][0]["content"] + " Be brief."}, convs[1][1]], *convs[2:]]
    asked = []

    def record(model, loaded, batch, reply_tokens, stop, bar):
        asked.extend(index for index, _ in batch)
        return [f"reply {index}" for index, _ in batch]

    monkeypatch.setattr(regenerate, "_generate", record)
    again = list(regenerate.self_distilled(loaded, edited, REPLY, stop))
    assert asked == [1, 3]  # the changed prompt and the torn line, nothing else
    assert [c[1]["content"] for c in again] == [first[0][1]["content"], "reply 1", first[2][1]["content"], "reply 3"]


def test_a_reply_that_ends_at_once_teaches_nothing_and_is_dropped(loaded, monkeypatch):
    convs = _short_turns(loaded, 2)
    monkeypatch.setattr(regenerate, "_generate", lambda model, loaded, batch, *rest: ["", "  some reply"])
    out = list(regenerate.self_distilled(loaded, convs, REPLY, stop_ids(loaded)))
    assert [c[1]["content"] for c in out] == ["  some reply"]

"""`--corpus`: the user's conversations from files and `datasets` folders, in ShareGPT or OpenAI form, mixed in the
stated order; a malformed record is one line naming its file and record (fails on 90451cc: --corpus took only
sharegpt or self)."""

import json

import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.runtime.errors import HarnessError
from harness.training import sources

SHAREGPT = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]}
            for i in range(3)]
OPENAI = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"ask {i}"},
                        {"role": "assistant", "content": f"reply {i}"}, {"role": "user", "content": "more"},
                        {"role": "assistant", "content": "done"}]} for i in range(2)]


def _read(spec: str) -> list[list[dict]]:
    return [m for source in sources.parse(spec) for m in sources.conversations(source, [])]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_each_file_form_reads_the_same_conversations(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    expected = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
                for i in range(3)]
    jsonl = _jsonl(tmp_path / "a.jsonl", SHAREGPT)
    (tmp_path / "a.json").write_text(json.dumps(SHAREGPT))
    pq.write_table(pa.Table.from_pylist(SHAREGPT), tmp_path / "a.parquet")
    for name in ("a.jsonl", "a.json", "a.parquet"):
        assert _read(str(tmp_path / name)) == expected, name
    openai = _read(str(_jsonl(tmp_path / "b.jsonl", OPENAI)))
    assert openai[0] == [{"role": "user", "content": "ask 0"}, {"role": "assistant", "content": "reply 0"},
                         {"role": "user", "content": "more"}, {"role": "assistant", "content": "done"}]
    folder = tmp_path / "parts"
    folder.mkdir()
    _jsonl(folder / "1.jsonl", SHAREGPT[:1])
    _jsonl(folder / "2.jsonl", SHAREGPT[1:])
    assert _read(str(folder)) == expected and sources.parse(str(jsonl))[0].kind == "file"


def test_a_save_to_disk_folder_and_a_datasets_folder_with_a_split(tmp_path):
    import datasets

    datasets.Dataset.from_list(OPENAI).save_to_disk(str(tmp_path / "saved"))
    assert len(_read(str(tmp_path / "saved"))) == 2
    datasets.DatasetDict({"train_sft": datasets.Dataset.from_list(OPENAI)}).save_to_disk(str(tmp_path / "dict"))
    assert len(_read(f"{tmp_path / 'dict'}:train_sft")) == 2
    with pytest.raises(HarnessError, match="a dataset of splits train_sft; name one as .*:train_sft"):
        _read(str(tmp_path / "dict"))
    data = tmp_path / "data"
    data.mkdir()
    _jsonl(data / "train.jsonl", SHAREGPT)
    assert sources.parse(f"{data}:train")[0].kind == "datasets"  # load_dataset's own route (a hub name's), offline
    assert len(_read(f"{data}:train")) == 3


def test_sources_mix_a_conversation_at_a_time_in_the_stated_order(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", SHAREGPT)
    b = _jsonl(tmp_path / "b.jsonl", OPENAI)
    mixed = list(sources.mixed([iter(_read(str(a))), iter(_read(str(b)))]))
    assert [m[0]["content"] for m in mixed] == ["question 0", "ask 0", "question 1", "ask 1", "question 2"]
    assert sources.key(sources.parse(f"{a},{b}")).startswith("mix-")
    assert sources.key(sources.parse("self")) == "self" and sources.key(sources.parse("sharegpt")) == "sharegpt"
    before = sources.key(sources.parse(str(a)))
    _jsonl(a, SHAREGPT[:2])
    assert sources.key(sources.parse(str(a))) != before  # an edited file is another corpus


@pytest.mark.parametrize("record, message", [
    ("[1, 2]", "line 2: a list, not a conversation record"),
    ('{"text": "hi"}', "line 2: neither 'conversations' .* nor 'messages'"),
    ('{"messages": [{"role": "user", "content": 3}]}', "line 2: turn 1 has no text 'role' and 'content'"),
    ('{"messages": [', "line 2: not JSON"),
])
def test_a_malformed_record_is_one_line_naming_its_file_and_record(tmp_path, record, message):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(SHAREGPT[0]) + "\n" + record + "\n")
    with pytest.raises(HarnessError, match=f"^{path}: {message}") as caught:
        _read(str(path))
    assert "\n" not in str(caught.value)


def test_bad_specs_stop_before_the_model_loads(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    for spec, message in [(str(tmp_path / "missing.jsonl"), "no such file or folder, and not a datasets NAME:SPLIT"),
                          (str(tmp_path / "notes.txt"), "a .txt file; give .jsonl, .json or .parquet"),
                          ("sharegpt,", "an empty source")]:
        result = CliRunner().invoke(main, ["train", "--corpus", spec, "--model", "no-such-model"])
        assert result.exit_code == 2 and message in result.output, result.output


def test_a_corpus_without_an_assistant_reply_is_refused(tmp_path):
    from harness.training.train import corpus_conversations

    only_users = [{"messages": [{"role": "user", "content": "hello"}]}]
    path = _jsonl(tmp_path / "u.jsonl", only_users)
    with pytest.raises(HarnessError, match="no conversation with an assistant reply"):
        corpus_conversations(str(path))


def test_the_references_draft_vocabulary_file_is_read_and_checked(tmp_path):
    """Fails on 90451cc (no --draft-vocab-file): the reference's draft_vocab/*.json form gives the sorted ids; a
    file for another vocabulary, repeated ids or a size that disagrees is one line."""
    from harness.training.draft_vocab import read_draft_vocab

    def file(**fields):
        path = tmp_path / "vocab.json"
        path.write_text(json.dumps({"tokenizer_name": "x", "data_paths": ["./ultrachat_200k/train_sft"],
                                    "mask_assistant": True, **fields}))
        return path

    ids = read_draft_vocab(file(vocab_size=100, draft_vocab_size=4, token_ids=[7, 0, 3, 99]), 100)
    assert ids.tolist() == [0, 3, 7, 99]
    (tmp_path / "list.json").write_text("[5, 1]")
    assert read_draft_vocab(tmp_path / "list.json", 100).tolist() == [1, 5]
    for fields, message in [({"vocab_size": 151643, "token_ids": [0, 150000]}, "counted on a vocabulary of 151643"),
                            ({"token_ids": [1, 1]}, "distinct"), ({"draft_vocab_size": 3, "token_ids": [1, 2]},
                                                                  "draft_vocab_size 3 but 2 token_ids"),
                            ({"ids": [1]}, "no 'token_ids' list")]:
        with pytest.raises(HarnessError, match=message):
            read_draft_vocab(file(**fields), 100)

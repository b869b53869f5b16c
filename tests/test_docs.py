"""Docs that stay true: every `spd-bench ...` command in README.md and docs/*.md parses against the real command line
(its options exist, its values are valid), every relative link resolves, and a link into a section of another
file (a figure cited from reports/results.md, say) names a section that file has."""

import os
import re
import shlex
from pathlib import Path

import click
import pytest

from harness.cli import _declared_params, _method_options, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# What the GPU guide's shell variables stand for, so its commands parse as a user's shell would pass them.
SHELL = {"M": "/models/Qwen3.5-4B", "DATA": "/data/eval", "GPU": "--model /models/Qwen3.5-4B --device cuda",
         "ARGS": "--max-new-tokens 128", "i": "0", "SLURM_ARRAY_TASK_ID": "1"}
FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`(spd-bench [^`]+)`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def commands(text: str) -> list[str]:
    """The spd-bench command lines of a document: lines of its code blocks (continuations joined, comments cut,
    `a && b` split) and inline code spans."""
    found = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                part = part.split(" # ")[0].strip().removeprefix("$ ")
                if " -m harness.cli " in part:  # under torchrun: the same command line
                    part = "spd-bench " + part.split(" -m harness.cli ", 1)[1].removeprefix("-- ")
                if part.startswith("spd-bench "):
                    found.append(part)
    prose = FENCE.sub("", text)
    return found + [span.strip() for span in INLINE.findall(prose)]


def command_problem(line: str) -> str | None:
    """Why `line` would not parse against the real CLI, or None."""
    try:
        words = shlex.split(os.path.expandvars(_expand(line)))[1:]
    except ValueError as exc:
        return f"{line!r}: {exc}"
    command, path = main, ["spd-bench"]
    while isinstance(command, click.Group):
        if words[:1] == ["--help"]:
            return None
        if not words or words[0] not in command.commands:
            return f"{line!r}: no command {words[0] if words else '(none)'!r} under {' '.join(path)}"
        path.append(words[0])
        command, words = command.commands[words[0]], words[1:]
    if "--help" in words:
        return None
    try:
        ctx = command.make_context(" ".join(path), list(words))
        if ctx.args:  # `run`'s method parameters: each must be one a method declares
            declared = _declared_params()
            unknown = [name for name in _method_options(ctx.args) if name not in declared]
            if unknown:
                return f"{line!r}: no method parameter {', '.join(unknown)}"
    except click.ClickException as exc:
        return f"{line!r}: {exc.format_message()}"
    return None


def _expand(line: str) -> str:
    for name, value in SHELL.items():
        line = line.replace(f"${{{name}}}", value).replace(f"${name}", value)
    return line.replace("$((i+1))", "1")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub renders it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def link_problems(path: Path, text: str) -> list[str]:
    """Relative links of a document that lead nowhere: a missing file, or a section its file does not have."""
    problems = []
    for target in (a or b for a, b in LINK.findall(FENCE.sub("", text))):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            problems.append(f"{path.name}: link to {target!r}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{path.name}: link to {target!r}: {resolved.name} has no such section")
    return problems


@pytest.fixture(autouse=True)
def _kernels_restored(monkeypatch):
    """Parsing a documented `--kernels torch` runs the option's callback, which sets the process's choice (for the
    ranks a run starts): restored after each test, so no later test in this worker runs on torch's kernels."""
    from harness.runtime.kernels import CHOICE_VARIABLE

    monkeypatch.setenv(CHOICE_VARIABLE, "auto")


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # commands name files relative to the repository (a baseline, say)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_in_the_docs_parses_against_the_cli(doc, at_root):
    found = commands(doc.read_text(encoding="utf-8"))
    assert found or doc.name != "README.md"
    assert [p for p in map(command_problem, found) if p] == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_in_the_docs_resolves(doc):
    assert link_problems(doc, doc.read_text(encoding="utf-8")) == []


def test_every_doc_starts_with_its_commands():
    for doc in DOCS[1:]:
        text = doc.read_text(encoding="utf-8")
        first = FENCE.search(text)
        assert first and text.index(first.group(0)) < 1200, f"{doc.name} does not open with its commands"
        assert len(commands(first.group(0))) + first.group(0).count("make ") >= 3, doc.name


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


def test_a_planted_broken_command_or_link_is_caught(tmp_path, at_root):
    text = ("```bash\nspd-bench run --method spd --no-such-option 3\nspd-bench sweep --temperature 0 --turns both\n```\n"
            "Run `spd-bench report --format pdf` or `spd-bench run --method eagle3 --not-a-param 2`; see "
            "[the methods](docs/nowhere.md), [the report](reports/results.md#no-such-section) and "
            "[fine](reports/results.md#losslessness).\n")
    problems = [p for p in map(command_problem, commands(text)) if p]
    assert len(problems) == 4, problems
    assert any("--no-such-option" in p for p in problems) and any("not-a-param" in p for p in problems)
    doc = tmp_path / "README.md"
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "results.md").write_text("# Results\n\n## Losslessness\n")
    assert [p.split(": ", 2)[1] for p in link_problems(doc, text)] == [
        "link to 'docs/nowhere.md'", "link to 'reports/results.md#no-such-section'"]


def test_each_command_help_says_what_it_does_and_shows_an_example(at_root):
    def every(group, path):
        for name, command in group.commands.items():
            yield from every(command, [*path, name]) if isinstance(command, click.Group) else [([*path, name],
                                                                                                 command)]
    for path, command in every(main, ["spd-bench"]):
        text = command.get_help(click.Context(command, info_name=" ".join(path)))
        assert command.get_short_help_str(limit=120), path
        examples = [line.strip() for line in text.splitlines() if line.strip().startswith("spd-bench ")]
        assert examples, f"{' '.join(path)} --help shows no example"
        assert [p for p in map(command_problem, examples) if p] == []


def test_every_run_in_the_readmes_methods_table_has_its_drafter_or_says_to_train_it_first():
    """A fresh clone ships only the main job's drafters: a row whose run needs another one names the training
    command first (fails on a16459a: `--schedule output` and `ppsd` rows said only `run`)."""
    import methods  # noqa: F401  (fills the registry)
    from harness.runtime.checkpoints import SHIPPED
    from methods.base import REGISTRY, parse_params
    from methods.capabilities import drafter_of

    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `")]
    checked = 0
    for row in rows:
        for line in INLINE.findall(row):
            words = shlex.split(line)
            if words[:2] != ["spd-bench", "run"]:
                continue
            options = dict(zip(words[2::2], words[3::2]))
            cls = REGISTRY[options.pop("--method")]
            params = {k.removeprefix("--").replace("-", "_"): int(v) if v.isdigit() else v for k, v in options.items()}
            needed = drafter_of(cls, parse_params(cls, params))
            shipped = needed is None or (SHIPPED / "smollm2-135m" / f"{cls.drafter_family()}-{needed[0]}").exists()
            assert shipped or "spd-bench train" in row.split(line)[0], row
            checked += 1
    assert checked >= 6


def _torchrun_lines(text: str) -> list[list[str]]:
    lines = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("torchrun "):
                lines.append(shlex.split(line.split(" # ")[0]))
    return lines


def test_every_torchrun_example_starts_the_world_its_run_needs():
    """Fails on a16459a: docs/distributed.md started 2 x 5 = 10 processes for a pipeline of 8 stages (a world of
    9). The world is one driver and one rank per --devices entry (n stages, or SSD's drafter); each node's ranks
    name distinct devices, or NCCL would see two ranks on one GPU."""
    found = 0
    for doc in DOCS:
        for words in _torchrun_lines(doc.read_text()):
            option = dict(zip(words, words[1:]))
            if option.get("--executor") != "distributed":  # data-parallel training runs on any world
                continue
            world = int(option.get("--nnodes", 1)) * int(option["--nproc-per-node"])
            devices = option["--devices"].split(",")
            assert world == len(devices) + 1, (doc.name, words)
            if option.get("--method") in ("spd", "ppsd"):
                assert len(devices) == int(option["--n"]), (doc.name, words)
            per_node = int(option["--nproc-per-node"])
            ranks = [option.get("--device", "cuda:0"), *devices]
            gpus = {(rank // per_node, device) for rank, device in enumerate(ranks)}
            assert len(gpus) == len(ranks), (doc.name, words)
            found += 1
    assert found >= 1


def test_two_nodes_cuda_0_are_two_gpus():
    """Fails on a16459a: NCCL was chosen only when every rank's device string differed."""
    from harness.runtime.distributed import backend_for

    devices = "cuda:1,cuda:2,cuda:3,cuda:4,cuda:0,cuda:1,cuda:2,cuda:3,cuda:4".split(",")
    assert backend_for("cuda:0", devices, per_node=5) == "nccl"
    assert backend_for("cuda:0", devices) == "gloo"  # spawned here: two ranks on one GPU
    assert backend_for("cuda:0", ["cuda:0"] * 4, per_node=1) == "nccl"  # one GPU per node
    assert backend_for("cpu", ["cuda:1"], per_node=1) == "gloo"

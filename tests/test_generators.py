"""Random draws on the generator's own device: a CUDA generator draws only CUDA tensors, so a draw that names a
generator and no device fails on a GPU (every T>0 `--simulate` replay and distributed SSD at T>0 did, on a16459a).
No GPU here, so the rule is held on the source: every torch draw that passes `generator=` passes `device=` too."""

import ast
from pathlib import Path

import torch

from methods.sampling import Sampler, SamplingConfig

ROOT = Path(__file__).resolve().parents[1]
DRAWS = {"rand", "randn", "randint", "randperm", "multinomial", "normal", "bernoulli", "rand_like", "randint_like"}


def _draws_without_a_device(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or node.func.attr not in DRAWS:
            continue
        names = {keyword.arg for keyword in node.keywords}
        if "generator" in names and "device" not in names and not node.func.attr.endswith("_like"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_draw_names_a_generator_without_a_device():
    """Fails on a16459a: methods/teacher.py:61 and methods/ssd/distributed.py:86 among others."""
    sources = [p for folder in ("harness", "methods") for p in (ROOT / folder).rglob("*.py")]
    assert len(sources) > 50
    assert [where for path in sources for where in _draws_without_a_device(path)] == []


def test_the_rule_catches_a_draw_without_a_device(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import torch\nx = torch.rand((), generator=g)\ny = torch.rand((), generator=g, device=d)\n")
    assert len(ast.parse(planted.read_text()).body) == 3
    found = []
    for node in ast.walk(ast.parse(planted.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rand":
            found.append({k.arg for k in node.keywords})
    assert found == [{"generator"}, {"generator", "device"}]


def test_the_samplers_draws_follow_its_generator():
    sampler = Sampler(SamplingConfig(temperature=1.0), torch.Generator().manual_seed(3))
    again = Sampler(SamplingConfig(temperature=1.0), torch.Generator().manual_seed(3))
    assert [sampler.uniform(), sampler.seed()] == [again.uniform(), again.seed()]  # a seeded run repeats
    assert 0.0 <= Sampler(SamplingConfig(temperature=1.0)).uniform() < 1.0  # no generator: torch's default

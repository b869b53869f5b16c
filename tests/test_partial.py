"""A rank loads only its part of the target (harness/runtime/partial.py): the tensors it keeps, read alone from the
safetensors files, equal to a whole load's; checkpoint prefixes mapped; a pipeline stage's peak memory its share."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.runtime.models import load_model
from harness.runtime.partial import Part, load_part

ROOT = Path(__file__).resolve().parents[1]


def _same_as_whole(part_model, whole_model) -> bool:
    whole = whole_model.state_dict()
    return all(torch.equal(tensor, whole[name]) for name, tensor in part_model.state_dict().items())


def test_a_stage_loads_its_layers_alone_and_equal_to_a_whole_load(tiny_dir):
    whole = load_model(str(tiny_dir), "cpu", "float32", tokenizer=False).model
    stage = load_part(str(tiny_dir), Part(1, 3), "cpu", "float32").model
    kept = [i for i, layer in enumerate(stage.model.layers) if not isinstance(layer, torch.nn.Identity)]
    assert kept == [1, 2] and stage.model.embed_tokens is None and stage.lm_head is None
    names = stage.state_dict().keys()
    assert names and all(name.startswith(("model.layers.1.", "model.layers.2.")) for name in names)
    assert _same_as_whole(stage, whole)
    assert torch.equal(stage.model.rotary_emb.inv_freq, whole.model.rotary_emb.inv_freq)
    assert not any(p.is_inference() for p in stage.parameters())  # version counters, for the CPU kernels' copies


def test_a_drafter_rank_loads_the_frozen_parts_and_no_layer(tiny_dir):
    whole = load_model(str(tiny_dir), "cpu", "float32", tokenizer=False).model
    parts = load_part(str(tiny_dir), Part(0, 0, embedding=True, norm=True, head=True), "cpu", "float32").model
    assert all(isinstance(layer, torch.nn.Identity) for layer in parts.model.layers)
    assert sorted(parts.state_dict()) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert _same_as_whole(parts, whole)


def test_a_checkpoint_under_another_prefix_and_a_tied_head_map_onto_the_model(tiny_dir, tmp_path):
    """A multimodal checkpoint names the text model `model.language_model.` and may store a tied head once."""
    folder = tmp_path / "prefixed"
    folder.mkdir()
    for file in tiny_dir.iterdir():
        if file.suffix != ".safetensors" and file.is_file():
            (folder / file.name).write_bytes(file.read_bytes())
    tensors = {}
    for file in tiny_dir.glob("*.safetensors"):
        tensors.update(load_file(file))
    renamed = {("model.language_model." + n.removeprefix("model.")) if n.startswith("model.") else n: t
               for n, t in tensors.items() if n != "lm_head.weight"}
    renamed["mtp.layers.0.mlp.up_proj.weight"] = torch.zeros(1)  # a same-named tensor of another module
    save_file(renamed, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    stage = load_part(str(folder), Part(0, 1), "cpu", "float32").model
    assert torch.equal(stage.model.layers[0].mlp.up_proj.weight, tensors["model.layers.0.mlp.up_proj.weight"])
    frozen = load_part(str(folder), Part(0, 0, embedding=True, norm=True, head=True), "cpu", "float32").model
    assert frozen.lm_head.weight is frozen.model.embed_tokens.weight
    assert torch.equal(frozen.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_a_weight_mismatch_with_the_driver_is_one_line(tiny_dir):
    from harness.runtime.errors import HarnessError

    with pytest.raises(HarnessError, match="the driver's are 000000000000; give every machine the same files"):
        load_part(str(tiny_dir), Part(0, 1), "cpu", "float32", expected_sha256="0" * 64)


@pytest.mark.e2e
@pytest.mark.parametrize("stage", [0, 3])
def test_a_pipeline_stage_rank_peaks_at_about_its_share_of_the_weights(stage):
    """At n=4 a stage rank of the embedded model (fp32) holds a quarter of the layers; its load must not peak at the
    whole model, as loading it whole and dropping layers did (every rank of a 9B pipeline at 9B)."""
    code = f"""
import resource, sys
sys.path.insert(0, {str(ROOT)!r})
from harness.runtime.models import load_identity
from harness.runtime.target import stage_bounds
from methods.pipeline.distributed import StagePlan, load_stage
plan = StagePlan("smollm2-135m", "float32", load_identity("smollm2-135m").weights_sha256, stage_bounds(30, 4), (),
                 64, 8, "off")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
runtime = load_stage(plan, {stage}, "cpu")
held = sum(p.numel() * p.element_size() for p in runtime.model.parameters())
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, held)
"""
    from safetensors import safe_open

    from harness.runtime.models import resolve_model_dir

    whole = 0  # the embedded model's parameters in fp32, bytes
    for file in resolve_model_dir("smollm2-135m")[1].glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            whole += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys()) * 4
    grown, held = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                          env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout.split())
    assert held < whole / 3 and grown < held + whole / 4, (grown, held)

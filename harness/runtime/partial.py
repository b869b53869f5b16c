"""A part of a model loaded alone: some of its decoder layers, and its embedding, final norm and head only when asked,
each tensor read from the safetensors files by itself, so a pipeline's stage rank holds about its share of the
weights (nine ranks of a 9B model loading it whole need ~150 GB of host memory) and a drafter rank one layer
(its head is built as the target's first).

The model is built on the meta device, the layers it does not keep become Identity (their indices, and their cache
slots, keep their meaning), and every tensor the kept part has is read from the file that holds it. Checkpoint names
may carry another prefix than the model's own (a multimodal checkpoint's `model.language_model.`): the prefix that
names the most of the model's tensors is taken for all of them. A checkpoint whose names do not map so (tensors HF
converts while loading: fused experts, quantized weights) loads whole, as `load_model` does, and is then cut, with a
note that it did.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.runtime.errors import HarnessError
from harness.runtime.models import LoadedModel, ModelIdentity, load_model, pick_dtype, resolve_device, \
    resolve_dtype, resolve_model_dir, weights_sha256


@dataclass(frozen=True)
class Part:
    """What of a model a rank keeps: decoder layers [lo, hi) and, when asked, the embedding, final norm and head."""

    lo: int
    hi: int
    embedding: bool = False
    norm: bool = False
    head: bool = False

    def keeps(self, name: str) -> bool:
        """Whether the model's tensor `name` belongs to this part (outside the layers: the other named parts)."""
        if name.startswith("model.layers."):
            return self.lo <= int(name.split(".")[2]) < self.hi
        if name.startswith("model.embed_tokens."):
            return self.embedding
        if name.startswith("model.norm."):
            return self.norm
        if name.startswith("lm_head."):
            return self.head
        return True  # anything else the backbone holds (few and small)


def load_part(spec: str, part: Part, device: str = "cpu", dtype: str | None = None,
              expected_sha256: str | None = None) -> LoadedModel:
    """`spec` with only `part` loaded (layers outside it Identity; an unkept embedding, norm or head None) on
    `device`, its weights made outside inference mode (the CPU kernels check copies by their version counters)."""
    name, folder = resolve_model_dir(spec)
    identity = ModelIdentity(name=name, weights_sha256=weights_sha256(folder))
    if expected_sha256 and identity.weights_sha256 != expected_sha256:
        raise HarnessError(f"model {spec} on this rank has weights {identity.weights_sha256[:12]}, the driver's are "
                           f"{expected_sha256[:12]}; give every machine the same files")
    torch_device, torch_dtype = resolve_device(device), resolve_dtype(pick_dtype(dtype, device))
    with torch.inference_mode(False):
        model = _skeleton(folder, torch_dtype, part)
        names = _checkpoint_names(folder)
        tied = part.head and part.embedding and "lm_head.weight" not in names and \
            model.config.get_text_config().tie_word_embeddings
        wanted = [n for n in model.state_dict() if part.keeps(n) and not (tied and n == "lm_head.weight")]
        mapping = _mapping(wanted, names)
        if mapping is None:
            print(f"note: {spec}: its checkpoint's tensor names do not map onto the model's; this rank loads it whole",
                  file=sys.stderr)
            loaded = load_model(spec, "cpu", dtype, tokenizer=False)
            _cut(loaded.model, part)
            loaded.model.to(torch_device)
            return LoadedModel(loaded.model, None, identity, torch_device, torch_dtype)
        model.load_state_dict(_read(folder, mapping, names, torch_dtype, torch_device), assign=True, strict=False)
        if tied:  # the checkpoint stores the shared matrix once, as the embedding
            model.lm_head.weight = model.model.embed_tokens.weight
        _rebuild_buffers(model, torch_device)
        model.eval()
    return LoadedModel(model=model, tokenizer=None, identity=identity, device=torch_device, dtype=torch_dtype)


def _skeleton(folder: Path, dtype: torch.dtype, part: Part) -> torch.nn.Module:
    """The model on the meta device (no memory), cut to `part`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    _cut(model, part)
    return model


def _cut(model: torch.nn.Module, part: Part) -> None:
    layers = model.model.layers
    for i in range(len(layers)):
        if not part.lo <= i < part.hi:
            layers[i] = torch.nn.Identity()  # keeps layer indices (and their cache slots) meaningful
    if not part.embedding:
        model.model.embed_tokens = None
    if not part.norm:
        model.model.norm = None
    if not part.head:
        model.lm_head = None


def _checkpoint_names(folder: Path) -> dict[str, Path]:
    """Each tensor name in the folder's safetensors files and the file that holds it."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {n: folder / f for n, f in json.loads(index.read_text())["weight_map"].items()}
    names = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            names.update({n: file for n in handle.keys()})
    return names


def _mapping(wanted: list[str], names: dict[str, Path]) -> dict[str, str] | None:
    """The checkpoint name of each wanted model tensor, or None where one has none. The backbone's (`model.`...)
    take the one prefix that names the most of them; the rest (the head) are named as in the model."""
    def tail(name: str) -> str:
        return name.removeprefix("model.")

    votes = Counter(name[: len(name) - len(tail(w))] for w in wanted if w.startswith("model.") for name in names
                    if name == tail(w) or name.endswith("." + tail(w)))
    prefix = votes.most_common(1)[0][0] if votes else "model."
    mapping = {w: prefix + tail(w) if w.startswith("model.") else w for w in wanted}
    return mapping if all(name in names for name in mapping.values()) else None


def _read(folder: Path, mapping: dict[str, str], names: dict[str, Path], dtype: torch.dtype,
          device: torch.device) -> dict[str, torch.Tensor]:
    """The mapped tensors, each read by itself from its file and converted to `dtype` on `device`."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for model_name, name in mapping.items():
        by_file.setdefault(names[name], []).append(model_name)
    tensors = {}
    for file, model_names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as handle:
            for model_name in model_names:
                tensor = handle.get_tensor(mapping[model_name])
                tensors[model_name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
    return tensors


def _rebuild_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers no checkpoint holds (the rotary embedding's frequencies) made anew on `device`; any other tensor still
    on the meta device is a checkpoint that lacks it."""
    backbone = model.model
    rotary = getattr(backbone, "rotary_emb", None)
    if rotary is not None and any(b.is_meta for b in rotary.buffers()):
        with torch.device(device):
            backbone.rotary_emb = type(rotary)(rotary.config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise HarnessError(f"the checkpoint holds no {', '.join(left[:3])}{' ...' if len(left) > 3 else ''}; "
                           f"pass the model's complete safetensors files")

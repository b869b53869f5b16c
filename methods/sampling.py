"""Sampling settings and the target distribution they define; shared by every method and its AR reference."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

NO_TRUNCATION = (0, 1.0)  # (top-k, top-p) of sampling with neither


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0 or self.temperature == float("inf"):  # also refuses nan
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probabilities [..., V] (rows [...]; a scalar for [V]), on their device: the inverse CDF,
    one uniform per row against the running sum (float64, so a row's rounding cannot reach a token of mass 0).
    `torch.multinomial` draws an exponential per vocabulary entry instead, far slower at a real vocabulary, and a
    sampled round draws many rows (the figures: docs/performance.md)."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((*cdf.shape[:-1], 1), generator=generator, dtype=torch.float64, device=cdf.device)
    return torch.searchsorted(cdf, u * cdf[..., -1:], right=True).clamp_max(cdf.shape[-1] - 1)[..., 0]


def _device(generator: torch.Generator | None) -> torch.device | None:
    return None if generator is None else generator.device


class Sampler:
    """Turns target logits into the distribution p that every verifier must reproduce, and draws from it."""

    def __init__(self, config: SamplingConfig, generator: torch.Generator | None = None):
        self.config = config
        self.generator = generator

    @property
    def greedy(self) -> bool:
        return self.config.greedy

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Float32 probabilities over the last dim after temperature, top-k and top-p (T must be > 0)."""
        logits = logits.float() / self.config.temperature
        if self.config.top_k:
            kth = torch.topk(logits, min(self.config.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.config.top_p < 1:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before >= self.config.top_p)
            probs = probs.masked_fill(drop, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """What draft trees rank children by: log-softmax at T=0, else the log of `probs` (-inf outside top-k/p)."""
        return torch.log_softmax(logits.float(), dim=-1) if self.greedy else self.probs(logits).log()

    def draw(self, probs: torch.Tensor) -> int:
        return int(draw(probs, self.generator))

    def uniform(self) -> float:
        """One U(0, 1) draw from the generator, made on its device (a CUDA generator draws only CUDA tensors)."""
        return float(torch.rand((), generator=self.generator, device=_device(self.generator)))

    def seed(self) -> int:
        """A seed drawn from the generator, for a sampler elsewhere (a drafter rank) to repeat a seeded run."""
        return int(torch.randint(2**62, (1,), generator=self.generator, device=_device(self.generator)))

    def next_token(self, logits: torch.Tensor) -> torch.Tensor:
        """Next token from target logits [V] as a [1] tensor on their device (nothing read back): argmax at T=0, else
        a draw from `probs`."""
        if self.greedy:
            return torch.argmax(logits, dim=-1, keepdim=True)
        return draw(self.probs(logits), self.generator)[None]

    def pick(self, logits: torch.Tensor) -> int:
        return int(self.next_token(logits))

    def best_children(self, logits: torch.Tensor, parent_scores: list[float], width: int
                      ) -> list[tuple[int, int, float]]:
        """Draft-tree expansion: each row of draft logits [P, V] proposes its top `width` tokens; the `width` best
        (parent row, token, cumulative log-probability) overall, best first, under these sampling settings. The
        level is read back once (ids below 2**53 are exact as float64)."""
        top = torch.topk(self.log_probs(logits), width, dim=-1)
        scores = top.values + torch.tensor(parent_scores, device=logits.device)[:, None]
        best = torch.topk(scores.flatten(), width)
        tokens = top.indices.flatten()[best.indices]
        rows, ids, values = torch.stack([(best.indices // width).double(), tokens.double(), best.values.double()]).tolist()
        return [(int(row), int(token), value) for row, token, value in zip(rows, ids, values) if value > float("-inf")]

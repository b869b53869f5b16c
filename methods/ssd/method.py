"""Speculative speculative decoding (SSD; Kumar, Dao and May, arXiv 2603.03251).

Draft-then-verify removes the target's serial steps but keeps one of its own: each round waits for its drafts. SSD
drafts the next round while the target verifies this one, for the outcomes it expects: how many of the k drafts are
accepted (a = 0..k) and which bonus token follows (the drafter's top F_a tokens after a accepted drafts, the
rejected draft excluded). The chains drafted for those outcomes wait in a speculation cache keyed by (a, bonus);
when the real outcome is there the next round starts with no drafting, on a miss a fallback drafts: `jit` drafts k
tokens as a synchronous round would, `none` verifies no drafts (one target step).

Saguaro sampling (`saguaro_x` = x < 1) scales the drafter's top F + 1 probabilities by x before sampling and
verification: the rejection residual max(0, p - q), which the bonus token is drawn from, then leans towards the
drafter's top tokens, the ones the cache holds. Lossless at any x: a cached chain was sampled from exactly the q it
is verified with, independently of the outcome that selects it.

The drafter (methods/ssd/drafters.py) is an EAGLE-3 head (the shipped one on the embedded model), which sees the
target's features of committed tokens and, for the chains drafted during verification, its own states for this
round's drafts and the guessed bonus token, as EAGLE-3's deeper drafts do; or a standalone draft model with the
target's tokenizer (`draft_model`), which sees tokens only.

In one process (the default) the cache is built ("speculate") before the verification forward ("verify"), one
after the other, and the modeled time takes them as overlapped (drafter and target on devices of their own): per
round max(verify, speculate) + the drafter's update + the fallback's drafting on a miss. With `--executor
distributed` the drafter runs in a rank of its own (methods/ssd/distributed.py) and the overlap is real: the
driver's rounds are verification plus the wait for the next drafts ("wait": the drafter's update and lookup, or
fallback); the same model is computed from each round's times on both ranks. After SSD, every sample is decoded
again by synchronous speculative decoding with the same drafter and k (no cache, no Saguaro), so the record holds
its decode time beside AR's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from methods.base import Generation, Method, Timer, param, register
from methods.capabilities import Drafted, SelfChecks, Serves
from methods.eagle3.head import EagleConfig, EagleHead, head_tag, train_command
from methods.rounds import DraftShape, DraftTree, Node, Outcome, RoundMethod, Rounds, feed, target_prefill, verify
from methods.sampling import Sampler
from methods.ssd.drafters import build_drafter
from methods.ssd.speculate import OracleSpeculation, Speculation, Unread
from methods.stats import Stats, same

FALLBACKS = ("jit", "none")
MAX_SPECULATED = 240  # tree rows per round: the runtime keeps 256 slots above the sequence for drafts


@dataclass(frozen=True)
class SSDParams:
    k: int = param(4, "Drafts per round.")
    fan_out: int = param(3, "Bonus tokens guessed per accepted count.")
    fan_out_list: str = param("", "F0,F1,..,Fk: guesses per accepted count 0..k (overrides fan_out).")
    saguaro_x: float = param(1.0, "Saguaro sampling: scale of the drafter's top fan_out + 1 probabilities (1: off).")
    fallback: str = param("jit", "On a cache miss: draft k tokens now (jit) or verify none (none).")
    ttt: int = param(7, "Which trained EAGLE-3 head drafts.")
    draft_model: str = param("", "A standalone draft model with the target's tokenizer instead of the head "
                                 "(embedded name, folder or hub id).", recorded_when_set=True)

    def __post_init__(self):
        if min(self.k, self.fan_out, self.ttt) < 1:
            raise ValueError(f"k, fan_out and ttt must be >= 1, got k={self.k}, fan_out={self.fan_out}, ttt={self.ttt}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")
        if not (math.isfinite(self.saguaro_x) and self.saguaro_x > 0):
            raise ValueError(f"saguaro_x must be a finite number > 0, got {self.saguaro_x}")
        fan_outs = self.fan_outs  # parses fan_out_list
        if len(fan_outs) != self.k + 1 or min(fan_outs) < 0:
            raise ValueError(f"fan_out_list needs k + 1 = {self.k + 1} comma-separated counts >= 0 (one per accepted "
                             f"count 0..k), got {self.fan_out_list!r}")
        rows = self.k + sum(fan_outs) * (self.k + 1)
        if rows > MAX_SPECULATED:
            raise ValueError(f"k={self.k} with fan-outs {fan_outs} drafts {rows} rows per round (at most "
                             f"{MAX_SPECULATED}); lower k or the fan-out")

    @property
    def fan_outs(self) -> list[int]:
        if not self.fan_out_list:
            return [self.fan_out] * (self.k + 1)
        try:
            return [int(v) for v in str(self.fan_out_list).split(",")]
        except ValueError:
            raise ValueError(f"fan_out_list must be comma-separated counts, got {self.fan_out_list!r}") from None


@dataclass
class SSDStats(Stats):
    hits: list[int] | None = None  # per round: 1 where its drafts came from the speculation cache
    cache_hits: int | None = None
    fallback_drafts: int | None = None  # rounds the fallback drafted
    speculated: int | None = None  # chains drafted for outcomes that might come
    synchronous_tokens: int | None = None  # the synchronous rerun's tokens (timed beside SSD)
    synchronous_samples: int | None = None
    draft: DraftShape | None = same()


@register
class SSD(RoundMethod, Drafted, Serves, SelfChecks):
    name = "ssd"
    Params = SSDParams
    Stats = SSDStats
    serves = "the drafter's rank"
    drafts_with = "eagle3"  # its head is EAGLE-3's (methods/ssd/drafters.py)

    @classmethod
    def drafter(cls, params: SSDParams) -> tuple[str, str] | None:
        """The trained EAGLE-3 head, unless a draft model drafts (it needs no training)."""
        return None if params.draft_model else (head_tag(params.ttt), train_command(params.ttt))

    @classmethod
    def theoretical_speedup(cls, summary) -> float | None:
        """tau * L / (L + f * Ls * k): drafting is hidden behind verification except the fallback's (f: share of
        rounds that missed and drafted k tokens through the head's Ls layers)."""
        shape, tau = summary.stats.draft, summary.tokens_per_step
        if shape is None or tau is None or not summary.steps:
            return None
        drafted = (summary.stats.fallback_drafts or 0) / summary.steps
        return tau * shape.num_layers / (shape.num_layers + drafted * shape.ls * shape.m)

    @classmethod
    def modeled_speedup(cls, summary) -> float | None:
        """AR's measured time per token over SSD's modeled one (drafter and target overlapped, see module doc)."""
        modeled, tokens = summary.timing.get("modeled", 0.0), summary.new_tokens - summary.samples
        baseline = summary.baseline_tokens - summary.samples
        if modeled <= 0 or tokens <= 0 or baseline <= 0 or summary.baseline_decode_s <= 0:
            return None
        return (summary.baseline_decode_s / baseline) / (modeled / tokens)

    figures_note = ("cache hit rate: rounds whose drafts were in the speculation cache, over the rounds that could "
                    "hit (all but each sample's first); tokens/forward: tokens committed per target forward; "
                    "theoretical: tau*L/(L + f*Ls*k), f the share of rounds the fallback drafted; modeled: AR's "
                    "measured time per token over SSD's with drafting overlapped (max(verify, speculate) + head "
                    "update + fallback per round; [distributed]: each round's times as measured on the two ranks); "
                    "wall-clock: measured, drafting and verifying in turn in one process, overlapped with the "
                    "drafter in a rank of its own ([distributed]); vs synchronous: decode tokens/s over synchronous "
                    "speculative decoding's (each round k drafts by the same drafter, then their verification), "
                    "timed after SSD on every sample")

    @classmethod
    def figures(cls, summary) -> dict[str, float | None]:
        could_hit = summary.steps - summary.samples
        return {"cache hit rate": (summary.stats.cache_hits or 0) / could_hit if could_hit > 0 else None,
                "tokens/forward": summary.tokens_per_step, "theoretical x": cls.theoretical_speedup(summary),
                "modeled x": cls.modeled_speedup(summary), "wall-clock x": summary.wall_clock_speedup,
                "vs synchronous x": cls.synchronous_speedup(summary)}

    @classmethod
    def synchronous_speedup(cls, summary) -> float | None:
        """Decode tokens/s over synchronous speculative decoding's with the same drafter and k, timed beside SSD on
        the same samples (records from before it was timed: None)."""
        ours, decode = summary.tokens_per_second, summary.timing.get("synchronous_decode", 0.0)
        if ours is None or decode <= 0 or summary.stats.synchronous_samples != summary.samples:
            return None
        return ours / ((summary.stats.synchronous_tokens - summary.samples) / decode)

    @classmethod
    def served(cls, params: SSDParams) -> tuple[int, str]:
        return 1, "ssd's drafter takes one"

    @classmethod
    def selfcheck_cases(cls, target) -> list[tuple[str, Method]]:
        head = EagleHead(EagleConfig(ttt=3, num_layers=target.num_layers), target).eval()
        return [("ssd k=3 fan_out=2", cls(target, SSDParams(k=3, fan_out=2, ttt=3), set(), head=head))]

    @classmethod
    def selfcheck_distributed(cls, target, scratch: Path) -> tuple[str, Method, int]:
        """A random head saved as the checkpoint the drafter's rank loads."""
        from harness.runtime import checkpoints

        head, config = scratch / "ssd-head", EagleConfig(ttt=3, num_layers=target.num_layers,
                                                         target=target.identity.to_dict())
        checkpoints.save(head, EagleHead(config, target).eval(),
                         {"eagle": config.to_dict(), "target": config.target, "method": "eagle3"})
        return "ssd k=3 fan_out=2", cls(target, SSDParams(k=3, fan_out=2, ttt=3), set(), checkpoint=str(head)), 1

    def with_oracle(self, reference: dict[int, int], hit_rate: float) -> SSD:
        """A fresh oracle drafter side each call (methods/ssd/speculate.py)."""
        self.speculation = OracleSpeculation(self.drafter, self.params, reference, hit_rate)
        return self

    def __init__(self, target, params: SSDParams, stop_ids, checkpoint=None, head=None):
        super().__init__(target, params, stop_ids, checkpoint)
        self.drafter = build_drafter(target, params, checkpoint, head)
        self.layers = self.drafter.layers
        self.speculation = Speculation(self.drafter, params)  # the drafter side (a variant replaces it)
        self.remote = None  # the drafter's rank, under --executor distributed

    @property
    def depth(self) -> int:
        return self.params.k

    def distribute(self, group, dtype: str):
        """Draft in a rank of `group` of its own from now on (methods/ssd/distributed.py)."""
        from methods.ssd.distributed import RemoteDrafter

        self.remote = RemoteDrafter(group, self, dtype)
        return self.remote

    def session(self, rounds: Rounds, captured: dict, sampler: Sampler, timer: Timer):
        """Speculating rounds here, or the drafter's rank's (`--executor distributed`)."""
        if self.remote is not None:
            return RemoteSession(self, rounds, captured, sampler)
        head = self.drafter.started(self.target.max_len, rounds.prompt_ids, rounds.output[0], captured)
        return SSDSession(self, head)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler) -> Generation:
        saved = None if sampler.generator is None else (sampler.generator.device, sampler.generator.get_state())
        generation = super().generate(prompt_ids, max_new_tokens, sampler)
        self._time_synchronous(generation, prompt_ids, max_new_tokens, Sampler(sampler.config, _restored(saved)))
        return generation

    def _time_synchronous(self, generation: Generation, prompt_ids: list[int], max_new_tokens: int,
                          sampler: Sampler) -> None:
        """Synchronous speculative decoding with the same drafter and k on the same prompt and seed, after SSD: each
        round drafts k tokens from the drafter's own distribution, then verifies them (no speculation cache, no
        Saguaro). Its decode time and tokens go into SSD's record, so "vs synchronous" is measured per sample, as
        AR's is."""
        timer = Timer(self.target.device)
        first, captured = target_prefill(self.target, self.layers, prompt_ids, sampler, timer)
        synchronous = self.synchronous_rounds(prompt_ids, first, captured, max_new_tokens, sampler, timer)
        generation.timing["synchronous_decode"] = synchronous.timing["decode"]
        generation.stats.synchronous_tokens, generation.stats.synchronous_samples = len(synchronous.output_ids), 1

    def synchronous_rounds(self, prompt_ids: list[int], first: int, captured: dict, max_new_tokens: int,
                           sampler: Sampler, timer: Timer) -> Generation:
        """Synchronous speculative decoding with SSD's drafter: each round drafts k tokens from the drafter's own
        distribution (no cache, no Saguaro), then verifies them."""
        def start(rounds, captured, sampler, timer):
            head = self.drafter.started(self.target.max_len, rounds.prompt_ids, rounds.output[0], captured)
            return SynchronousSession(self, head)

        return self.run_rounds(prompt_ids, first, captured, max_new_tokens, sampler, timer,
                               partial(verify, self.target, self.layers), start)

    @classmethod
    def check_simulation(cls, params: SSDParams, temperature: float) -> None:
        if temperature > 0:
            raise ValueError("ssd --simulate is exact only at T=0 (sampled chains need the target's distributions off "
                             "the trajectory); run it without --simulate or at --temperature 0")

    def shape(self) -> DraftShape:
        """What the speedup formulas need: target layers, a drafted token's cost in target layers, k."""
        return DraftShape(self.target.num_layers, self.drafter.cost_layers, self.params.k)


@dataclass
class SSDSession:
    """One generation's speculating drafter in this process (the round kit's RoundSession): each round takes its
    drafts from the cache or the fallback, then speculates the next round's before the verification forward; the
    modeled time takes the two as overlapped (laps: one a round)."""

    method: SSD
    head: object
    drafts: list[Node] | None = None  # nothing is cached before the first round
    cached: bool = False
    cache: dict = field(default_factory=dict)
    hits: list[int] = field(default_factory=list)  # 1 where the round's drafts came from the cache
    fallback_drafts: int = 0  # rounds whose drafts the fallback drafted (jit), the first included
    speculated: int = 0  # chains drafted into the cache

    def draft(self, rounds: Rounds, sampler: Sampler, timer: Timer) -> DraftTree:
        timer.lap()
        speculation, base = self.method.speculation, rounds.position
        tokens, unread = None, Unread()  # a fallback's tokens are read back with the speculation's
        if self.drafts is None:
            self.drafts, tokens = speculation.fallback(self.head, base, sampler, timer, unread)
            self.fallback_drafts += len(self.drafts) > 0
        self.hits.append(int(self.cached))
        with timer("speculate"):
            self.cache = speculation.speculate(self.head, base, self.drafts, sampler, tokens, unread)
        self.speculated += len(self.cache)
        return DraftTree.of_nodes(self.drafts, self.method.target.device)

    def learn(self, rounds: Rounds, outcome: Outcome, new: list[int], timer: Timer) -> None:
        with timer("head_update"):
            feed(self.head, rounds, outcome, new)
        self.drafts = self.cache.get((len(outcome.accepted), outcome.tokens[-1]))
        self.cached = self.drafts is not None

    def finish(self, rounds: Rounds, timer: Timer) -> tuple[Stats, dict]:
        modeled = sum(_modeled(spent) for spent in timer.laps[1:])
        return SSDStats(hits=self.hits, cache_hits=sum(self.hits), fallback_drafts=self.fallback_drafts,
                        speculated=self.speculated, draft=self.method.shape()), {"modeled": modeled}


@dataclass
class SynchronousSession:
    """Synchronous rounds with SSD's drafter (the RoundSession SSD's record is timed beside)."""

    method: SSD
    head: object

    def draft(self, rounds: Rounds, sampler: Sampler, timer: Timer) -> DraftTree:
        drafts = self.method.speculation.draft(self.head, rounds.position, sampler, timer)
        return DraftTree.of_nodes(drafts, self.method.target.device)

    def learn(self, rounds: Rounds, outcome: Outcome, new: list[int], timer: Timer) -> None:
        with timer("head_update"):
            feed(self.head, rounds, outcome, new)

    def finish(self, rounds: Rounds, timer: Timer) -> tuple[Stats, dict]:
        return SSDStats(draft=self.method.shape()), {}


class RemoteSession:
    """The rounds with the drafter in its own rank (`--executor distributed`): verify here, draft there (the same
    cache and fallbacks); the driver waits for each round's drafts."""

    def __init__(self, method: SSD, rounds: Rounds, captured: dict, sampler: Sampler):
        self.method, self.remote = method, method.remote
        if not rounds.done:
            self.remote.start(rounds.prompt_ids, rounds.output[0], captured, sampler)

    def draft(self, rounds: Rounds, sampler: Sampler, timer: Timer) -> DraftTree:
        timer.lap()
        with timer("wait"):  # the drafter's head update and lookup, or its fallback
            return DraftTree.of_nodes(self.remote.drafts(), self.method.target.device)

    def learn(self, rounds: Rounds, outcome: Outcome, new: list[int], timer: Timer) -> None:
        features = {layer: h[:, : len(new)] for layer, h in outcome.features.items()}
        self.remote.outcome(len(outcome.accepted), outcome.tokens[-1], new, features, rounds.done)

    def finish(self, rounds: Rounds, timer: Timer) -> tuple[Stats, dict]:
        hits, drafter, per_round = self.remote.finish(len(rounds.accepted)) if rounds.accepted else ([], {}, [])
        counts = {name: int(drafter.get(name, 0)) for name in ("cache_hits", "fallback_drafts", "speculated")}
        # The one-process model from this run's own times: each round's verification against its speculation.
        verified = [spent.get("verify", 0.0) for spent in timer.laps[1:]]
        modeled = sum(_modeled({"verify": seconds, **drafted}) for seconds, drafted in zip(verified, per_round))
        timing = {"modeled": modeled,
                  **{f"drafter_{name}": drafter.get(name, 0.0) for name in ("speculate", "fallback", "head_update")}}
        return SSDStats(hits=hits, **counts, executor=self.remote.report, draft=self.method.shape()), timing


def _restored(saved: tuple[torch.device, torch.Tensor] | None) -> torch.Generator | None:
    """A generator on its device in the saved state: the synchronous run starts from SSD's seed."""
    if saved is None:
        return None
    device, state = saved
    generator = torch.Generator(device=device)
    generator.set_state(state)
    return generator


def _modeled(spent: dict[str, float]) -> float:
    """One round with the drafter on its own device: the cache is drafted while the target verifies."""
    return max(spent.get("verify", 0.0), spent.get("speculate", 0.0)) + spent.get("head_update", 0.0) + \
        spent.get("fallback", 0.0)

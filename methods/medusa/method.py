"""Medusa (Cai et al., 2024): K heads on the target's last hidden state guess the K tokens after the next one
(methods/medusa/heads.py); their top guesses fill a fixed sparse tree (methods/medusa/tree.py) that the target
verifies in one forward through the round kit, keeping the longest accepted branch and adding its own next token.

The candidates are deterministic (top-k), so at T>0 the kit's sibling rule keeps the output a sample of the target's
distribution; Medusa's typical acceptance, which is not lossless, is not offered.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.runtime.errors import HarnessError
from harness.runtime.target import TargetRuntime
from methods.base import Method, Timer, param, register
from methods.capabilities import ImportFormat, Imports, SelfChecks, Trains
from methods.medusa.heads import MedusaConfig, MedusaHeads, heads_tag, load_heads, train_command
from methods.medusa.interop import import_folder, import_medusa, is_medusa_folder
from methods.medusa.tree import CandidateTree, read_paths
from methods.medusa.session import MedusaSession, MedusaStats, Oracle
from methods.rounds import DraftShape, RoundMethod, Rounds
from methods.sampling import Sampler


@dataclass(frozen=True)
class MedusaParams:
    heads: int = param(4, "Medusa heads: which trained drafter (head k guesses k + 1 tokens past the next).")
    tree: str = param("mc_sim_7b_63", "The candidate tree: mc_sim_7b_63 (the Medusa paper's sparse tree, 63 nodes, 4 "
                                      "deep), small_5 (5 nodes, for a CPU) or a JSON file of paths [[0], [0, 0], [1], "
                                      "...] (each node's rank among its head's guesses per depth).")

    def __post_init__(self):
        if self.heads < 1:
            raise ValueError(f"heads must be >= 1, got {self.heads}")
        deepest = max(len(path) for path in read_paths(self.tree))
        if deepest > self.heads:
            raise ValueError(f"tree {self.tree} is {deepest} deep but there are {self.heads} heads; pass --heads "
                             f"{deepest} or a tree at most {self.heads} deep")


@register
class Medusa(RoundMethod, Trains, Imports, SelfChecks):
    name = "medusa"
    Params = MedusaParams
    Stats = MedusaStats
    training_params = ("heads",)
    imports = {"medusa": ImportFormat("A Medusa head folder (config.json + medusa_lm_head.safetensors or "
                                      "medusa_lm_head.pt, read weights-only).", import_folder, ("heads",))}

    def __init__(self, target, params: MedusaParams, stop_ids, checkpoint=None, heads: MedusaHeads | None = None):
        super().__init__(target, params, stop_ids, checkpoint)
        self.heads = heads or load_heads(target, params.heads, checkpoint)
        if self.heads.config.heads < params.heads:
            have = self.heads.config.heads
            raise HarnessError(f"{checkpoint or 'the drafter'} has {have} heads, fewer than --heads {params.heads}; "
                               f"pass --heads {have} (with a tree at most that deep)")
        self.layers = self.heads.config.all_feature_layers()
        self.tree = CandidateTree.of(read_paths(params.tree), target.device)
        self.oracle: Oracle | None = None

    @property
    def depth(self) -> int:
        return self.tree.shape.levels

    def session(self, rounds: Rounds, captured: dict, sampler: Sampler, timer: Timer) -> MedusaSession:
        return MedusaSession.started(self.heads, self.tree, captured, self.shape(), self.oracle)

    def with_oracle(self, reference: dict[int, int], hit_rate: float) -> Medusa:
        self.oracle = Oracle(reference, hit_rate)  # a fresh draw sequence each call
        return self

    @classmethod
    def training_specs(cls, values: dict[str, list]) -> list:
        """One drafter per head count."""
        from methods.medusa.objective import MedusaSpec

        return [MedusaSpec(heads) for heads in values.get("heads") or [cls.Params().heads]]

    @classmethod
    def drafter(cls, params: MedusaParams) -> tuple[str, str]:
        return heads_tag(params.heads), train_command(params.heads)

    @classmethod
    def import_checkpoint(cls, path: Path, loaded, params: MedusaParams) -> tuple[Path, dict] | None:
        """A Medusa authors' head folder (methods/medusa/interop.py), filed under its head count."""
        if not is_medusa_folder(path):
            return None
        target = TargetRuntime(loaded.model, max_len=8, identity=loaded.identity)
        folder, heads = import_medusa(path, target)
        return folder, {"heads": heads}

    @classmethod
    def theoretical_speedup(cls, summary) -> float | None:
        """Tokens per round: a round is one target forward, the heads' cost (a block and a projection each, run
        once a round) taken as nothing beside it, as the Medusa paper's acceleration rate does."""
        return summary.tokens_per_step

    @classmethod
    def selfcheck_cases(cls, target) -> list[tuple[str, Method]]:
        heads = MedusaHeads(MedusaConfig(heads=4, num_layers=target.num_layers), target).eval()
        return [("medusa mc_sim_7b_63", cls(target, MedusaParams(), set(), heads=heads))]

    def shape(self) -> DraftShape:
        """Target layers, the heads' cost in target layers (none counted), depth and the widest level."""
        depths = self.tree.shape.host[1]
        return DraftShape(self.target.num_layers, 0, self.depth, max(depths.count(d) for d in set(depths)))

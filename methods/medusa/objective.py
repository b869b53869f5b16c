"""What Medusa heads train on: head k's guess at row t against the target's distribution of the token k + 1 places
past the one the target predicts there (row t + k), the heads' losses weighted 0.8^(k-1), as the Medusa paper
weights them. The training loop (harness/training/train.py) calls it through the drafter-kind protocol."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from methods.base import Generation
from methods.draft_module import Prediction
from methods.medusa.heads import MedusaConfig, MedusaHeads, heads_tag
from methods.medusa.session import MedusaSession
from methods.medusa.tree import MC_SIM_7B_63, CandidateTree
from methods.rounds import replay_on

HEAD_DECAY = 0.8


@dataclass
class MedusaSpec:
    heads: int = 4
    method = "medusa"
    group_name = "head"
    config_name = "medusa"

    @property
    def tag(self) -> str:
        return heads_tag(self.heads)

    @property
    def params(self) -> dict:
        return {"heads": self.heads}

    @property
    def groups(self) -> int:
        return self.heads

    def build(self, target, draft_ids) -> MedusaHeads:
        config = MedusaConfig(heads=self.heads, num_layers=target.num_layers, target=target.identity.to_dict(),
                              draft_vocab_size=None if draft_ids is None else len(draft_ids))
        return MedusaHeads(config, target, draft_ids)

    def initialise(self, module: MedusaHeads, target) -> MedusaHeads:
        return module  # zero block weights: every head starts as the target's own LM head

    def predictions(self, module: MedusaHeads, features: dict, ids: torch.Tensor, rngs: list[random.Random],
                    validating: bool = False) -> list[Prediction]:
        size = ids.shape[1]
        logits = module.logits(features[module.config.num_layers])
        return [Prediction(logits[k - 1][:, : size - k], k, HEAD_DECAY ** (k - 1), k - 1)
                for k in range(1, min(self.heads, size - 1) + 1)]

    def replay(self, module: MedusaHeads, teacher, max_new_tokens: int, stop_ids: set[int]) -> Generation:
        """Rounds of the default tree (cut to the heads) on a trajectory, as decoding counts them."""
        tree = CandidateTree.of(tuple(p for p in MC_SIM_7B_63 if len(p) <= self.heads), teacher.ids.device)
        return replay_on(teacher, lambda rounds, captured, *_: MedusaSession.started(module, tree, captured),
                         tree.shape.levels, max_new_tokens, stop_ids)

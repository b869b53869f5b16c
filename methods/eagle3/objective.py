"""What an EAGLE-3 head trains on: one prediction per training-time-test step, from its own states, with
geometrically decaying weights. The training loop (harness/training/train.py) calls it through the drafter-kind
protocol it declares.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from methods.base import Generation
from methods.draft_module import Prediction
from methods.eagle3.head import EagleConfig, EagleHead, head_tag, ttt_logits
from methods.eagle3.replay import chain_accepts, replay_rounds

TTT_DECAY = 0.8  # loss weight of training-time-test step k is TTT_DECAY ** (k - 1)


@dataclass
class EagleSpec:
    """An EAGLE-3 head trained with `ttt` training-time-test steps."""

    ttt: int
    layout: str = "harness"
    method = "eagle3"
    group_name = "step"
    config_name = "eagle"

    @property
    def tag(self) -> str:
        return head_tag(self.ttt, self.layout)

    @property
    def params(self) -> dict:
        return {"ttt": self.ttt} if self.layout == "harness" else {"ttt": self.ttt, "layout": self.layout}

    @property
    def groups(self) -> int:
        return self.ttt

    def build(self, target, draft_ids) -> EagleHead:
        config = EagleConfig(ttt=self.ttt, num_layers=target.num_layers, target=target.identity.to_dict(),
                             draft_vocab_size=None if draft_ids is None else len(draft_ids), layout=self.layout)
        return EagleHead(config, target, draft_ids)

    def initialise(self, module: EagleHead, target) -> EagleHead:
        """The head's one layer reads [embedding, fused feature] (2H wide), unlike any target layer: it always starts
        with its residual branches at zero."""
        return module.start_as_identity()

    def predictions(self, module: EagleHead, features: dict, ids: torch.Tensor, rngs: list[random.Random],
                    validating: bool = False) -> list[Prediction]:
        size = ids.shape[1]
        steps = ttt_logits(module, features, ids, min(self.ttt, size - 1))
        return [Prediction(logits[:, : size - k], k, TTT_DECAY ** (k - 1), k - 1)
                for k, logits in enumerate(steps, start=1)]

    def replay(self, module: EagleHead, teacher, max_new_tokens: int, stop_ids: set[int]) -> Generation:
        """Chain rounds of `ttt` drafts on a trajectory (the exact `--simulate` replay)."""
        return replay_rounds(chain_accepts(module, teacher, self.ttt), teacher, self.ttt, max_new_tokens, stop_ids)

"""What drafts for SSD: a trained EAGLE-3 head, or a standalone draft model that shares the target's tokenizer.

Both give SSD's rounds (methods/ssd/method.py) one interface. `started` opens a generation's session after the target's
prefill: its `root` is the drafter's state after the newest committed token, `append` adds committed tokens (with
the target's features at `layers`, which only the head reads) and `draft_rows` computes the states of drafted
tokens, one tree level at a time, each row seeing the committed prefix and its own ancestors. `logits` turns states
into full-vocabulary draft logits, and `cost_layers` is what drafting one token costs in target layers (the
theoretical speedup's Ls).
"""

from __future__ import annotations

import torch

from harness.runtime.errors import HarnessError
from harness.runtime.target import TargetRuntime
from methods.eagle3.head import EagleHead, HeadSession, load_head
from methods.rounds import Node, tree_mask


class HeadDrafter:
    """An EAGLE-3 head: one layer over the target's fused features and its own states (costs one target layer)."""

    cost_layers = 1

    def __init__(self, head: EagleHead):
        self.head = head
        self.layers = head.config.all_feature_layers()

    def started(self, max_len: int, prompt_ids: list[int], first: int, captured: dict) -> HeadSession:
        return HeadSession.started(self.head, max_len, prompt_ids, first, captured)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.head.full_vocab(self.head.head_logits(states))[0]


class ModelDrafter:
    """A small causal LM with the target's vocabulary, on the shared runtime (its own KV cache, and linear-attention
    states per branch): it reads tokens only, so it needs none of the target's features."""

    layers: tuple[int, ...] = ()

    def __init__(self, runtime: TargetRuntime, cost_layers: float):
        self.runtime = runtime
        self.cost_layers = cost_layers

    @classmethod
    def load(cls, spec: str, target: TargetRuntime) -> ModelDrafter:
        """The draft model `spec` (embedded name, local folder or hub id) on the target's device and dtype."""
        from harness.runtime.models import load_model

        loaded = load_model(spec, str(target.device), str(target.dtype).removeprefix("torch."), tokenizer=False)
        runtime = target.alike(loaded.model, identity=loaded.identity)
        if runtime.config.vocab_size != target.config.vocab_size:
            raise HarnessError(f"draft model {spec} has {runtime.config.vocab_size} token ids, the target "
                               f"{target.config.vocab_size}; pass a --draft-model with the target's tokenizer")
        # Its decoder layers' parameters over one target layer's: what a drafted token costs in target layers.
        # (over the layers this process holds: a drafter rank keeps one, harness/runtime/partial.py)
        held = [layer for layer in target.layers if not isinstance(layer, torch.nn.Identity)]
        per_layer = sum(map(_parameters, held)) / len(held)
        return cls(runtime, round(_parameters(runtime.layers) / per_layer, 3))

    def started(self, max_len: int, prompt_ids: list[int], first: int, captured: dict) -> _ModelRows:
        rows = _ModelRows(self.runtime)
        rows.append(prompt_ids + [first], captured, start=0)
        return rows

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.runtime.logits(states)


def _parameters(layers: torch.nn.Module) -> int:
    return sum(p.numel() for p in layers.parameters())


class _ModelRows:
    """The draft model's side of one generation: token q's KV (and linear state) in slot q, so the committed tokens
    fill slots 0 .. base and a round's drafted node i sits in slot base + 1 + i."""

    def __init__(self, runtime: TargetRuntime):
        self.runtime = runtime
        runtime.reset()
        self.root: torch.Tensor | None = None

    def append(self, tokens: list[int], features: dict, start: int) -> None:
        """Committed tokens at positions start..; the drafted rows above the committed prefix are forgotten first."""
        runtime = self.runtime
        runtime.truncate(start)
        ids = torch.tensor(tokens, device=runtime.device)
        h, _ = runtime.run_layers(0, runtime.num_layers, runtime.embed(ids), range(start, start + len(tokens)))
        self.root = h[:, -1:]

    def draft_rows(self, nodes: list[Node], level: list[int], base: int, tokens: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """States of the nodes of one level (their parents' rows computed before); `tokens` as HeadSession's."""
        runtime, device = self.runtime, self.runtime.device
        if tokens is None:
            tokens = torch.tensor([nodes[i].token for i in level], device=device)
        positions = torch.tensor([base + nodes[i].depth for i in level], device=device)
        slots = torch.tensor([base + 1 + i for i in level], device=device)
        parents = torch.tensor([base + 1 + nodes[i].parent if nodes[i].parent >= 0 else base for i in level],
                               device=device)
        mask = tree_mask(nodes, level, base + 1, base + 1, base + 1 + len(nodes))
        h, _ = runtime.run_layers(0, runtime.num_layers, runtime.embed(tokens), positions, slots=slots, mask=mask,
                                  parents=parents)
        return h


def build_drafter(target: TargetRuntime, params, checkpoint: str | None = None, head: EagleHead | None = None):
    """SSDParams' drafter: the standalone `draft_model` when one is named, else the trained head (or `head`)."""
    if params.draft_model:
        return ModelDrafter.load(params.draft_model, target)
    return HeadDrafter(head or load_head(target, params.ttt, "harness", checkpoint))

"""The distributed stage executor: one process per pipeline stage on torch.distributed.

Rank 0 is the driver: the scheduler, the drafter, the embedding and the verification head live there, as in the
reference's runner, so drafting and verification never queue behind a stage's layers and a stage rank holds only
its own layers. Rank k (1..n) runs stage k-1. Every operation starts with a broadcast of a small control vector from
the driver; hidden states travel point to point, driver -> stage -> driver, so in a pipeline step every stage
computes at once and the step lasts as long as the slowest stage plus the transfers. The driver keeps the features
the drafter reads (a stage sends its output and the captured layers back), which is why the exchange is a star and
not a chain.

The prompt's prefill is staged through the ranks one after another (the same layers the pipeline uses, so no rank
ever holds another's weights). Truncation, sibling moves and resets are broadcast; every rank applies them to its
own caches, attention KV and linear-attention snapshots alike.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from harness.runtime.distributed import STOP, Channel
from harness.runtime.errors import HarnessError
from harness.runtime.target import Positions, TargetRuntime
from methods.base import Timer
from methods.pipeline.executor import StageExecutor
from methods.pipeline.tree import Level, Token, is_chain
from methods.stats import Executor

RESET, PREFILL, ADVANCE, TRUNCATE, MOVE, STATS = range(1, 7)  # after STOP (0), the runtime's
HEADER = 4  # control vector: [op, a, b, c] then per-stage token counts and positions (ADVANCE)


@dataclass
class StagePlan:
    """What every stage rank needs to build its part of the target (sent once by the driver)."""

    model: str
    dtype: str
    weights_sha256: str
    bounds: list[tuple[int, int]]
    capture: tuple[int, ...]
    max_len: int
    rewind_window: int
    compile: str  # the driver's compiled step (off, on, auto): a rank's layers run as the driver's would

    @property
    def n(self) -> int:
        return len(self.bounds)

    @property
    def control_size(self) -> int:
        return HEADER + 2 * self.n

    def server(self, rank: int, device: str, wire: torch.device) -> StageServer:
        """What a served rank runs under this plan (harness/runtime/distributed.py): stage rank - 1."""
        return StageServer(self, rank, device, wire)

    def wanted(self, stage: int) -> tuple[int, ...]:
        """Captured layers a stage returns besides its output (h[0] is the driver's embedding)."""
        lo, hi = self.bounds[stage]
        return tuple(layer for layer in self.capture if lo < layer <= hi)


class DistributedExecutor(StageExecutor):
    """Driver side: sends each level to its stage's rank and collects outputs and features."""

    def __init__(self, group, target: TargetRuntime, bounds: list[tuple[int, int]],
                 capture: tuple[int, ...], width: int, dtype: str):
        super().__init__(target, bounds, capture, width)
        if group.world_size != self.n + 1:
            raise HarnessError(f"the process group has {group.world_size} ranks; --n {self.n} needs {self.n + 1} "
                               f"(one driver and one per stage)")
        self.group = group
        self.plan = StagePlan(group.model, dtype, target.identity.weights_sha256 if target.identity else "",
                              bounds, capture, target.max_len, target.rewind_window, target.compile_mode)
        group.start(self.plan)  # only now are the ranks waited for: a group of the wrong size never is
        self.channel = group.channel("stage", self.device, self.plan.control_size)
        self.stage_seconds = [0.0] * self.n

    # --- wire -------------------------------------------------------------------------------------------------
    def _buffer(self, stage: int, tokens: int) -> torch.Tensor:
        rows = 1 + len(self.plan.wanted(stage))
        return torch.empty(rows, tokens, self.target.config.hidden_size, dtype=self.target.dtype,
                           device=self.group.wire)

    def _unpack(self, stage: int, packed: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        packed = packed.to(self.device)
        return packed[0:1], {layer: packed[i + 1: i + 2] for i, layer in enumerate(self.plan.wanted(stage))}

    # --- StageExecutor ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.channel.control(RESET)

    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        h = self.target.embed(torch.tensor(prompt_ids, device=self.device))
        captured = {0: h} if 0 in self.capture else {}
        for stage in range(self.n):
            self.channel.control(PREFILL, stage, len(prompt_ids))
            packed = self._buffer(stage, len(prompt_ids))
            self.channel.exchange([(stage + 1, h)], [(stage + 1, packed)])
            h, layers = self._unpack(stage, packed)
            captured.update(layers)
        return self.target.logits(h)[-1], captured

    def advance(self, levels: list[Level]) -> None:
        chain, base = is_chain(levels), levels[0][0].position
        kv_end = base + self.n * self.width
        counts, positions = [0] * self.n, [0] * self.n
        outgoing, incoming = [], []
        for level in levels:
            stage, rank = level[0].depth, level[0].depth + 1
            counts[stage], positions[stage] = len(level), level[0].position
            call = self.stage_call(level, chain, base, kv_end)
            outgoing.append((rank, call.hidden))
            if not chain:
                slots, parents = (torch.tensor(v, device=self.device) for v in (call.slots, call.parents))
                outgoing += [(rank, slots), (rank, call.mask.to(torch.uint8)), (rank, parents)]
            incoming.append((rank, self._buffer(stage, len(level))))
        self.channel.control(ADVANCE, int(chain), kv_end, tail=counts + positions)
        self.channel.exchange(outgoing, incoming)
        for level, (_, packed) in zip(levels, incoming):
            self.absorb(level, *self._unpack(level[0].depth, packed))

    def verification_logits(self, finished: Token) -> torch.Tensor:
        return self.target.logits(finished.hidden)[0]

    def truncate(self, position: int) -> None:
        self.channel.control(TRUNCATE, position)

    def commit(self, chosen: Token) -> None:
        if chosen.slot != chosen.position:
            self.channel.control(MOVE, chosen.slot, chosen.position)
            chosen.slot = chosen.position

    def report(self) -> Executor:
        """Executor, world size, devices and each stage's forward seconds in this generation's pipeline steps."""
        self.channel.control(STATS)
        seconds = [torch.zeros(1, dtype=torch.float64, device=self.group.wire) for _ in range(self.n)]
        self.channel.exchange([], [(stage + 1, t) for stage, t in enumerate(seconds)])
        return Executor("distributed", self.group.backend, self.group.world_size, self.group.devices,
                        [round(float(t), 6) for t in seconds])

    def close(self) -> None:
        self.channel.control(STOP)


# --- stage ranks ------------------------------------------------------------------------------------------------
def load_stage(plan: StagePlan, stage: int, device: str) -> TargetRuntime:
    """The target with only this stage's layers, read alone from its files (harness/runtime/partial.py)."""
    from transformers.utils import logging as hf_logging

    from harness.runtime.partial import Part, load_part

    hf_logging.disable_progress_bar()  # n ranks loading at once would print n bars
    loaded = load_part(plan.model, Part(*plan.bounds[stage]), device, plan.dtype, plan.weights_sha256)
    return TargetRuntime(loaded.model, max_len=plan.max_len, rewind_window=plan.rewind_window,
                         identity=loaded.identity, compile=plan.compile)


class StageServer:
    """One stage rank: the driver's operations on this stage's layers and caches, answered when asked."""

    def __init__(self, plan: StagePlan, rank: int, device: str, wire: torch.device):
        self.rank, self.stage = rank, rank - 1
        self.plan = plan
        self.runtime = load_stage(self.plan, self.stage, device)
        self.channel = Channel(wire, self.runtime.device, plan.control_size)
        self.lo, self.hi = self.plan.bounds[self.stage]
        self.wanted = self.plan.wanted(self.stage)
        self.timer = Timer(self.runtime.device)

    def serve(self) -> None:
        self.channel.serve({RESET: self._reset, TRUNCATE: lambda v: self.runtime.truncate(v[0]), MOVE: self._move,
                            STATS: self._stats, PREFILL: self._prefill, ADVANCE: self._advance})

    def _reset(self, values: list[int]) -> None:
        self.runtime.reset()
        self.timer = Timer(self.runtime.device)

    def _move(self, values: list[int]) -> None:
        self.runtime.cache.move([values[0]], values[1])

    def _stats(self, values: list[int]) -> None:
        self.channel.send(torch.tensor([self.timer.totals.get("forward", 0.0)], dtype=torch.float64), 0)

    def _prefill(self, values: list[int]) -> None:
        stage, length = values[:2]
        if stage == self.stage:  # the prompt passes the stages one after another
            self._forward(length, range(length), chain=True, kv_end=length, step=False)

    def _advance(self, values: list[int]) -> None:
        chain, kv_end = values[:2]
        tail = values[HEADER - 1:]  # per-stage token counts, then positions
        count = tail[self.stage]
        if count:
            position = tail[self.plan.n + self.stage]
            positions = range(position, position + count) if chain else torch.full((count,), position)
            self._forward(count, positions, chain=bool(chain), kv_end=kv_end)

    def _receive(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.channel.recv(shape, dtype, 0)

    def _forward(self, count: int, positions: Positions, chain: bool, kv_end: int, step: bool = True) -> None:
        """Run this stage's layers on what the driver sends and return output and features; pipeline steps (not the
        prefill) count towards the stage's forward seconds."""
        runtime = self.runtime
        h = self._receive((1, count, runtime.config.hidden_size), runtime.dtype)
        slots = mask = parents = None
        if not chain:
            slots = self._receive((count,), torch.long)
            mask = self._receive((count, kv_end), torch.uint8).bool()
            parents = self._receive((count,), torch.long)
        with self.timer("forward") if step else nullcontext():
            out, captured = runtime.run_layers(self.lo, self.hi, h, positions, slots=slots, mask=mask,
                                               parents=parents, capture=self.wanted)
        packed = torch.cat([out, *(captured[layer] for layer in self.wanted)], dim=0)
        self.channel.send(packed, 0)

"""SSD across two processes: the target verifies on the driver while the drafter, in a rank of its own, drafts the
speculation cache for the next round (methods/ssd/method.py holds the algorithm; this file moves it across ranks).

Per generation the driver sends the prompt's target features after its prefill (those the drafter reads: a head's
layers, none for a draft model). Per round the drafter sends the round's drafts, drafts the cache while the driver
verifies them, then receives the outcome (accepted count, bonus token, the committed tokens and their features),
updates its state and answers with the next round's drafts: from the cache on a hit, from the fallback on a miss.
Drafting the cache overlaps verification for real; what the driver waits for between rounds is the update plus the
lookup, or the fallback. At the end of a generation the drafter reports its seconds per round, from which the
driver models the overlap as the one-process run does. A generation starts with a control vector and everything
else is point to point between rank 0 and rank 1, through the wire every served family shares (Channel in
harness/runtime/distributed.py), which bounds every wait by the run deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.runtime.distributed import STOP, Channel
from harness.runtime.errors import HarnessError
from harness.runtime.target import TargetRuntime
from methods.base import Timer
from methods.rounds import Node
from methods.sampling import Sampler, SamplingConfig
from methods.ssd.drafters import build_drafter
from methods.stats import Executor

START = 1  # the one operation after STOP (0, the runtime's): a generation; its rounds follow point to point
HEADER = 4  # control vector: [START, prompt length, first token, seed]
STATS = ("cache_hits", "fallback_drafts", "speculated", "speculate", "fallback", "head_update")
ROUND_SECONDS = ("fallback", "speculate", "head_update")  # the drafter's per round, for the modeled time


@dataclass
class DrafterPlan:
    """What the drafter rank needs to build its side (sent once by the driver)."""

    model: str
    dtype: str
    weights_sha256: str
    params: object  # SSDParams
    checkpoint: str | None
    max_len: int
    speculation: type  # the driver's Speculation class: a variant (a test's oracle) drafts the same way there
    state: dict  # its constructor arguments beyond the drafter and params (Speculation.plan_state)
    compile: str  # the driver's compiled step (off, on, auto): the drafter's layers run as the driver's would

    def server(self, rank: int, device: str, wire: torch.device) -> DrafterServer:
        """What a served rank runs under this plan (harness/runtime/distributed.py)."""
        return DrafterServer(self, device, wire)


class RemoteDrafter:
    """Driver side: hands the drafter rank each generation's prompt and each round's outcome, receives drafts."""

    def __init__(self, group, method, dtype: str):
        if group.world_size != 2:
            raise HarnessError(f"the process group has {group.world_size} ranks; ssd needs 2 (driver and drafter)")
        target = method.target
        self.target, self.layers, self.k = target, tuple(method.drafter.layers), method.params.k
        # the record's executor (the report labels such runs)
        self.report = Executor("distributed", group.backend, group.world_size, group.devices)
        speculation = method.speculation
        plan = DrafterPlan(group.model, dtype, target.identity.weights_sha256 if target.identity else "",
                           method.params, method.checkpoint, target.max_len, type(speculation),
                           speculation.plan_state(), target.compile_mode)
        self.group = group
        group.start(plan)
        self.channel = group.channel("drafter", target.device, HEADER)

    def _send(self, tensor: torch.Tensor) -> None:
        self.channel.send(tensor, 1)

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.channel.recv(shape, dtype, 1)

    def _features(self, captured: dict[int, torch.Tensor]) -> None:
        if self.layers:  # a draft model reads none
            self._send(torch.cat([captured[layer] for layer in self.layers], dim=0))

    def start(self, prompt_ids: list[int], first: int, captured: dict, sampler: Sampler) -> None:
        """A generation: the prompt, its first token and the head's features over the prompt; the drafter's own
        sampler is seeded from the driver's, so a seeded run repeats."""
        seed = 0 if sampler.greedy else sampler.seed()
        config = sampler.config
        self.channel.control(START, len(prompt_ids), first, seed)
        self._send(torch.tensor([config.temperature, config.top_k, config.top_p], dtype=torch.float64))
        self._send(torch.tensor(prompt_ids, dtype=torch.long))
        self._features(captured)

    def drafts(self) -> list[Node]:
        """The round's drafts, a chain (with the distributions they were sampled from at T > 0)."""
        head = self._recv((2 + self.k,), torch.long)
        count, sampled = int(head[0]), bool(head[1])
        q = self._recv((count, self.target.config.vocab_size), torch.float32) if sampled and count else None
        return [Node(int(head[2 + i]), i - 1, i + 1, q=None if q is None else q[i]) for i in range(count)]

    def outcome(self, accepted: int, bonus: int, new: list[int], features: dict, done: bool) -> None:
        self._send(torch.tensor([accepted, bonus, len(new), int(done)], dtype=torch.long))
        self._send(torch.tensor(new, dtype=torch.long))
        self._features(features)

    def finish(self, rounds: int) -> tuple[list[int], dict[str, float], list[dict[str, float]]]:
        """After the last outcome: which rounds hit the cache, the drafter's counts and seconds, and its seconds per
        round (ROUND_SECONDS)."""
        hits = self._recv((rounds,), torch.long).tolist()
        stats = self._recv((len(STATS),), torch.float64).tolist()
        per_round = self._recv((rounds, len(ROUND_SECONDS)), torch.float64).tolist()
        return hits, dict(zip(STATS, stats)), [dict(zip(ROUND_SECONDS, row)) for row in per_round]

    def close(self) -> None:
        self.channel.control(STOP)


class DrafterServer:
    """The drafter rank: SSD's drafter side (methods/ssd/speculate.py) drafting rounds and speculation caches."""

    def __init__(self, plan: DrafterPlan, device: str, wire: torch.device):
        from transformers.utils import logging as hf_logging

        from harness.runtime.partial import Part, load_part

        hf_logging.disable_progress_bar()
        # A head reads only the target's embedding, final norm, head and rotary embedding (its frozen parts) and
        # builds its layer as the target's first: the rank loads those alone (harness/runtime/partial.py).
        loaded = load_part(plan.model, Part(0, 1, embedding=True, norm=True, head=True), device, plan.dtype,
                           plan.weights_sha256)
        target = TargetRuntime(loaded.model, max_len=plan.max_len, identity=loaded.identity, compile=plan.compile)
        drafter = build_drafter(target, plan.params, plan.checkpoint)
        self.speculation = plan.speculation(drafter, plan.params, **plan.state)
        self.plan, self.device = plan, target.device
        self.channel = Channel(wire, target.device, HEADER)
        self.layers = tuple(drafter.layers)
        self.hidden, self.dtype = target.config.hidden_size, target.dtype

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.channel.recv(shape, dtype, 0)

    def _send(self, tensor: torch.Tensor) -> None:
        self.channel.send(tensor, 0)

    def _features(self, count: int) -> dict[int, torch.Tensor]:
        if not self.layers:
            return {}
        packed = self._recv((len(self.layers), count, self.hidden), self.dtype)
        return {layer: packed[i: i + 1] for i, layer in enumerate(self.layers)}

    def serve(self) -> None:
        self.channel.serve({START: lambda values: self._generation(*values[:3])})

    def _generation(self, prompt_len: int, first: int, seed: int) -> None:
        temperature, top_k, top_p = self._recv((3,), torch.float64).tolist()
        sampler = Sampler(SamplingConfig(temperature, int(top_k), top_p),
                          torch.Generator(device=self.device).manual_seed(seed))
        prompt = self._recv((prompt_len,), torch.long).tolist()
        speculation, timer = self.speculation, Timer(self.device)
        head = speculation.drafter.started(self.plan.max_len, prompt, first, self._features(prompt_len))
        base, hits, counts = prompt_len, [], dict.fromkeys(STATS[:3], 0)
        # a round's lap: its fallback (on a miss), its speculation, its head update
        (drafts, _), cached = speculation.fallback(head, base, sampler, timer), False
        counts["fallback_drafts"] += len(drafts) > 0
        while True:
            hits.append(int(cached))
            self._send_drafts(drafts, sampler.greedy)
            with timer("speculate"):  # while the driver verifies this round
                cache = speculation.speculate(head, base, drafts, sampler)
            counts["speculated"] += len(cache)
            accepted, bonus, count, done = self._recv((4,), torch.long).tolist()
            new, features = self._recv((count,), torch.long).tolist(), self._features(count)
            if not done:
                with timer("head_update"):
                    head.append(new, features, start=base + 1)
            timer.lap()
            if done:
                break
            base += count
            drafts = cache.get((accepted, bonus))
            cached = drafts is not None
            if drafts is None:
                drafts, _ = speculation.fallback(head, base, sampler, timer)
                counts["fallback_drafts"] += len(drafts) > 0
        counts["cache_hits"] = sum(hits)
        per_round = [[spent.get(name, 0.0) for name in ROUND_SECONDS] for spent in timer.laps[:-1]]
        self._send(torch.tensor(hits, dtype=torch.long))
        self._send(torch.tensor([counts[s] for s in STATS[:3]] + [timer.totals.get(s, 0.0) for s in STATS[3:]],
                                dtype=torch.float64))
        self._send(torch.tensor(per_round, dtype=torch.float64))

    def _send_drafts(self, drafts: list[Node], greedy: bool) -> None:
        k = self.plan.params.k
        head = torch.zeros(2 + k, dtype=torch.long)
        head[0], head[1] = len(drafts), int(not greedy)
        head[2: 2 + len(drafts)] = torch.tensor([d.token for d in drafts], dtype=torch.long)
        self._send(head)
        if not greedy and drafts:
            self._send(torch.stack([d.q for d in drafts]).float())

"""Train/decode parity of a pipeline drafter: does decoding hand the drafter the states training taught it on?

For one token trajectory (the greedy AR output of a prompt) the drafter's top-1 for every (position, fill level)
is computed three ways:
- the training layout: `grouped_logits` over the teacher's features, exactly as `spd-bench train` runs it, once
  per segment phase (flushes every n positions, offset 0..n-1 puts every position at every fill level);
- the decoding engine: `PipelineEngine` decodes the prompt at T=0 (its output is the trajectory) with a drafter
  that records every draft it makes, so only the states decoding visits are compared;
- the acceptance replay (`--simulate`): its accepted/rejected verdict for every reachable state.
On a correct implementation all three agree on every state; a disagreement names the position and fill level.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from methods.pipeline.drafter import Drafter
from methods.pipeline.grouped_layout import grouped_logits
from methods.pipeline.replay import fill_state_accepts
from methods.pipeline.scheduler import PipelineEngine, fill_level
from methods.pipeline.speculator import Speculator
from methods.sampling import Sampler, SamplingConfig
from methods.teacher import Teacher

TIE = 1e-4  # top-1 minus top-2 draft logit below this: a near-tie that summation order may flip


def max_fill(speculator: Speculator) -> int:
    """Highest fill level decoding reaches: n-1 in-flight tokens older than the query (input), n-2 (output)."""
    return max(0, speculator.config.n - 1 - speculator.config.query_depth)


def training_view(speculator: Speculator, features: dict[int, torch.Tensor]) -> torch.Tensor:
    """[F+1, S] full-vocabulary top-1 draft from the training layout for position T+1 made at fill f."""
    n = speculator.config.n
    size = next(iter(features.values())).shape[1]
    view = torch.full((max_fill(speculator) + 1, size), -1, dtype=torch.long)
    positions = torch.arange(size)
    for offset in range(n):
        # Flushes at offset, offset + n, ...: position T sits (T - offset) mod n tokens into its segment.
        starts = torch.where(positions < offset, 0, offset + (positions - offset) // n * n)
        fills = torch.clamp(positions - starts, max=n - 1)
        logits = grouped_logits(speculator, features, starts[None].to(speculator.head.weight.device))[0]
        top1 = speculator.full_vocab(logits).argmax(-1).cpu()
        keep = fills <= max_fill(speculator)
        view[fills[keep], positions[keep]] = top1[keep]
    return view


@dataclass
class Draft:
    """One draft the engine made: for `position`, at `fill`, its top-1, the top-1 minus top-2 logit and the tokens in
    flight (position -> token) it was drafted from."""

    position: int
    fill: int
    token: int
    margin: float
    in_flight: dict[int, int]


class RecordingDrafter(Drafter):
    """The engine's drafter, unchanged, writing down the newest leaf's top-1 at every call."""

    def __init__(self, speculator: Speculator, max_len: int, log: list[Draft]):
        super().__init__(speculator, max_len)
        self.log = log

    def logits(self, finished, levels):
        logits = super().logits(finished, levels)
        newest = levels[-1][0].position if levels else finished[-1].position
        top = torch.topk(logits[0], 2).values
        in_flight = {t.position: t.token for level in levels for t in level}
        self.log.append(Draft(newest + 1, fill_level(levels), int(logits[0].argmax()), float(top[0] - top[1]),
                              in_flight))
        return logits


def decoding_view(engine: PipelineEngine, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[Draft]]:
    """The engine's greedy output and every draft it made on the way."""
    log: list[Draft] = []
    recording = PipelineEngine(engine.target, engine.speculator, engine.stop_ids, width=1,
                               drafter_class=lambda spec, max_len: RecordingDrafter(spec, max_len, log))
    output = recording.generate(prompt_ids, max_new_tokens, Sampler(SamplingConfig())).output_ids
    return output, log


@dataclass
class FillParity:
    """Figures of one fill level over the compared trajectories."""

    states: int = 0  # (position, fill) states the engine drafted from with only trajectory tokens in flight
    disagree: int = 0  # of those, engine top-1 != training-layout top-1
    ties: int = 0  # of the disagreements, near-ties (margin < TIE)
    decode_hits: int = 0  # engine drafts equal to the trajectory token
    train_hits: int = 0  # training-layout drafts equal to the trajectory token, same states
    all_states: int = 0  # every reachable state of the trajectories (what validation averages over)
    all_train_hits: int = 0
    replay_disagree: int = 0  # replay verdict != (training-layout top-1 == trajectory token), all states

    def add(self, other: FillParity) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class Parity:
    fills: list[FillParity]
    mismatches: list[dict] = field(default_factory=list)  # the first disagreements, for the report
    lossless: bool = True  # the engine's output equalled the trajectory

    @property
    def disagree(self) -> int:
        return sum(f.disagree - f.ties for f in self.fills) + sum(f.replay_disagree for f in self.fills)

    def add(self, other: Parity) -> None:
        for mine, theirs in zip(self.fills, other.fills):
            mine.add(theirs)
        self.mismatches += other.mismatches[: max(0, 20 - len(self.mismatches))]
        self.lossless &= other.lossless

    def record(self) -> dict:
        return {"fills": [asdict(f) for f in self.fills], "mismatches": self.mismatches, "lossless": self.lossless}

    def table(self) -> str:
        """One line per fill level: decoding's states and hits beside the training layout's on the same states."""
        from tabulate import tabulate

        rows = [(fill, f.states, f.disagree, f.ties, _rate(f.decode_hits, f.states), _rate(f.train_hits, f.states),
                 "|", f.all_states, _rate(f.all_train_hits, f.all_states), f.replay_disagree)
                for fill, f in enumerate(self.fills)]
        lines = [tabulate(rows, headers=["fill", "states", "disagree", "ties", "decode_acc", "train_acc", "|",
                                         "all_states", "train_acc_all", "replay_disagree"], disable_numparse=True)]
        for m in self.mismatches[:10]:
            lines.append(f"mismatch at position {m['position']} fill {m['fill']}: decode {m['decode']} train "
                         f"{m['train']} (decode margin {m['margin']})")
        if not self.lossless:
            lines.append("the engine's output differs from greedy AR: the comparison covers its own trajectory only")
        return "\n".join(lines)


def _rate(hits: int, total: int) -> str:
    return f"{hits / total:.3f}" if total else "—"


@torch.inference_mode()
def compare(engine: PipelineEngine, prompt_ids: list[int], trajectory: list[int], max_new_tokens: int) -> Parity:
    """The three views of the drafter on `trajectory` (the greedy AR output for `prompt_ids`)."""
    speculator, target = engine.speculator, engine.target
    teacher = Teacher.run(target, prompt_ids, trajectory, engine.capture, Sampler(SamplingConfig()))
    train = training_view(speculator, teacher.features)
    output, drafts = decoding_view(engine, prompt_ids, max_new_tokens)
    parity = Parity([FillParity() for _ in range(max_fill(speculator) + 1)], lossless=output == trajectory)
    for draft in drafts:
        if draft.position >= teacher.length or any(teacher.token(p) != t for p, t in draft.in_flight.items()):
            continue  # past the trajectory's end, or from a wrong draft in flight: flushed before it is verified
        expected, trained = teacher.token(draft.position), int(train[draft.fill, draft.position - 1])
        figures = parity.fills[draft.fill]
        figures.states += 1
        figures.decode_hits += draft.token == expected
        figures.train_hits += trained == expected
        if draft.token != trained:
            figures.disagree += 1
            figures.ties += draft.margin < TIE
            parity.mismatches.append({"position": draft.position, "fill": draft.fill, "decode": draft.token,
                                      "train": trained, "margin": round(draft.margin, 6)})
    replay = fill_state_accepts(speculator, teacher)
    for fill, figures in enumerate(parity.fills):
        reachable = ~torch.isnan(replay[:, fill])
        hits = train[fill, :-1] == teacher.ids[1:].cpu()
        figures.all_states += int(reachable.sum())
        figures.all_train_hits += int(hits[reachable[:-1]].sum())
        figures.replay_disagree += int(((replay[:-1, fill] > 0.5) != hits)[reachable[:-1]].sum())
    return parity

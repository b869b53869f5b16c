"""Drafter training by distillation: one loop, one corpus, one teacher pass shared by every drafter trained together.

The frozen target runs once per training chunk and yields the hidden states every drafter needs plus its
next-token distribution (kept on disk by harness/training/features.py, so later epochs and runs read them back); each
drafter takes its training forward on those features and a KL(target || drafter) step at T=1 over assistant
tokens. Checkpoints (safetensors + JSON) are written periodically and resumed from.

Under torchrun every rank takes its rows of each global batch and the drafters' gradients are summed over the ranks
(harness/training/ranks.py); the loss divides by the global count of assistant tokens, so any world size trains the
objective one process would on the same global batch. Only rank 0 validates and writes checkpoints and records.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from itertools import islice
from pathlib import Path

import torch
from tqdm import tqdm

from harness.runtime import checkpoints
from harness.runtime.errors import HarnessError
from harness.runtime.models import LoadedModel, load_model, resolve_model_dir, stop_ids
from harness.runtime.partial import Part, load_part
from harness.runtime.results import ResultStore
from harness.runtime.target import TargetRuntime
from harness.training import sources
from harness.training.corpus import conversations, encode
from harness.training.draft_vocab import read_draft_vocab
from harness.training.features import FeatureCache, draft_probabilities, teacher_pass
from harness.training.heldout import Trajectories, decoding_figures, first_turns, greedy_trajectories
from harness.training.ranks import ALONE, Ranks, join, rank_device
from harness.training.regenerate import self_distilled
from methods.base import check_fit
from methods.draft_module import DrafterKind


@dataclass
class TrainConfig:
    drafters: list[DrafterKind]  # each family's (its objective.py), from Trains.training_specs
    model: str = "smollm2-135m"
    tokens: int = 1_000_000  # target tokens through the teacher
    epochs: int = 1  # passes over those tokens; later passes read the teacher's outputs from the feature cache
    feature_cache: bool = True  # keep the teacher's outputs on disk (harness/training/features.py) for later epochs and runs
    teacher: str = "online"  # offline: training reads the feature cache only (`prepare_features` wrote it)
    seq_len: int = 256
    batch_size: int = 4  # chunks per rank and step
    global_batch: int = 0  # chunks per step over all ranks (0: batch_size x ranks; resolved by `for_ranks`)
    lr: float = 1e-4
    warmup: float = 0.05  # fraction of steps
    clip: float = 1.0
    draft_vocab: int = 8192  # 0: the full vocabulary
    draft_vocab_file: str | None = None  # the ids from a file instead (draft_vocab.py: the reference's JSON)
    corpus: str = "sharegpt"  # a --corpus spec (sources.py): sharegpt, self (regenerate.py), files, datasets, mixed
    reply_tokens: int = 256  # longest regenerated reply
    autocast: bool = True  # forward/backward on a bf16 copy under autocast (fp32 master weights); validation in fp32
    val_conversations: int = 64
    val_chunks: int = 8
    val_prompts: int = 8  # held-out first turns decoded greedily: validation counted as decoding counts (0: off)
    val_new_tokens: int = 64
    save_every: int = 50
    seed: int = 0
    device: str = "cpu"
    dtype: str | None = None
    resume: bool = False
    timeout: float = 1800.0  # seconds a rank may wait for another (rank 0 validates meanwhile)
    command: str = ""

    @property
    def global_size(self) -> int:
        return self.global_batch or self.batch_size

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.tokens / (self.seq_len * self.global_size)))

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def batch_chunks(self, step: int) -> list[int]:
        """Chunk indices of a step's global batch: the first epoch in corpus order, each later one in a seeded
        shuffle (so a resumed run visits exactly what an uninterrupted one would, on any world size)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = list(range(self.steps_per_epoch * self.global_size))
        if epoch:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order[within * self.global_size:(within + 1) * self.global_size]

    def rows(self, step: int, rank: int) -> tuple[list[int], list[int]]:
        """A rank's share of step `step`: its chunk indices and their rows in the global batch."""
        rows = list(range(rank * self.batch_size, (rank + 1) * self.batch_size))
        chunks = self.batch_chunks(step)
        return [chunks[row] for row in rows], rows

    def row_rngs(self, step: int, rows) -> list[random.Random]:
        """One generator per row of the global batch (an objective's training-time draws, e.g. simulated pipeline
        flushes), so a row draws alike whichever rank holds it."""
        return [random.Random(f"{self.seed}-{step}-{row}") for row in rows]


def for_ranks(config: TrainConfig, ranks: Ranks, saved_global: int | None) -> TrainConfig:
    """`config` with its global batch fixed (a resumed run's own, else --global-batch, else --batch-size x ranks) and
    its per-rank batch the global one over the ranks."""
    wanted = config.global_batch or config.batch_size * ranks.world
    if saved_global and config.global_batch and config.global_batch != saved_global:
        raise HarnessError(f"--global-batch {config.global_batch} differs from the resumed run's {saved_global}; "
                           f"drop it (a resumed run keeps its schedule)")
    size = saved_global or wanted
    if size % ranks.world:
        low, high = size // ranks.world * ranks.world, -(-size // ranks.world) * ranks.world
        why = "the resumed run's global batch" if saved_global else "--global-batch"
        raise HarnessError(f"{why} {size} does not divide over {ranks.world} ranks; "
                           + (f"use {low} or {high}" if not saved_global else
                              "resume on a world size that divides it") + " (a step's chunks split evenly)")
    return replace(config, global_batch=size, batch_size=size // ranks.world)


@dataclass
class Chunk:
    ids: torch.Tensor  # [S]
    loss_mask: torch.Tensor  # [S] bool: position T predicts an assistant token at T+1


def _chunks(loaded: LoadedModel, convs: list[list[dict]], seq_len: int) -> list[Chunk]:
    """Pack conversations into a token stream and cut it into fixed-length chunks that contain assistant tokens."""
    ids, assistant = [], []
    for messages in convs:
        example = encode(loaded.tokenizer, messages, max_tokens=8 * seq_len)
        if any(example.assistant):  # a long user turn can fill the token cap: nothing to learn from it
            ids += example.ids
            assistant += example.assistant
    out = []
    for start in range(0, len(ids) - seq_len, seq_len):
        chunk_ids = torch.tensor(ids[start:start + seq_len])
        predicts_assistant = torch.tensor(assistant[start + 1:start + seq_len + 1] + [False])[:seq_len]
        if predicts_assistant.any():  # the token budget goes to chunks that carry a loss
            out.append(Chunk(chunk_ids, predicts_assistant))
    return out


# Assistant text of the corpus counted for the draft vocabulary whatever the budget (about 500k tokens): counted in
# characters, so where the count stops is known before anything is tokenised, and so is the same on every world size.
VOCAB_COUNT_CHARS = 2_000_000


def draft_vocabulary(loaded: LoadedModel, convs: list[list[dict]], chunks: list[Chunk], size: int,
                     ranks: Ranks = ALONE) -> torch.Tensor | None:
    """The `size` most frequent assistant tokens (ids in the target vocabulary; ties to the lower id) of the
    training slice plus the corpus's first VOCAB_COUNT_CHARS characters of assistant text: a small training budget
    must not shrink the vocabulary to the few tokens its slice happens to contain. Each rank counts its share and
    the counts are summed, so every rank holds the same ids."""
    if size <= 0:
        return None
    counts = torch.zeros(max(len(loaded.tokenizer), loaded.model.config.vocab_size), dtype=torch.long)
    for chunk in chunks[ranks.rank::ranks.world]:
        counts += torch.bincount(chunk.ids[chunk.loss_mask], minlength=counts.numel())[:counts.numel()]
    for messages in _counted(convs)[ranks.rank::ranks.world]:
        example = encode(loaded.tokenizer, messages, max_tokens=4096)
        assistant = torch.tensor([t for t, keep in zip(example.ids, example.assistant) if keep], dtype=torch.long)
        counts += torch.bincount(assistant, minlength=counts.numel())[:counts.numel()]
    ranks.sum(counts)
    order = torch.sort(-counts, stable=True).indices[:size]  # most frequent first; stable: ties by id
    return torch.sort(order[counts[order] > 0]).values


def _counted(convs: list[list[dict]]) -> list[list[dict]]:
    """The first conversations whose assistant text reaches VOCAB_COUNT_CHARS."""
    chars = 0
    for index, messages in enumerate(convs):
        if chars >= VOCAB_COUNT_CHARS:
            return convs[:index]
        chars += sum(len(m["content"]) for m in messages if m["role"] == "assistant")
    return convs


class DrafterTrainer:
    """One drafter's module, optimiser, schedule and checkpoint folder."""

    def __init__(self, spec: DrafterKind, config: TrainConfig, target: TargetRuntime, draft_ids,
                 ranks: Ranks = ALONE):
        self.spec, self.config, self.ranks = spec, config, ranks
        self.folder = checkpoints.drafter_dir(target.identity, spec.method, spec.tag)
        # fp32 master weights: what the optimiser updates, the checkpoint holds and validation runs; rank 0
        # initialises them and every other rank takes its weights (`start_alike`, `resume`)
        module = spec.build(target, draft_ids)
        self.module = (spec.initialise(module, target) if ranks.lead else module).float().train()
        self.trained = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trained, lr=config.lr, weight_decay=0.0)
        # Under autocast the forward and backward run on a bf16 copy, so activations stay bf16 from layer to layer:
        # with fp32 weights, autocast casts every linear layer's input again (about a tenth of a step). The
        # numbers are autocast's either way (bf16 matmuls, norms in fp32, weight gradients from bf16 matmuls).
        self.work, self._pairs = self.module, []  # without autocast the master itself runs: nothing to copy
        if config.autocast:
            self.work = spec.build(target, draft_ids)
            self.work.load_state_dict(self.module.state_dict())
            self.work.to(torch.bfloat16).train()
            self._pairs = [(master, work) for master, work in zip(self.module.parameters(), self.work.parameters())
                           if master.requires_grad]
        self.step, self.tokens, self.validation = 0, 0, {}
        self.curve: list[dict] = []  # the validation at every checkpoint, with the tokens seen by then

    def learning_rate(self) -> float:
        """Linear warm-up, then linear decay to zero at the last step."""
        steps, warmup = self.config.steps, max(1, int(self.config.warmup * self.config.steps))
        return self.config.lr * min((self.step + 1) / warmup, max(0.0, (steps - self.step) / max(1, steps - warmup)))

    def train_step(self, features: dict, ids: torch.Tensor, p_draft: torch.Tensor, mask: torch.Tensor,
                   rngs: list[random.Random]) -> dict:
        """One optimiser step on this rank's rows (one generator per row); the loss and top-1 are the global
        batch's."""
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=self.config.autocast):
            predictions = self.spec.predictions(self.work, features, ids, rngs)
        # Each prediction's loss is a mean over the global batch's assistant rows: every rank divides its sum by
        # the count over all ranks, so the ranks' summed gradients are one process's.
        counts = self.ranks.sum(torch.stack([_aligned(pred, p_draft, mask)[1].sum() for pred in predictions]))
        loss = sum(pred.weight * _cross_entropy(pred, p_draft, mask, count)
                   for pred, count in zip(predictions, counts))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for master, work in self._pairs:
            master.grad, work.grad = (None if work.grad is None else work.grad.float()), None
        first = predictions[0]
        target, rows = _aligned(first, p_draft, mask)
        hits = (first.logits.argmax(-1) == target.argmax(-1))[rows].float().sum()
        loss_sum, hits = self.ranks.sum_grads(self.trained, torch.stack([loss.detach().float(), hits]))
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.config.clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate()
        self.optimizer.step()
        self._sync()
        self.step += 1
        return {"loss": loss_sum.item(), "top1": (hits / counts[0].clamp(min=1)).item()}

    def _sync(self) -> None:
        """The bf16 working copy takes the master weights."""
        with torch.no_grad():
            for master, work in self._pairs:
                work.copy_(master)

    def state(self) -> dict[str, torch.Tensor]:
        tensors = {}
        names = {id(p): name for name, p in self.module.named_parameters()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    tensors[f"{names[id(p)]}::{key}"] = torch.as_tensor(value)
        return tensors

    def save(self, extra_config: dict) -> None:
        config = {self.spec.config_name: self.module.config.to_dict(), "target": self.module.config.target,
                  "method": self.spec.method, "train": {"step": self.step, "tokens": self.tokens,
                                                         "validation": self.validation, "curve": self.curve,
                                                         **extra_config}}
        checkpoints.save(self.folder, self.module, config, self.state())

    def resume(self) -> None:
        """Continue from this drafter's checkpoint, if it has one: rank 0 reads it and every rank takes rank 0's
        (a rank on another host need not see rank 0's disk)."""
        saved = None
        if self.ranks.lead:
            checkpoints.recover(self.folder)
        if self.ranks.lead and (self.folder / checkpoints.CONFIG).exists():
            train = checkpoints.load_config(self.folder)["train"]
            saved = {"weights": checkpoints.load_weights(self.folder),
                     "state": checkpoints.load_weights(self.folder, checkpoints.TRAIN_STATE),
                     "step": train["step"], "tokens": train["tokens"], "validation": train.get("validation", {}),
                     "curve": train.get("curve", [])}
        saved = self.ranks.from_lead(saved)
        if saved is None:
            self.start_alike()
            return
        self.module.load_state_dict(saved["weights"])
        by_name = dict(self.module.named_parameters())
        for key, value in saved["state"].items():
            name, field_name = key.split("::")
            # AdamW keeps its step count on the host and its moments beside the weights
            self.optimizer.state[by_name[name]][field_name] = value if field_name == "step" else value.to(
                by_name[name].device)
        self.step, self.tokens = saved["step"], saved["tokens"]
        self.validation, self.curve = saved["validation"], saved["curve"]
        self._sync()

    def start_alike(self) -> None:
        """Every rank starts from rank 0's initial weights (as DDP does), whatever its own initialisation drew."""
        if self.ranks.world > 1:
            weights = {name: value.cpu() for name, value in self.module.state_dict().items()}
            self.module.load_state_dict(self.ranks.from_lead(weights))
            self._sync()


def _aligned(pred, p: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target distributions and loss mask that a prediction's rows are scored against."""
    size = pred.logits.shape[-2]
    return p[..., pred.offset:pred.offset + size, :], mask[..., pred.offset:pred.offset + size]


def _cross_entropy(pred, p_draft: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Cross-entropy to the target summed over assistant rows / `count` (the global batch's rows, at least 1): KL
    up to a constant."""
    target, rows = _aligned(pred, p_draft, mask)
    log_q = torch.log_softmax(pred.logits, dim=-1)
    return -(target * log_q).sum(-1)[rows].sum() / count.clamp(min=1)


def validate(trainer: DrafterTrainer, chunks: list[Chunk], features: list[dict], probs: list[torch.Tensor],
             draft_ids, trajectories: Trajectories | None = None) -> dict:
    """Top-1 agreement with the target per group (the drafter kind's `group_name`) and the first prediction's KL on
    corpus text; with `trajectories`, also the replayed decoding's acceptance on them (harness/training/heldout.py)."""
    spec, groups = trainer.spec, trainer.spec.groups
    hits, totals, kl_sum, kl_count = torch.zeros(groups), torch.zeros(groups), 0.0, 0
    trainer.module.eval()
    with torch.no_grad():
        for number, (chunk, feats, p) in enumerate(zip(chunks, features, probs)):
            rngs = [random.Random(f"validation-{number}")]
            ids, mask = chunk.ids[None].to(p.device), chunk.loss_mask[None].to(p.device)
            p_draft = p[None] if draft_ids is None else p[None][..., draft_ids.to(p.device)]
            for index, pred in enumerate(spec.predictions(trainer.module, feats, ids, rngs, validating=True)):
                target, rows = _aligned(pred, p[None], mask)
                agree = (trainer.module.full_vocab(pred.logits).argmax(-1) == target.argmax(-1)) & rows
                labels = torch.as_tensor(pred.groups, device=rows.device).expand_as(rows)
                hits += torch.bincount(labels[agree], minlength=groups)[:groups].float().cpu()
                totals += torch.bincount(labels[rows], minlength=groups)[:groups].float().cpu()
                if index == 0:
                    q_target, _ = _aligned(pred, p_draft, mask)
                    log_q = torch.log_softmax(pred.logits, -1)
                    kl = (q_target * (torch.log(q_target.clamp_min(1e-12)) - log_q)).sum(-1)[rows]
                    kl_sum, kl_count = kl_sum + float(kl.sum()), kl_count + int(kl.numel())
        decoding = decoding_figures(spec, trainer.module, trajectories) if trajectories else None
    trainer.module.train()
    by_group = (hits / totals.clamp(min=1)).tolist()
    return {f"top1_by_{spec.group_name}": [round(x, 4) for x in by_group],
            "top1": round(float(hits.sum() / totals.sum().clamp(min=1)), 4),
            "kl": round(kl_sum / max(1, kl_count), 4), "positions": int(totals.sum()),
            **({"decoding": decoding} if decoding else {})}


def corpus_conversations(spec: str) -> list[tuple[int, list[dict]]]:
    """Every conversation `--corpus` names (harness/training/sources.py), mixed in the stated order, each tagged
    with the index of its source."""
    chosen = sources.parse(spec)
    sharegpt = list(conversations()) if any(s.kind in sources.BUILT_IN for s in chosen) else []
    tagged = list(sources.mixed([_tagged(i, sources.conversations(s, sharegpt)) for i, s in enumerate(chosen)]))
    if not tagged:
        raise HarnessError(f"--corpus {spec}: no conversation with an assistant reply in it; give conversations "
                           f"in ShareGPT (from/value) or OpenAI (role/content) form")
    return tagged


def _tagged(index: int, stream) -> Iterator[tuple[int, list[dict]]]:
    return ((index, messages) for messages in stream)


def training_chunks(config: TrainConfig, loaded: LoadedModel, convs: list[tuple[int, list[dict]]],
                    ranks: Ranks = ALONE) -> list[Chunk]:
    """The run's token budget in chunks, taken from the corpus's sources in their mixed order (a `self` source's
    conversations regenerated lazily, shared out over the ranks: the target's replies to their first turns). Every
    rank holds every chunk (tokenising is cheap next to the teacher) and passes only its rows through the teacher."""
    needed = config.steps_per_epoch * config.global_size
    streams = []
    for index, source in enumerate(sources.parse(config.corpus)):
        own = [messages for k, messages in convs if k == index]
        streams.append(self_distilled(loaded, own, config.reply_tokens, stop_ids(loaded), ranks=ranks)
                       if source.kind == "self" else iter(own))
    source = sources.mixed(streams)
    chunks: list[Chunk] = []
    while group := list(islice(source, 64)):
        chunks += _chunks(loaded, group, config.seq_len)
        if len(chunks) >= needed:
            return chunks[:needed]
    ranks_note = f" (a global batch of {config.global_size} chunks over {ranks.world} ranks)" if ranks.world > 1 else ""
    raise HarnessError(f"the corpus yields {len(chunks)} chunks of {config.seq_len} tokens, fewer than the "
                       f"{needed} that --tokens {config.tokens} needs{ranks_note}; lower --tokens"
                       + (" or the ranks" if ranks.world > 1 else ""))


@dataclass
class Run:
    """What every drafter of one training run shares: its resolved config, the target, the corpus's chunks and
    held-out conversations, the draft vocabulary, one trainer per drafter and the ranks."""

    config: TrainConfig
    loaded: LoadedModel
    target: TargetRuntime
    chunks: list
    held_out: list
    draft_ids: torch.Tensor | None
    trainers: list[DrafterTrainer]
    ranks: Ranks

    @property
    def layers(self) -> tuple[int, ...]:
        """The target layers any of the drafters reads (one teacher pass captures them all)."""
        return tuple(sorted({layer for t in self.trainers for layer in t.module.config.all_feature_layers()}))


def prepare(config: TrainConfig, ranks: Ranks = ALONE, training: bool = True) -> Run:
    """Load the target, chunk the corpus (its last `val_conversations` held out), build the draft vocabulary (a
    resumed run's own) and a trainer per drafter; every rank checks the same inputs and a bad one stops them all
    before anything is written. `training`: the checkpoints will be written (a timing run writes none), so a
    finished one is refused unless resumed."""
    convs = ranks.together(lambda: corpus_conversations(config.corpus))  # before the target loads
    loaded = ranks.together(lambda: _loaded(config, ranks))
    ranks.agree({**{k: v for k, v in _config_dict(config).items() if k not in ("device", "command")},
                 "weights sha256": loaded.identity.weights_sha256})
    target = TargetRuntime(loaded.model, max_len=config.seq_len, identity=loaded.identity)
    ranks.verdict(_existing_checkpoint(target, config) if ranks.lead and training else None)
    saved = ranks.from_lead(_saved_run(target, config) if config.resume and ranks.lead else None) or {}
    config = ranks.together(lambda: for_ranks(config, ranks, saved.get("global_batch")))
    held = min(config.val_conversations, len(convs) // 4)  # a small corpus of the user's keeps most to train on
    held_out, train_convs = [m for _, m in convs[len(convs) - held:]], convs[:len(convs) - held]
    chunks = ranks.together(lambda: training_chunks(config, loaded, train_convs, ranks))
    ranks.agree({"training chunks sha256": _chunks_sha(chunks)})  # a corpus file that differs between hosts
    if saved:
        draft_ids = saved["draft_ids"]
    elif config.draft_vocab_file:
        draft_ids = read_draft_vocab(Path(config.draft_vocab_file), target.config.vocab_size)
    else:
        draft_ids = draft_vocabulary(loaded, [m for _, m in train_convs], chunks, config.draft_vocab, ranks)
    trainers = [DrafterTrainer(spec, config, target, draft_ids, ranks) for spec in config.drafters]
    for trainer in trainers:
        trainer.resume() if config.resume else trainer.start_alike()
    return Run(config, loaded, target, chunks, held_out, draft_ids, trainers, ranks)


def _loaded(config: TrainConfig, ranks: Ranks) -> LoadedModel:
    """The target; with an offline teacher, a rank other than 0 (which neither validates nor initialises) holds only
    what drafters read from it: the embedding, final norm, head and one layer (its class builds theirs)."""
    if config.teacher == "offline" and not ranks.lead:
        loaded = load_part(config.model, Part(0, 1, embedding=True, norm=True, head=True), config.device,
                           config.dtype)
        from transformers import AutoTokenizer

        loaded = replace(loaded, tokenizer=AutoTokenizer.from_pretrained(resolve_model_dir(config.model)[1]))
    else:
        loaded = load_model(config.model, config.device, config.dtype)
    for spec in config.drafters:
        check_fit(spec.method, spec.params, len(loaded.model.model.layers))
    return loaded


def _existing_checkpoint(target: TargetRuntime, config: TrainConfig) -> str | None:
    for spec in config.drafters:
        folder = checkpoints.drafter_dir(target.identity, spec.method, spec.tag)
        if not config.resume and folder.exists():
            return f"checkpoint {folder} exists; pass --resume to continue it or delete it"
    return None


def _chunks_sha(chunks: list[Chunk]) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk.ids.numpy().tobytes())
        digest.update(chunk.loss_mask.numpy().tobytes())
    return digest.hexdigest()


@torch.inference_mode(False)
@torch.enable_grad()
def train(config: TrainConfig) -> list[Path]:
    """Train every drafter in `config.drafters` on shared teacher passes, on this process's rank of the run (all of
    it when not under torchrun); returns their checkpoint folders (on rank 0; none on the others)."""
    ranks = join(config.timeout, config.device)
    try:
        return _train(replace(config, device=rank_device(config.device)), ranks)
    finally:
        ranks.leave()


def _train(config: TrainConfig, ranks: Ranks) -> list[Path]:
    torch.manual_seed(config.seed)
    run = prepare(config, ranks)
    config, trainers, target, draft_ids = run.config, run.trainers, run.target, run.draft_ids
    if ranks.world > 1 and ranks.lead:
        tqdm.write(f"{ranks.world} ranks x {config.batch_size} chunks: global batch {config.global_size}, "
                   f"{config.steps} steps")
    val_chunks, val_inputs, trajectories = ([], ([], []), None)
    if ranks.lead:  # rank 0 validates; the others wait at the next step's exchange (within --timeout)
        val_chunks = _chunks(run.loaded, run.held_out, config.seq_len)[:config.val_chunks]
        val_inputs = _teacher_inputs(target, val_chunks, run.layers)
        prompts = first_turns(run.loaded, run.held_out, config.val_prompts, max_prompt=4 * config.seq_len)
        trajectories = greedy_trajectories(run.loaded, prompts, config.val_new_tokens, run.layers,
                                           stop_ids(run.loaded)) if prompts else None
    start, start_steps = min(t.step for t in trainers), {id(t): t.step for t in trainers}
    bar = tqdm(total=config.steps, initial=start, unit="step", desc="train " + ",".join(s.tag for s in config.drafters),
               dynamic_ncols=True, disable=not ranks.lead)
    cache = feature_cache(run)
    if cache.offline:
        absent = cache.absent(range(len(run.chunks)))
        ranks.verdict(f"--teacher offline: {len(absent)} of the run's {len(run.chunks)} chunks are not in the "
                      f"feature cache {cache.root}; prepare them with the same command and --prepare-features"
                      if absent else None)
    began = time.perf_counter()
    with bar:  # closed before any error line, which then starts a line of its own
        for step in range(start, config.steps):
            tokens, postfix = _step(run, config, cache, step)
            done = step + 1
            bar.set_postfix(tok_s=f"{(done - start) * tokens / (time.perf_counter() - began):.0f}",
                            epoch=step // config.steps_per_epoch + 1, cached=cache.read, **postfix)
            bar.update()
            if ranks.lead and (done % config.save_every == 0 or done == config.steps):
                trained = [t for t in trainers if t.step == done and done > start_steps[id(t)]]  # not resumed done
                for trainer in trained:
                    trainer.validation = validate(trainer, val_chunks, *val_inputs, draft_ids, trajectories)
                    trainer.curve.append({"step": trainer.step, "tokens": trainer.tokens, "world_size": ranks.world,
                                          **trainer.validation})
                    trainer.save({"config": _config_dict(config)})
                bar.write(f"step {done}: " + "; ".join(_validation_line(t) for t in trainers))
    if not ranks.lead:
        return []
    _record(run.loaded, config, [t for t in trainers if t.step > start_steps[id(t)]], ranks.world)
    return [t.folder for t in trainers]


def feature_cache(run: Run) -> FeatureCache:
    config = run.config
    return FeatureCache(run.target, sources.key(sources.parse(config.corpus)), config.seq_len, run.layers,
                        run.draft_ids, store=config.feature_cache or config.teacher == "offline",
                        offline=config.teacher == "offline")


def _step(run: Run, config: TrainConfig, cache: FeatureCache, step: int) -> tuple[int, dict[str, str]]:
    """One global batch, this rank's rows of it: the teacher's outputs (computed or read back), then a step of every
    drafter not past it; returns the global batch's tokens and each drafter's loss and top-1 for the progress bar."""
    index, rows = config.rows(step, run.ranks.rank)
    ids = torch.stack([run.chunks[i].ids for i in index]).to(run.target.device)
    mask = torch.stack([run.chunks[i].loss_mask for i in index]).to(run.target.device)
    with torch.no_grad():
        taught = cache.batch(index, ids)
    run.ranks.enter(step)
    postfix, tokens = {}, config.global_size * config.seq_len
    for trainer in run.trainers:
        if trainer.step > step:
            continue
        stats = trainer.train_step(taught.features, ids, taught.p_draft, mask, config.row_rngs(step, rows))
        trainer.tokens += tokens
        postfix[f"{trainer.spec.method}-{trainer.spec.tag}"] = f"loss {stats['loss']:.3f} top1 {stats['top1']:.2f}"
    return tokens, postfix


def _validation_line(trainer: DrafterTrainer) -> str:
    v, group = trainer.validation, trainer.spec.group_name
    line = f"{trainer.spec.tag} val top1 {v['top1']:.3f} by {group} {v[f'top1_by_{group}']}"
    if "decoding" in v:
        d = v["decoding"]
        line += f", decoding acceptance {d['acceptance']:.3f} by {group} {d[f'accept_by_{group}']}"
    return line


def _saved_run(target: TargetRuntime, config: TrainConfig) -> dict | None:
    """What a resumed run keeps from its checkpoints: the draft vocabulary they were built with and the global batch
    of its schedule (a checkpoint from before data-parallel training: its one process's batch)."""
    for spec in config.drafters:
        folder = checkpoints.drafter_dir(target.identity, spec.method, spec.tag)
        checkpoints.recover(folder)
        if (folder / checkpoints.WEIGHTS).exists():
            ids = checkpoints.load_weights(folder)["draft_ids"]
            saved = checkpoints.load_config(folder)["train"].get("config", {})
            return {"draft_ids": ids if ids.numel() else None,
                    "global_batch": saved.get("global_batch") or saved.get("batch_size")}
    return None


def _teacher_inputs(target: TargetRuntime, chunks: list[Chunk], layers) -> tuple[list[dict], list[torch.Tensor]]:
    features, probs = [], []
    with torch.no_grad():
        for chunk in chunks:
            captured, final, lse = teacher_pass(target, chunk.ids[None].to(target.device), layers)
            features.append(captured)
            probs.append(draft_probabilities(target, final[0], lse[0], None))
    return features, probs


def _config_dict(config: TrainConfig) -> dict:
    return {**asdict(config), "drafters": [{"method": d.method, **asdict(d)} for d in config.drafters]}


def _record(loaded: LoadedModel, config: TrainConfig, trainers: list[DrafterTrainer], world: int) -> None:
    """One line per drafter in results/<model>/train.jsonl: command, token count, validation by fill level."""
    store = ResultStore(Path("results") / loaded.identity.name.replace("/", "--") / "train.jsonl")
    for t in trainers:
        store.append({"kind": "train", "config_key": f"{t.spec.method}-{t.spec.tag}", "method": t.spec.method,
                      "params": t.spec.params,
                      "model": loaded.identity.to_dict(), "command": config.command, "tokens": t.tokens,
                      "steps": t.step, "world_size": world, "global_batch": config.global_size,
                      "validation": t.validation, "curve": t.curve, "checkpoint": str(t.folder),
                      "config": _config_dict(config), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})

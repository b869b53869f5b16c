"""Drafter training by distillation: one loop, one corpus, one teacher pass shared by every drafter trained together.

The frozen target runs once per training chunk and yields the hidden states every drafter needs plus its
next-token distribution (kept on disk by harness/training/features.py, so later epochs and runs read them back); each
drafter takes its training forward on those features and a KL(target || drafter) step at T=1 over assistant
tokens. Checkpoints (safetensors + JSON) are written periodically and resumed from.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import torch
from tqdm import tqdm

from harness.runtime import checkpoints
from harness.runtime.errors import HarnessError
from harness.runtime.models import LoadedModel, load_model, stop_ids
from harness.runtime.results import ResultStore
from harness.runtime.target import TargetRuntime
from harness.training import sources
from harness.training.corpus import conversations, encode
from harness.training.draft_vocab import read_draft_vocab
from harness.training.features import FeatureCache, draft_probabilities, teacher_pass
from harness.training.heldout import Trajectories, decoding_figures, first_turns, greedy_trajectories
from harness.training.regenerate import self_distilled
from methods.base import check_fit
from methods.draft_module import DrafterKind


@dataclass
class TrainConfig:
    drafters: list[DrafterKind]  # each family's (its objective.py), from Method.training_specs
    model: str = "smollm2-135m"
    tokens: int = 1_000_000  # target tokens through the teacher
    epochs: int = 1  # passes over those tokens; later passes read the teacher's outputs from the feature cache
    feature_cache: bool = True  # keep the teacher's outputs on disk (harness/training/features.py) for later epochs and runs
    seq_len: int = 256
    batch_size: int = 4
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
    command: str = ""

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.tokens / (self.seq_len * self.batch_size)))

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def batch_chunks(self, step: int) -> list[int]:
        """Chunk indices of a step's batch: the first epoch in corpus order, each later one in a seeded shuffle
        (so a resumed run visits exactly what an uninterrupted one would)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = list(range(self.steps_per_epoch * self.batch_size))
        if epoch:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order[within * self.batch_size:(within + 1) * self.batch_size]


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


VOCAB_COUNT_TOKENS = 500_000  # assistant tokens of the corpus counted for the draft vocabulary, whatever the budget


def draft_vocabulary(loaded: LoadedModel, convs: list[list[dict]], chunks: list[Chunk], size: int
                     ) -> torch.Tensor | None:
    """The `size` most frequent assistant tokens (ids in the target vocabulary) of the training slice plus the
    corpus's first VOCAB_COUNT_TOKENS assistant tokens: a small training budget must not shrink the vocabulary
    to the few tokens its slice happens to contain."""
    if size <= 0:
        return None
    counts = Counter()
    for chunk in chunks:
        counts.update(chunk.ids[chunk.loss_mask].tolist())
    counted = 0
    for messages in convs:
        if counted >= VOCAB_COUNT_TOKENS:
            break
        example = encode(loaded.tokenizer, messages, max_tokens=4096)
        assistant = [t for t, keep in zip(example.ids, example.assistant) if keep]
        counts.update(assistant)
        counted += len(assistant)
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)))


class DrafterTrainer:
    """One drafter's module, optimiser, schedule and checkpoint folder."""

    def __init__(self, spec: DrafterKind, config: TrainConfig, target: TargetRuntime, draft_ids):
        self.spec, self.config = spec, config
        self.folder = checkpoints.drafter_dir(target.identity, spec.method, spec.tag)
        # fp32 master weights: what the optimiser updates, the checkpoint holds and validation runs
        self.module = spec.initialise(spec.build(target, draft_ids), target).float().train()
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
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
                   rng: random.Random) -> dict:
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=self.config.autocast):
            predictions = self.spec.predictions(self.work, features, ids, rng)
        loss = sum(pred.weight * _cross_entropy(pred, p_draft, mask) for pred in predictions)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for master, work in self._pairs:
            master.grad, work.grad = (None if work.grad is None else work.grad.float()), None
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.config.clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate()
        self.optimizer.step()
        self._sync()
        self.step += 1
        first = predictions[0]
        target, rows = _aligned(first, p_draft, mask)
        agree = (first.logits.argmax(-1) == target.argmax(-1))[rows].float().sum() / rows.sum().clamp(min=1)
        return {"loss": loss.item(), "top1": agree.item()}

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
        """Continue from this drafter's checkpoint, if it has one."""
        if not (self.folder / checkpoints.CONFIG).exists():
            return
        saved = checkpoints.load_config(self.folder)
        self.module.load_state_dict(checkpoints.load_weights(self.folder))
        state = checkpoints.load_weights(self.folder, checkpoints.TRAIN_STATE)
        by_name = dict(self.module.named_parameters())
        for key, value in state.items():
            name, field_name = key.split("::")
            self.optimizer.state[by_name[name]][field_name] = value
        self.step, self.tokens = saved["train"]["step"], saved["train"]["tokens"]
        self.validation = saved["train"].get("validation", {})
        self.curve = saved["train"].get("curve", [])
        self._sync()


def _aligned(pred, p: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target distributions and loss mask that a prediction's rows are scored against."""
    size = pred.logits.shape[-2]
    return p[..., pred.offset:pred.offset + size, :], mask[..., pred.offset:pred.offset + size]


def _cross_entropy(pred, p_draft: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy to the target over assistant rows / their count (at least 1): KL up to a constant."""
    target, rows = _aligned(pred, p_draft, mask)
    log_q = torch.log_softmax(pred.logits, dim=-1)
    return -(target * log_q).sum(-1)[rows].sum() / rows.sum().clamp(min=1)


def validate(trainer: DrafterTrainer, chunks: list[Chunk], features: list[dict], probs: list[torch.Tensor],
             draft_ids, trajectories: Trajectories | None = None) -> dict:
    """Top-1 agreement with the target per group (the drafter kind's `group_name`) and the first prediction's KL on
    corpus text; with `trajectories`, also the replayed decoding's acceptance on them (harness/training/heldout.py)."""
    spec, groups = trainer.spec, trainer.spec.groups
    hits, totals, kl_sum, kl_count = torch.zeros(groups), torch.zeros(groups), 0.0, 0
    rng = random.Random(1234)
    trainer.module.eval()
    with torch.no_grad():
        for chunk, feats, p in zip(chunks, features, probs):
            ids, mask = chunk.ids[None].to(p.device), chunk.loss_mask[None].to(p.device)
            p_draft = p[None] if draft_ids is None else p[None][..., draft_ids.to(p.device)]
            for index, pred in enumerate(spec.predictions(trainer.module, feats, ids, rng, validating=True)):
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


def training_chunks(config: TrainConfig, loaded: LoadedModel, convs: list[tuple[int, list[dict]]]) -> list[Chunk]:
    """The run's token budget in chunks, taken from the corpus's sources in their mixed order (a `self` source's
    conversations regenerated lazily: the target's replies to their first turns)."""
    needed = config.steps_per_epoch * config.batch_size
    streams = []
    for index, source in enumerate(sources.parse(config.corpus)):
        own = [messages for k, messages in convs if k == index]
        streams.append(self_distilled(loaded, own, config.reply_tokens, stop_ids(loaded)) if source.kind == "self"
                       else iter(own))
    source = sources.mixed(streams)
    chunks: list[Chunk] = []
    while group := list(islice(source, 64)):
        chunks += _chunks(loaded, group, config.seq_len)
        if len(chunks) >= needed:
            return chunks[:needed]
    raise HarnessError(f"the corpus yields {len(chunks)} chunks of {config.seq_len} tokens, fewer than the "
                       f"{needed} that --tokens {config.tokens} needs; lower --tokens")


@dataclass
class Run:
    """What every drafter of one training run shares: the target, the corpus's chunks and held-out conversations, the
    draft vocabulary and one trainer per drafter."""

    loaded: LoadedModel
    target: TargetRuntime
    chunks: list
    held_out: list
    draft_ids: torch.Tensor | None
    trainers: list[DrafterTrainer]

    @property
    def layers(self) -> tuple[int, ...]:
        """The target layers any of the drafters reads (one teacher pass captures them all)."""
        return tuple(sorted({layer for t in self.trainers for layer in t.module.config.all_feature_layers()}))


def prepare(config: TrainConfig) -> Run:
    """Load the target, chunk the corpus (its last `val_conversations` held out), build the draft vocabulary (a
    resumed run's own) and a trainer per drafter."""
    convs = corpus_conversations(config.corpus)  # a bad corpus stops before the target loads
    loaded = load_model(config.model, config.device, config.dtype)
    for spec in config.drafters:
        check_fit(spec.method, spec.params, len(loaded.model.model.layers))
    target = TargetRuntime(loaded.model, max_len=config.seq_len, identity=loaded.identity)
    held = min(config.val_conversations, len(convs) // 4)  # a small corpus of the user's keeps most to train on
    held_out, train_convs = [m for _, m in convs[len(convs) - held:]], convs[:len(convs) - held]
    chunks = training_chunks(config, loaded, train_convs)
    draft_ids = _saved_draft_ids(target, config) if config.resume else None
    if draft_ids is None and config.draft_vocab_file:
        draft_ids = read_draft_vocab(Path(config.draft_vocab_file), target.config.vocab_size)
    if draft_ids is None:
        draft_ids = draft_vocabulary(loaded, [m for _, m in train_convs], chunks, config.draft_vocab)
    trainers = [DrafterTrainer(spec, config, target, draft_ids) for spec in config.drafters]
    return Run(loaded, target, chunks, held_out, draft_ids, trainers)


@torch.inference_mode(False)
@torch.enable_grad()
def train(config: TrainConfig) -> list[Path]:
    """Train every drafter in `config.drafters` on shared teacher passes; returns their checkpoint folders."""
    torch.manual_seed(config.seed)
    run = prepare(config)
    trainers, target, draft_ids = run.trainers, run.target, run.draft_ids
    for trainer in trainers:
        if not config.resume and trainer.folder.exists():
            raise HarnessError(f"checkpoint {trainer.folder} exists; pass --resume to continue it or delete it")
        if config.resume:
            trainer.resume()
    val_chunks = _chunks(run.loaded, run.held_out, config.seq_len)[:config.val_chunks]
    val_inputs = _teacher_inputs(target, val_chunks, run.layers)
    prompts = first_turns(run.loaded, run.held_out, config.val_prompts, max_prompt=4 * config.seq_len)
    trajectories = greedy_trajectories(run.loaded, prompts, config.val_new_tokens, run.layers,
                                       stop_ids(run.loaded)) if prompts else None
    start, start_steps = min(t.step for t in trainers), {id(t): t.step for t in trainers}
    bar = tqdm(total=config.steps, initial=start, unit="step", desc="train " + ",".join(s.tag for s in config.drafters),
               dynamic_ncols=True)
    cache = FeatureCache(target, sources.key(sources.parse(config.corpus)), config.seq_len, run.layers, draft_ids,
                         store=config.feature_cache)
    began = time.perf_counter()
    for step in range(start, config.steps):
        tokens, postfix = _step(run, config, cache, step)
        done = step + 1
        bar.set_postfix(tok_s=f"{(done - start) * tokens / (time.perf_counter() - began):.0f}",
                        epoch=step // config.steps_per_epoch + 1, cached=cache.read, **postfix)
        bar.update()
        if done % config.save_every == 0 or done == config.steps:
            trained = [t for t in trainers if t.step == done and done > start_steps[id(t)]]  # not one resumed done
            for trainer in trained:
                trainer.validation = validate(trainer, val_chunks, *val_inputs, draft_ids, trajectories)
                trainer.curve.append({"step": trainer.step, "tokens": trainer.tokens, **trainer.validation})
                trainer.save({"config": _config_dict(config)})
            bar.write(f"step {done}: " + "; ".join(_validation_line(t) for t in trainers))
    bar.close()
    _record(run.loaded, config, [t for t in trainers if t.step > start_steps[id(t)]])
    return [t.folder for t in trainers]


def _step(run: Run, config: TrainConfig, cache: FeatureCache, step: int) -> tuple[int, dict[str, str]]:
    """One batch: the teacher's outputs (computed or read back), then a step of every drafter not past it; returns
    the batch's tokens and each drafter's loss and top-1 for the progress bar."""
    index = config.batch_chunks(step)
    ids = torch.stack([run.chunks[i].ids for i in index]).to(run.target.device)
    mask = torch.stack([run.chunks[i].loss_mask for i in index]).to(run.target.device)
    with torch.no_grad():
        taught = cache.batch(index, ids)
    rng = random.Random(config.seed * 1_000_003 + step)
    postfix = {}
    for trainer in run.trainers:
        if trainer.step > step:
            continue
        stats = trainer.train_step(taught.features, ids, taught.p_draft, mask, rng)
        trainer.tokens += ids.numel()
        postfix[f"{trainer.spec.method}-{trainer.spec.tag}"] = f"loss {stats['loss']:.3f} top1 {stats['top1']:.2f}"
    return ids.numel(), postfix


def _validation_line(trainer: DrafterTrainer) -> str:
    v, group = trainer.validation, trainer.spec.group_name
    line = f"{trainer.spec.tag} val top1 {v['top1']:.3f} by {group} {v[f'top1_by_{group}']}"
    if "decoding" in v:
        d = v["decoding"]
        line += f", decoding acceptance {d['acceptance']:.3f} by {group} {d[f'accept_by_{group}']}"
    return line


def _saved_draft_ids(target: TargetRuntime, config: TrainConfig) -> torch.Tensor | None:
    """A resumed run keeps the draft vocabulary its checkpoints were built with."""
    for spec in config.drafters:
        folder = checkpoints.drafter_dir(target.identity, spec.method, spec.tag)
        if (folder / checkpoints.WEIGHTS).exists():
            ids = checkpoints.load_weights(folder)["draft_ids"]
            return ids if ids.numel() else None
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


def _record(loaded: LoadedModel, config: TrainConfig, trainers: list[DrafterTrainer]) -> None:
    """One line per drafter in results/<model>/train.jsonl: command, token count, validation by fill level."""
    store = ResultStore(Path("results") / loaded.identity.name.replace("/", "--") / "train.jsonl")
    for t in trainers:
        store.append({"kind": "train", "config_key": f"{t.spec.method}-{t.spec.tag}", "method": t.spec.method,
                      "params": t.spec.params,
                      "model": loaded.identity.to_dict(), "command": config.command, "tokens": t.tokens,
                      "steps": t.step, "validation": t.validation, "curve": t.curve, "checkpoint": str(t.folder),
                      "config": _config_dict(config), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})

"""The shared benchmark loop: prompts in, one lossless-checked JSONL record per sample out, resumable (the run
identity and its validation: harness/bench/config.py)."""

from __future__ import annotations

import hashlib
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from harness.bench.config import (
    REFERENCE_METHOD,
    RunConfig,
    default_out,
    drafter_fingerprint,
    import_checkpoint,
    load_prompts,
    validate,
)
from harness.bench.data import MULTI_TURN, Sample, render_conversation
from harness.runtime import distributed as launch
from harness.runtime import kernels
from harness.runtime.compiled import warm
from harness.runtime.conditions import Measuring, busy_warning, fit_threads
from harness.runtime.errors import HarnessError
from harness.runtime.lossless import ReferenceCache, Replay, compare, not_checked
from harness.runtime.models import LoadedModel, ModelIdentity, load_model, stop_ids
from harness.runtime.provenance import versions
from harness.runtime.results import Record, ResultStore, SampleKey, config_key, row_key, sample_key
from harness.runtime.target import TargetRuntime
from methods.base import Method, build_method, check_fit
from methods.drafts import drafted
from methods.sampling import Sampler, SamplingConfig


# Room in the cache for an earlier answer's text tokenized anew in the next turn's prompt, beyond its own tokens.
RETOKENIZED = 32


def sample_seed(seed: int, sample: Sample, turn: int = 1) -> int:
    """Per-sample (and per-turn) seed, so a resumed run draws exactly what an uninterrupted one would have."""
    text = f"{seed}/{sample.dataset}/{sample.question_id}" + (f"/turn{turn}" if turn > 1 else "")
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def sample_keys(key: str, sample: Sample, turns: str) -> list[SampleKey]:
    """The records a sample gets under a configuration `key` run with the `turns` protocol: one per turn."""
    return [sample_key(key, sample.dataset, sample.question_id, turn)
            for turn in range(1, len(sample.turns(turns)) + 1)]


def run_key(config: RunConfig, identity: ModelIdentity, device_type: str, drafter: str | None) -> str:
    """The configuration key of a run's records: the options RunConfig keys (`key_entries`: method, parameters,
    sampling, lengths, seed, dtype, simulated or executed, executor, a compiled step, kernels other than auto's, the
    turns protocol when every turn runs), the model's weights, the device type and the drafter's weights
    (`drafter_fingerprint`)."""
    return config_key({**config.key_entries(), "model": identity.to_dict(), "device": device_type,
                       **({"drafter": drafter} if drafter else {})})


class Runner:
    """Runs one configuration over its prompts; the method sees only the target runtime and the prompt ids."""

    def __init__(self, config: RunConfig, loaded: LoadedModel):
        self.config = config
        self.loaded = loaded
        self.sampling = config.sampling()
        self.stop_ids = stop_ids(loaded)
        self.drafter = drafter_fingerprint(config, loaded.identity)
        self.key = run_key(config, loaded.identity, loaded.device.type, self.drafter)
        self.target: TargetRuntime | None = None
        self.references: ReferenceCache | None = None  # keyed by the target's numerics: made with it

    def load_method(self, name: str, params: dict, longest: int) -> Method:
        """The method on this run's target, built on first use with room for `longest` prompt tokens."""
        if self.target is None:
            context = getattr(self.loaded.model.config.get_text_config(), "max_position_embeddings", None)
            if context and longest + self.config.max_new_tokens > context:
                raise HarnessError(f"a prompt of {longest} tokens plus --max-new-tokens {self.config.max_new_tokens} "
                                   f"exceeds the model's context of {context} tokens; lower --max-new-tokens or "
                                   f"--limit the prompts")
            max_len = longest + self.config.max_new_tokens + 256  # room for in-flight drafts and tree siblings
            self.target = TargetRuntime(self.loaded.model, max_len=max_len, identity=self.loaded.identity,
                                        compile=self.config.compile)
            self.references = ReferenceCache(self.loaded, self.config.dtype_name, self.stop_ids,
                                             self.target.numerics())
        return build_method(name, self.target, params, self.stop_ids, self.config.checkpoint)

    def todo(self, samples: list[Sample], store: ResultStore) -> list[Sample]:
        """Samples of this configuration with a turn not yet in the store (a resumed run skips the rest)."""
        finished = store.finished()
        return [s for s in samples if any(k not in finished for k in sample_keys(self.key, s, self.config.turns))]

    def longest_prompt(self, samples: list[Sample]) -> int:
        """The most prompt tokens a turn of these samples can reach: its turns rendered with empty answers, plus each
        earlier answer at its longest (and room to tokenize its text anew)."""
        longest = 0
        for sample in samples:
            turns = sample.turns(self.config.turns)
            empty = render_conversation(self.loaded.tokenizer, turns, [""] * (len(turns) - 1))
            longest = max(longest, len(empty) + (len(turns) - 1) * (self.config.max_new_tokens + RETOKENIZED))
        return longest

    def run(self, samples: list[Sample], store: ResultStore, bar: tqdm | None = None) -> int:
        """Run every unfinished sample, holding the results file for the whole run (a concurrent run on it is refused);
        `bar` (a sweep's overall bar) replaces the per-run one."""
        with store.writing():
            todo = self.todo(samples, store)
            if len(todo) < len(samples):
                tqdm.write(self._reused_note(samples, todo, store), file=sys.stderr)
            if not todo:
                return 0
            longest = self.longest_prompt(todo)
            method = self.load_method(self.config.method, self.config.params, longest)
            reference = self.load_method(REFERENCE_METHOD, {}, longest)
            notes = [self._single_turn_note(todo)]
            if not self.config.simulate:
                notes += [busy_warning(), fit_threads()]
            for line in filter(None, notes):
                tqdm.write(line, file=sys.stderr)
            with self._executor(method), torch.inference_mode():
                if not self.config.simulate:
                    first = render_conversation(self.loaded.tokenizer, [todo[0].prompt], [])
                    # One-off allocation costs stay out of the timings; a compiled step warms on a whole generation,
                    # which meets most shapes it compiles before any timing, on a served rank too (`warm` decodes
                    # a pair again only for graphs this process compiled).
                    length = min(8, self.config.max_new_tokens) if self.config.compile == "off" else \
                        self.config.max_new_tokens
                    for side in (method, reference):
                        side.generate(first, length, self._sampler(0))
                self._loop(todo, method, reference, store, bar)
            return len(todo)

    def _single_turn_note(self, todo: list[Sample]) -> str | None:
        """Under --turns all, the conversations of a multi-turn set that have one user turn (said once)."""
        single = [s for s in todo if self.config.turns == "all" and s.dataset in MULTI_TURN and not s.follow_ups]
        if not single:
            return None
        origins = ", ".join(sorted({s.source.get("origin", s.dataset) for s in single}))
        return (f"--turns all: {len(single)} {'/'.join(sorted({s.dataset for s in single}))} question(s) in "
                f"{origins} have one user turn; they run that turn only")

    def _reused_note(self, samples: list[Sample], todo: list[Sample], store: ResultStore) -> str:
        """Which samples this run keeps from earlier records instead of measuring them, and from which code."""
        wanted = {(s.dataset, str(s.question_id)) for s in samples if s not in todo}
        kept = [r for r in store.load()
                if r["config_key"] == self.key and (r["dataset"], str(r["question_id"])) in wanted]
        commits = sorted({(r.get("versions") or {}).get("commit") or "unknown" for r in kept})
        return (f"{self.config.method}: {len(wanted)} of {len(samples)} samples already recorded in {store.path} "
                f"(commit {', '.join(c[:10] for c in commits)}; this code: "
                f"{(versions().get('commit') or 'unknown')[:10]}): kept, not measured again; another --out measures "
                f"them anew")

    @contextmanager
    def _executor(self, method: Method):
        """The distributed executor's ranks for the whole run (the local one needs nothing)."""
        if self.config.executor == "local":
            yield
            return
        with launch.stage_group(self.config.model, self.config.device, self.config.stage_devices,
                                self.config.timeout, self.config.join_timeout) as group:
            executor = method.distribute(group, self.config.dtype_name)
            yield
            executor.close()  # only after a clean run: a failed rank cannot be asked to stop

    def _loop(self, todo, method, reference, store, bar) -> None:
        desc = f"{self.config.method}{' (simulated)' if self.config.simulate else ''}"
        own_bar = bar is None
        if own_bar:
            bar = tqdm(total=len(todo), desc=desc, unit="sample", dynamic_ncols=True)
        try:
            self._decode_all(todo, method, reference, store, bar)
        finally:
            if own_bar:
                bar.close()  # ends the bar's line, so an error message starts a line of its own

    def _decode_all(self, todo, method, reference, store, bar) -> None:
        """Each sample's turns in order, a record each; a later turn's prompt is the conversation so far, the
        method's own answers included (an answer recorded before a resume is read back from its record)."""
        tokens, seconds, pairs = 0, 0.0, 0
        measuring = Measuring(self.loaded.device.type)
        recorded = {row_key(r): r for r in store.load()} if self.config.turns == "all" else {}
        tokenizer = self.loaded.tokenizer
        for sample in todo:
            turns, answers, lossless = sample.turns(self.config.turns), [], None
            for turn in range(1, len(turns) + 1):
                prompt = render_conversation(tokenizer, turns[:turn], answers)
                earlier = recorded.get(sample_key(self.key, sample.dataset, sample.question_id, turn))
                if earlier is not None:
                    output = earlier["output_ids"]
                else:
                    generation, lossless = self._decode_turn(method, reference, prompt, sample, turn, measuring,
                                                             pairs % 2 == 0, store)
                    output, pairs = generation.output_ids, pairs + 1
                    tokens += len(output)
                    seconds += generation.timing.get("prefill", 0.0) + generation.timing.get("decode", 0.0)
                if turn < len(turns):  # the history the next turn's prompt holds
                    answers.append(tokenizer.decode(output, skip_special_tokens=True))
            bar.set_postfix(tok_s=f"{tokens / seconds:.1f}" if seconds else "—",
                            lossless=_flag(lossless) if lossless else "—")
            bar.update()

    def _decode_turn(self, method, reference, prompt, sample, turn, measuring, method_first, store):
        """One turn decoded (or replayed), checked and recorded; returns its generation and lossless verdict."""
        seed = sample_seed(self.config.seed, sample, turn)
        if self.config.simulate:
            generation, baseline = self._simulate(method, reference, prompt, seed), None
            lossless, conditions = not_checked("simulated: acceptance replayed on the AR output"), {}
        else:
            generation, baseline, conditions = self._timed_pair(method, reference, prompt, seed, method_first,
                                                                measuring)
            lossless = self._check(prompt, generation.output_ids, method, reference, baseline)
        store.append(self._record(sample, turn, prompt, generation, lossless, baseline, conditions))
        return generation, lossless

    def _timed_pair(self, method, reference, prompt, seed: int, method_first: bool, measuring: Measuring):
        """`_generate_pair` with the load it ran under and the engine it ran on; a pair during which the compiled
        step compiled a graph decodes again (`warm`), so no timing holds compile seconds."""

        def pair():
            measuring.start()
            generation, baseline = self._generate_pair(method, reference, prompt, seed, method_first)
            return generation, baseline, {**measuring.end().to_dict(), **self.target.engine()}  # the kernels timed

        return warm(self.target.compiled, pair)

    def _simulate(self, method, reference, prompt, seed: int):
        """The method's acceptance replayed on the AR output for this prompt and seed (both cached, so the
        configurations of a sweep replay on one trajectory per prompt without decoding it again)."""
        if self.sampling.greedy:
            trajectory = self.greedy_reference(prompt, reference)
        else:
            trajectory = self.sampled_reference(prompt, reference, seed)
        with drafted() as log:
            generation = method.simulate(prompt, trajectory, self.config.max_new_tokens, self._sampler(seed))
        generation.drafts = log.record()
        return generation

    def sampled_reference(self, prompt: list[int], reference: Method, seed: int) -> list[int]:
        """AR output for the prompt sampled with this run's sampling from `seed`: cached, else decoded now."""
        s = self.sampling
        variant = f"t{s.temperature:g}-k{s.top_k}-p{s.top_p:g}-seed{seed}"
        trajectory = self.references.get(prompt, self.config.max_new_tokens, variant)
        if trajectory is None:
            trajectory = reference.generate(prompt, self.config.max_new_tokens, self._sampler(seed)).output_ids
            self.references.put(prompt, self.config.max_new_tokens, trajectory, variant)
        return trajectory

    def greedy_reference(self, prompt: list[int], reference: Method) -> list[int]:
        """Greedy AR output for the prompt: from the reference cache, else decoded now and cached."""
        expected = self.references.get(prompt, self.config.max_new_tokens)
        if expected is None:
            expected = reference.generate(prompt, self.config.max_new_tokens, Sampler(SamplingConfig())).output_ids
            self.references.put(prompt, self.config.max_new_tokens, expected)
        return expected

    def _generate_pair(self, method, reference, prompt, seed: int, method_first: bool):
        """The method and, unless it is AR itself, AR on the same prompt and seed, in alternating order."""

        def run(m: Method):
            with drafted() as log:
                generation = m.generate(prompt, self.config.max_new_tokens, self._sampler(seed))
            generation.drafts = log.record()
            return generation

        if self.config.method == REFERENCE_METHOD or not self.config.baseline:
            return run(method), None
        if method_first:
            generation = run(method)
            return generation, run(reference)
        baseline = run(reference)
        return run(method), baseline

    def _sampler(self, seed: int) -> Sampler:
        generator = torch.Generator(device=self.loaded.device).manual_seed(seed)
        return Sampler(self.sampling, generator)

    def _check(self, prompt: list[int], output: list[int], method: Method, reference_method: Method, baseline
               ) -> dict:
        if not self.sampling.greedy:
            return not_checked("sampled run: covered by the distribution tests")
        # AR's own output, or AR run beside the method, is the reference when none is cached yet.
        own = output if self.config.method == REFERENCE_METHOD else baseline and baseline.output_ids
        if own and self.references.get(prompt, self.config.max_new_tokens) is None:
            self.references.put(prompt, self.config.max_new_tokens, own)
        greedy = Sampler(SamplingConfig())
        replay = Replay(lambda: method.generate(prompt, self.config.max_new_tokens, greedy).output_ids,
                        lambda n: reference_method.generate(prompt, n, greedy).output_ids)
        return compare(self.target, prompt, output, self.greedy_reference(prompt, reference_method), replay)

    def _record(self, sample: Sample, turn: int, prompt: list[int], generation, lossless: dict, baseline,
                conditions: dict) -> Record:
        c = self.config
        return Record(
            **c.recorded(),
            model=self.loaded.identity.to_dict(),
            dataset=sample.dataset,
            question_id=sample.question_id,
            dtype=c.dtype_name,
            device=self.loaded.device.type,
            prompt_tokens=len(prompt),  # a later turn's: the conversation before it included
            output_ids=generation.output_ids,
            output_text=self.loaded.tokenizer.decode(generation.output_ids, skip_special_tokens=False),
            new_tokens=len(generation.output_ids),
            steps=generation.steps,
            accepted=generation.accepted,
            position_accepts=generation.position_accepts,
            drafts=generation.drafts,
            timing={} if c.simulate else {k: round(v, 6) for k, v in generation.timing.items()},
            lossless=lossless,
            config_key=self.key,
            versions=versions(),
            stats={**generation.stats.record(), "drafter": self.drafter,
                   "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")},
            prompt_source=sample.source,
            conditions=conditions,
            turn=turn,
            baseline=None if baseline is None else {
                "method": REFERENCE_METHOD,
                "new_tokens": len(baseline.output_ids),
                "timing": {k: round(v, 6) for k, v in baseline.timing.items()},
            },
        )


def _flag(lossless: dict) -> str:
    """The bar's losslessness mark: ok, a numerics flip at token i (a near-tie the two forms' rounding decided
    apart: harness/runtime/verdict.py) or a logic divergence there."""
    if not lossless["checked"]:
        return "n/a"
    if lossless["identical"]:
        return "ok"
    return f"{'flip' if lossless.get('verdict') == 'flip' else 'DIVERGED'}@{lossless['first_divergence']}"


def run(config: RunConfig) -> Path | None:
    """Validate, load prompts and model, run every unfinished sample, return the results file (None on a torchrun
    stage rank, which only serves its stage)."""
    validate(config)
    kernels.choose(config.kernels)  # before the model loads (its dtype and Linears follow); ranks inherit it
    if config.executor == "distributed" and launch.under_torchrun() and int(os.environ["RANK"]) > 0:
        launch.serve_from_env(config.stage_devices, config.device, config.timeout, config.join_timeout)
        return None
    samples = load_prompts(config)
    store_path = config.out
    if store_path is not None:
        ResultStore(store_path).load()  # an unreadable file fails here, before the model loads
    loaded = load_model(config.model, config.device, config.dtype)
    check_fit(config.method, config.params, len(loaded.model.model.layers))
    import_checkpoint(config, loaded)
    store = ResultStore(store_path or default_out(config, loaded.identity.name))
    store.load()
    Runner(config, loaded).run(samples, store)
    return store.path

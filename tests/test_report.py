"""The rendered report: per-(T, width) blocks, the schedule ablation, speedups side by side, and figures."""

import re

from harness.reporting.metrics import find, summarize
from harness.reporting.render import latex, markdown, render_figures
from harness.reporting.report import detail_table, lossless_table, tables

INTERVAL = re.compile(r" \[[-+]?\d[^\]]*\]|(?<=\d) \(n=\d+\)")  # "[1.1, 1.3]", "[2 prompts: too few]", "(n=2)"


def _squeezed(text: str) -> str:
    """Markdown tables are column-aligned; assertions compare cell contents, not padding (nor, here, intervals:
    tests of their own check those)."""
    return re.sub(r"(?<=\S) {2,}", " ", INTERVAL.sub("", text))


def _point(cells: list[str]) -> list[str]:
    return [INTERVAL.sub("", cell) for cell in cells]


def _row(method, params, dataset, schedule=None, draft=None, temperature=0.0, model="m", simulated=False,
         truncation=(0, 1.0)):
    stats = {"fill_drafts": [4, 4]} if schedule else {}
    if schedule:
        stats["pipeline"] = {"num_layers": 30, "n": params["n"], "largest_stage": 4, "ls": 4, "schedule": schedule}
    if draft:
        stats["draft"] = draft
    return {
        "config_key": f"{method}{sorted(params.items())}{temperature}{truncation}{model}{simulated}", "method": method,
        "params": params, "model": {"name": model}, "simulated": simulated, "temperature": temperature,
        "top_k": truncation[0], "top_p": truncation[1], "dataset": dataset, "question_id": 0, "new_tokens": 11,
        "steps": 8, "accepted": [0, 1, 2, 1, 0, 3, 2, 1], "position_accepts": [2, 1],
        "timing": {"decode": 1.0, "stages": 0.5, "drafter": 0.2, "verify_head": 0.1},
        "lossless": {"checked": True, "identical": True}, "baseline": {"new_tokens": 11, "timing": {"decode": 2.0}},
        "stats": stats, "max_new_tokens": 128, "seed": 0, "dtype": "float32",
    }


def test_report_blocks_ablation_speedups_and_figures(tmp_path):
    rows = []
    for dataset in ("gsm8k", "mt_bench"):
        for schedule in ("input", "output"):
            rows.append(_row("spd", {"n": 8, "ls": 4, "schedule": schedule, "width": 1}, dataset, schedule))
        rows.append(_row("eagle3", {"m": 3, "width": 4, "ttt": 7}, dataset,
                         draft={"num_layers": 30, "ls": 1, "m": 3, "width": 4}))
    summaries = summarize(rows)
    curve = [{"tokens": t, "top1": a, "decoding": {"acceptance": a / 2}} for t, a in ((1024, 0.1), (2048, 0.2))]
    train = [{"kind": "train", "method": "spd", "config_key": "spd-n8-ls1-input", "model": {"name": "m"},
              "curve": curve}]
    figures = render_figures(summaries, rows, tmp_path / "figures", relative_to=tmp_path, train_rows=train)
    assert set(figures.values()) == {"figures/acceptance.png", "figures/accepted_lengths.png", "figures/speedups.png",
                                     "figures/speedup_over_n.png", "figures/spd_over_ls.png",
                                     "figures/learning_curves.png", "figures/cycle_breakdown.png"}
    assert all((tmp_path / p).stat().st_size > 1000 for p in figures.values())
    text = _squeezed(markdown(summaries, figures))
    assert "## T=0, width 1" in text and "## T=0, width 4" in text
    # alpha = 10 tokens after the prefill one / 8 cycles; theoretical x input 1.25 * 30 / 4, output 1.25 * 30 / 8;
    # no humaneval records: "—", and the mean is over the datasets present
    assert "| spd ls=4 n=8 schedule=input | 1.25 · 9.38 · 9.38x | 1.25 · 9.38 · 9.38x | — | 1.25 · 9.38 · 9.38x |" in text
    assert "| spd n=8 ls=4 | 1 | 0 | 1.25 | 1.25 | 9.38 | 4.69 |" in text  # the ablation row
    assert "![Speedups per executed configuration](figures/speedups.png)" in text


def test_cycle_wall_breakdown_separates_distributed_runs_and_models_them_from_the_ranks_forward_times():
    params = {"n": 8, "ls": 4, "schedule": "input", "width": 1}
    local = _row("spd", params, "gsm8k", "input")
    distributed = _row("spd", params, "gsm8k", "input")
    distributed["config_key"] += "distributed"
    distributed["stats"]["executor"] = {"kind": "distributed", "world_size": 9, "stage_forward_s": [0.02] * 8}
    for row in (local, distributed):
        row["stats"].update(stage_runs=64, drafter_calls=8, verifications=7)
    overall = [s for s in summarize([local, distributed]) if s.dataset == "overall"]
    (table,) = [t for t in tables(overall) if t.title == "Cycle wall breakdown"]
    rows = {row[0]: row for row in table.rows}
    # ms per cycle over 8 cycles: draft 200/8, stages 500/8, verify 100/8, the rest 200/8, cycle 1000/8
    assert _point(rows["spd ls=4 n=8 schedule=input"][4:10]) == ["25.0", "62.5", "12.5", "25.0", "125.0", "—"]
    assert _point(rows["spd ls=4 n=8 schedule=input [distributed]"][4:10]) == ["25.0", "62.5", "12.5", "25.0",
                                                                                "125.0", "2.5"]
    # modeled: the local run's stage time is its "stages" (0.5 s), the distributed one's the ranks' (0.16 s):
    # per layer 0.5 / (64 * 30 / 8) or 0.16 / 240; cycle max(4 layers, drafter 0.025) + head 0.1 / 7;
    # speedup 1.25 * (30 layers + head) / cycle
    modeled = {s.distributed: round(s.modeled_speedup, 3) for s in overall}
    assert modeled == {False: 2.443, True: 1.091}


def test_scaling_tables_paper_references_latex_and_the_commands_for_empty_cells():
    rows = [_row("spd", {"n": n, "ls": ls, "schedule": "input", "width": 4}, d, "input", temperature=1.0,
                 model="Qwen3.5-4B", truncation=(50, 0.95))
            for n, ls in ((8, 4), (4, 4), (8, 2)) for d in ("mt_bench", "gsm8k", "humaneval")]
    rows.append(_row("eagle3", {"m": 15, "width": 1, "ttt": 7}, "gsm8k", draft={"num_layers": 30, "ls": 1, "m": 15,
                                                                                "width": 1}, simulated=True))
    summaries = summarize(rows)
    text = _squeezed(markdown(summaries))
    assert "## SPD (input schedule) over n and Ls, T=1 (top-k 50, top-p 0.95), width 4" in text
    assert "| n=8 | — | 1.25 · 9.38 · 9.38x | — | 1.25 · 9.38 · 9.38x |" in text
    assert "| n=16 | — | — | — | — |" in text
    assert "| m=15 | 1.25 · — · 0.83x |" in text  # tau * 30 / (15 + 30), from the simulated run
    assert "eagle3 m=15 ttt=7 (sim)" in text
    # SPD n=8 Ls=4 W=4 T=1 on a model named like the paper's: L'acc 9.38 (the mean over the three datasets) vs 3.43
    assert ("| Qwen3.5-4B | spd ls=4 n=8 schedule=input width=4 | 1 (top-k 50, top-p 0.95) | mean | l acc | 3.43 "
            "| Qwen3.5-4B | 9.38 |") in text
    assert "spd-bench sweep --preset paper" in text
    assert "    spd-bench run --method spd --ls 1 --n 4 --schedule input --width 1 --temperature 0" in text
    assert "spd-bench run --method spd --ls 4 --n 8 --schedule input --width 4 --temperature 1" not in text
    # a run of another length is another configuration, named apart (not merged into the same main-table row)
    short = _row("spd", {"n": 8, "ls": 4, "schedule": "input", "width": 4}, "gsm8k", "input", temperature=1.0,
                 model="Qwen3.5-4B", truncation=(50, 0.95))
    short["max_new_tokens"], short["config_key"] = 64, "short"
    text = _squeezed(markdown(summarize([*rows, short])))
    assert "| spd ls=4 n=8 schedule=input (64 tokens) | — | 1.25 · 9.38 · 9.38x | — | 1.25 · 9.38 · 9.38x |" in text
    assert "| spd ls=4 n=8 schedule=input | 1.25 · 9.38 · 9.38x | 1.25 · 9.38 · 9.38x | 1.25 · 9.38 · 9.38x |" in text
    # the same configuration sampled without truncation is another run: its own block, not the paper's cell
    untruncated = [_row("spd", {"n": 8, "ls": 4, "schedule": "input", "width": 4}, d, "input", temperature=1.0,
                        model="Qwen3.5-4B") for d in ("mt_bench", "gsm8k", "humaneval")]
    text = _squeezed(markdown(summarize(untruncated)))
    assert "## T=1, width 4" in text and "top-k 50" not in text.split("## The paper's claims")[0]
    assert "| 3.43 | Qwen3.5-4B | — |" in text
    assert "spd-bench run --method spd --ls 4 --n 8 --schedule input --width 4 --temperature 1 --top-k 50" in text
    tex = latex(summaries)
    assert tex.count(r"\begin{tabular}") == len(tables(summaries))
    assert r"1.25 $\cdot$ 9.38 $\cdot$ 9.38x" in INTERVAL.sub("", tex) and r"mt\_bench" in tex


def _steps(row, steps):
    row["steps"] = steps
    return row


def _prompts(method, params, schedule, steps, model="m", draft=None, temperature=0.0, simulated=False,
             truncation=(0, 1.0)):
    """One gsm8k record per entry of `steps` (its cycles or rounds for 11 tokens), question ids 0, 1, ..."""
    rows = []
    for question, count in enumerate(steps):
        row = _steps(_row(method, params, "gsm8k", schedule, draft, temperature, model, simulated, truncation), count)
        row["question_id"] = question
        rows.append(row)
    return rows


def _spd_rows(model, n, ls, schedule, steps):
    return _prompts("spd", {"n": n, "ls": ls, "schedule": schedule, "width": 1}, schedule, steps, model)


def test_claims_are_paired_tests_with_a_verdict_per_branch():
    from harness.reporting.paper import verdicts

    slow, fast = [10, 11, 9, 10, 12, 10, 11, 9], [8, 8, 7, 9, 8, 8, 7, 9]  # alpha about 1.0 and 1.27 per prompt
    rows = [*_spd_rows("m", 4, 4, "input", slow), *_spd_rows("m", 8, 4, "input", fast),  # L'acc rises: agrees
            *_spd_rows("m2", 4, 4, "input", fast), *_spd_rows("m2", 8, 4, "input", slow),  # falls: disagrees
            *_spd_rows("m3", 4, 4, "input", [8, 12, 8, 12, 8, 12, 8, 12]),  # the same on average: inconclusive
            *_spd_rows("m3", 8, 4, "input", [12, 8, 12, 8, 12, 8, 12, 9]),
            *_spd_rows("m4", 4, 4, "input", slow[:2]), *_spd_rows("m4", 8, 4, "input", fast[:2]),  # 2 prompts
            *_spd_rows("m5", 4, 1, "input", slow), *_spd_rows("m5", 8, 1, "input", fast),  # Ls=1 rises,
            *_spd_rows("m5", 4, 4, "input", fast), *_spd_rows("m5", 8, 4, "input", slow),  # Ls=4 falls: mixed
            *_spd_rows("m", 8, 4, "output", [5, 6, 5, 4, 5, 5, 6, 5])]  # higher alpha, lower theoretical x
    found = {(v.claim.split(" (")[0], v.model): v for v in verdicts(summarize(rows))}
    lacc = {model: found["L'acc rises from n=4 to n=8", model] for model in ("m", "m2", "m3", "m4", "m5")}
    assert lacc["m"].verdict == "agrees" and lacc["m2"].verdict == "disagrees" and lacc["m5"].verdict == "mixed"
    # alpha 80 tokens / 82 cycles -> 80 / 64: L'acc 0.976 * 30 / 4 = 7.32 -> 9.38
    assert lacc["m"].measured.startswith("Ls=4: L'acc n=4 -> n=8: 7.32 -> 9.38, difference +2.06 [")
    assert "on 8 prompts per dataset, agrees" in lacc["m"].measured
    assert lacc["m3"].verdict == "inconclusive" and re.search(r"inconclusive \(about \d+ would resolve it\)",
                                                               lacc["m3"].measured)
    assert lacc["m4"].verdict == "inconclusive" and "on 2 prompts per dataset" in lacc["m4"].measured
    tradeoff = found["The output schedule has higher alpha but lower theoretical speedup than the input schedule", "m"]
    assert tradeoff.verdict == "agrees" and "alpha input -> output: 1.25 -> 1.95" in tradeoff.measured  # 80 / 41
    eagle = found["EAGLE-3 m=7 beats m=15", "m"]
    assert eagle.verdict == "not measured" and "spd-bench sweep --method eagle3 --m 7,15" in eagle.measured
    assert "## The paper's claims, as measured here" in markdown(summarize(rows))


def test_the_t1_order_compares_runs_at_the_papers_sampling_measured_the_same_way():
    from harness.reporting.paper import verdicts

    def best(method, params, steps, simulated=False, truncation=(50, 0.95)):
        draft = None if method != "eagle3" else {"num_layers": 30, "ls": 1, "m": params["m"], "width": 1}
        return _prompts(method, {**params, "width": 1}, params.get("schedule"), steps, draft=draft, temperature=1.0,
                        simulated=simulated, truncation=truncation)

    spd, ppsd = {"n": 8, "ls": 4, "schedule": "input"}, {"n": 8, "ls": 1, "schedule": "output"}
    # each prompt a little apart from the others
    rows = [*best("spd", spd, [2, 2, 2, 3, 2, 2]), *best("eagle3", {"m": 3}, [4, 4, 5, 4, 4, 4]),
            *best("ppsd", ppsd, [80, 80, 70, 80, 90, 80]),
            *best("ppsd", {**ppsd, "n": 4}, [1] * 6, simulated=True),  # simulated: not set against executed runs
            *best("eagle3", {"m": 7}, [1] * 6, truncation=(0, 1.0))]  # untruncated sampling: not the paper's T=1
    (order,) = [v for v in verdicts(summarize(rows)) if v.claim.startswith("At T=1")]
    assert order.verdict == "agrees"
    # 60 tokens after the prefill ones: spd 60 / 13 * 30 / 4, eagle3 60 / 25 * 30 / 33, ppsd 60 / 480 * 30 / 8
    assert order.measured.startswith("best of each, theoretical x eagle3 m=3 width=1 -> spd ls=4 n=8 "
                                     "schedule=input width=1: 2.18 -> 34.62, ")
    assert "theoretical x ppsd ls=1 n=8 schedule=output width=1 -> eagle3 m=3 width=1: 0.47 -> 2.18" in order.measured
    assert "(sim)" not in order.measured and "n=4" not in order.measured


def test_the_reference_definition_of_theoretical_speedup_is_the_per_sample_mean_of_n_N_over_S():
    params = {"n": 8, "ls": 4, "schedule": "input", "width": 1}
    rows = [_row("spd", params, "gsm8k", "input"), _row("spd", params, "mt_bench", "input")]
    rows[1]["steps"], rows[1]["new_tokens"] = 4, 5  # per sample: 8 * 11 / 8 = 11 and 8 * 5 / 4 = 10
    (overall,) = [s for s in summarize(rows) if s.dataset == "overall"]
    assert overall.reference_theoretical == 10.5
    assert abs(overall.theoretical_speedup - (14 / 12) * 30 / 4) < 1e-9  # ours pools: 14 tokens over 12 cycles
    (table,) = [t for t in tables([overall]) if t.title.startswith("Theoretical vs modeled")]
    assert _point(table.rows[0][3:5]) == ["8.75", "10.50"]


def test_the_speedups_figure_shows_prompt_lookup_and_labels_no_empty_parameter():
    from harness.reporting.figures import _label, speedup_rows

    rows = [_row("lookup", {"k": 10, "max_ngram": 3, "width": 1}, "gsm8k"),
            _row("ssd", {"k": 3, "fan_out_list": "", "width": 1}, "gsm8k",
                 draft={"num_layers": 30, "ls": 1, "m": 3, "width": 1})]
    shown = speedup_rows([s for s in summarize(rows) if s.dataset == "overall"])
    labels = [_label(s) for s in shown]
    assert any(label.startswith("lookup ") for label in labels), labels
    assert any(label.startswith("ssd k=3 ") for label in labels) and not any("fan_out_list=" in x for x in labels)


def test_the_speedup_table_says_which_engine_made_each_configuration():
    params = {"k": 10, "max_ngram": 3, "width": 1}
    old, packed, rows, graphed = (_row("lookup", params, "gsm8k") for _ in range(4))
    packed["conditions"] = {"linears": "onednn"}
    rows["conditions"] = {"linears": "rows", "attention": "rows"}
    graphed["conditions"] = {"linears": "default", "compile": {"engine": "inductor", "cuda_graphs": True}}
    for record, engine in ((old, "float32, engine not recorded"), (packed, "float32, eager, packed Linears"),
                           (rows, "float32, eager, row kernel, row attention"),
                           (graphed, "float32, compiled, CUDA graphs, default Linears")):
        (overall,) = [s for s in summarize([record]) if s.dataset == "overall"]
        (table,) = [t for t in tables([overall]) if t.title.startswith("Theoretical vs modeled")]
        assert table.rows[0][-1] == engine


def test_a_configuration_re_measured_on_another_engine_is_a_row_of_its_own():
    """The same configuration (one key) timed on two engines: two summaries, each with its own engine and samples,
    never one that pools their wall-clock; the regression gate's pooling still takes both."""
    from harness.reporting.check import pooled

    params = {"k": 10, "max_ngram": 3, "width": 1}
    before = [_row("lookup", params, dataset) for dataset in ("gsm8k", "humaneval")]
    after = [_row("lookup", params, dataset) for dataset in ("gsm8k", "humaneval")]
    for row in before:
        row["conditions"] = {"linears": "onednn"}
        row["stats"]["finished_at"] = "2026-12-03T10:00:00"
    for row in after:
        row["conditions"] = {"linears": "rows", "attention": "rows"}
        row["timing"] = {"decode": 0.5}
        row["stats"]["finished_at"] = "2026-12-06T02:00:00"
    summaries = summarize(after + before)
    overall = [s for s in summaries if s.dataset == "overall"]
    assert sorted((s.engine, s.samples) for s in overall) == [("float32, eager, packed Linears", 2),
                                                              ("float32, eager, row kernel, row attention", 2)]
    assert sorted(s.wall_clock_speedup for s in overall) == [2.0, 4.0]  # never their mix
    assert find(summaries, "lookup", params, 0.0).engine == "float32, eager, row kernel, row attention"  # the latest
    assert pooled(before + after).samples == 4
    # the by-dataset and losslessness tables tell the two apart by their engine column
    lossless = lossless_table(overall)[0]
    assert sorted(row[-1] for row in lossless.rows) == sorted(s.engine for s in overall)
    detail = detail_table(summaries)
    assert detail.header[-1] == "engine"
    labels = [tuple(row[:5]) + (row[-1],) for row in detail.rows]
    assert len(labels) == len(set(labels)) == 6  # two engines x (two datasets + overall)

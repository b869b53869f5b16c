"""The paired peer bench's table (`spd-bench bench lookup`): each side's tokens/s and its wall-clock ratio over greedy
decoding, the harness's and HF generate's, with 95% intervals over prompts redrawn within each dataset."""

from __future__ import annotations

from harness.reporting.intervals import time_ratio_interval

# The greedy decode each side is measured against: its own implementation's.
BASELINES = {"hf-greedy": "HF generate, greedy", "hf-lookup": "HF generate, prompt_lookup_num_tokens=k",
             "ar": "harness autoregressive", "lookup": "harness lookup"}


def table(record: dict) -> str:
    seconds, tokens = record["seconds"], sum(record["tokens"])
    datasets = [prompt.split("/")[0] for prompt in record["prompts"]]
    key = record.get("config_key", "")

    def ratio(slower: str, faster: str) -> str:
        value, interval = time_ratio_interval(seconds[slower], seconds[faster], datasets, key + slower + faster)
        return f"{value:.2f}x {interval.text()}"

    lines = [(f"{len(datasets)} prompts ({', '.join(record['datasets'])}), {record['max_new_tokens']} new tokens, "
              f"k={record['k']}, {record['dtype']} on {record['device']}; outputs identical to greedy: "
              f"{record['identical']}"),
             "| side | tok/s | over HF greedy | over harness AR |", "|---|---|---|---|"]
    for side, label in BASELINES.items():
        lines.append(f"| {label} | {tokens / sum(seconds[side]):.1f} | {ratio('hf-greedy', side)} | "
                     f"{ratio('ar', side)} |")
    lines.append(f"harness lookup over HF prompt lookup: {ratio('hf-lookup', 'lookup')}")
    return "\n".join(lines) + "\n"

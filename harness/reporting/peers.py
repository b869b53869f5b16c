"""The paired peer bench's table (`spd-bench bench peer`): each side's tokens/s and its wall-clock ratio over greedy
decoding, HF generate's and the harness's, with 95% intervals over prompts redrawn within each dataset."""

from __future__ import annotations

from harness.reporting.intervals import time_ratio_interval


def _labels(record: dict) -> dict[str, str]:
    arguments = ", ".join(f"{key}={value}" for key, value in record["hf_peer"].items())
    return {"hf-greedy": "HF generate, greedy", "hf-peer": f"HF generate, {arguments}",
            "reference": "harness greedy decoding", "method": f"harness {record['method']}"}


def _compiled(record: dict) -> str:
    compiled = (record.get("engine") or {}).get("compile")
    return "" if not compiled else f", harness compiled ({compiled['engine']})"


def table(record: dict) -> str:
    seconds, tokens = record["seconds"], sum(record["tokens"])
    datasets = [prompt.split("/")[0] for prompt in record["prompts"]]
    labels = _labels(record)

    def ratio(slower: str, faster: str) -> str:
        value, interval = time_ratio_interval(seconds[slower], seconds[faster], datasets,
                                              record["config_key"] + slower + faster)
        return f"{value:.2f}x {interval.text()}"

    params = ", ".join(f"{key}={value}" for key, value in record["params"].items())
    lines = [(f"{len(datasets)} prompts ({', '.join(record['datasets'])}), {record['max_new_tokens']} new tokens, "
              f"harness {record['method']} {params}; {record['dtype']} on {record['device']}{_compiled(record)}; "
              f"outputs identical to greedy: {record['identical']}"),
             "| side | tok/s | over HF greedy | over harness greedy |", "|---|---|---|---|"]
    for side, label in labels.items():
        lines.append(f"| {label} | {tokens / sum(seconds[side]):.1f} | {ratio('hf-greedy', side)} | "
                     f"{ratio('reference', side)} |")
    lines.append(f"{labels['method']} over {labels['hf-peer']}: {ratio('hf-peer', 'method')}")
    return "\n".join(lines) + "\n"

"""Speculative pipeline decoding (SPD) and its pipelined-drafter ablation (PPSD)."""

from methods.pipeline import ppsd, spd  # noqa: F401  (registers the family's methods)

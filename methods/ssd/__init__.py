"""Speculative speculative decoding (SSD): the next round is drafted while this one is verified."""

from methods.ssd import method  # noqa: F401  (registers the method)

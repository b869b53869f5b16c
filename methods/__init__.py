"""Decoding methods behind one contract (methods.base); importing this package registers them all."""

from methods import autoregressive, eagle3, lookup, medusa, pipeline, ssd  # noqa: F401  (registers the methods)

"""EAGLE-3: a trained one-layer head drafts a chain or a tree the target verifies in one forward."""

from methods.eagle3 import method  # noqa: F401  (registers the method)

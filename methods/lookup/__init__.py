"""Prompt lookup decoding: drafts copied from earlier in the sequence, no drafter to train."""

from methods.lookup import method  # noqa: F401  (registers the method)

"""Medusa: heads on the target's last hidden state each guess one more token ahead; a fixed sparse tree of their
top candidates is verified in one forward."""

from methods.medusa import method  # noqa: F401  (registers the method)

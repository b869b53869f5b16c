"""`python -m harness.cli ...` (how torchrun starts every rank of a distributed run; "--" before the command
keeps torchrun from taking --n or --model for abbreviations of its own options)."""

from harness.cli import main

main()

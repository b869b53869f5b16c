"""spd-bench harness: the layers around the methods, one folder each (runtime below them; training, bench,
reporting and the command line above them)."""

__version__ = "0.1.0"

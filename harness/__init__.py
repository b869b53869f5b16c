"""spd-bench harness: target runtime, data, runner, results and reports shared by every decoding method."""

__version__ = "0.1.0"

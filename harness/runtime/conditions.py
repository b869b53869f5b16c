"""The conditions a timing was measured under: the machine's load before and after, the cores this process may use,
its torch threads and the processor. Two jobs that each spin a thread per core slow each other many times over, so a
wall-clock figure means little without them; a sample is marked busy when the 1-minute load average exceeded the
usable cores by more than BUSY_MARGIN (this run's own threads count towards the load, so a run alone stays near its
thread count)."""

from __future__ import annotations

import functools
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

BUSY_MARGIN = 0.5  # runnable threads beyond the cores: short-lived helpers and daemons stay below it


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not offered on this platform
        return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def is_busy(load: float | None, cores: int) -> bool:
    return load is not None and load > cores + BUSY_MARGIN


@functools.cache
def processor(device_type: str) -> str:
    """The GPU's name on CUDA, else the CPU's model name."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@dataclass
class Conditions:
    load_before: float | None
    load_after: float | None
    cores: int
    threads: int
    processor: str

    @property
    def busy(self) -> bool:
        return any(is_busy(load, self.cores) for load in (self.load_before, self.load_after))

    def to_dict(self) -> dict:
        return {**asdict(self), "busy": self.busy}


class Measuring:
    """The conditions around one timed sample: `start()` before, `end()` after."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.before: float | None = None

    def start(self) -> None:
        self.before = load_average()

    def end(self) -> Conditions:
        return Conditions(self.before, load_average(), usable_cores(), torch.get_num_threads(),
                          processor(self.device_type))


def busy_warning() -> str | None:
    """One line when the machine is already loaded beyond its cores before a run times anything."""
    load, cores = load_average(), usable_cores()
    if not is_busy(load, cores):
        return None
    return (f"warning: load average {load:.1f} on {cores} usable cores before timing: other jobs are running, so "
            f"this run's wall-clock figures will be slow and are marked busy in its records and the report; run "
            f"alone, or give each job its share of the cores (OMP_NUM_THREADS)")


def other_load(samples: int = 5, interval_s: float = 0.1) -> float:
    """Runnable threads of other processes now: the median of a few instantaneous counts (the 1-minute average lags
    a job that just started; one read can catch a passing blip) less this process's own running thread."""
    counts = []
    for k in range(samples):
        try:
            with open("/proc/loadavg", encoding="utf-8") as fh:
                counts.append(max(0, int(fh.read().split()[3].split("/")[0]) - 1))
        except (OSError, ValueError, IndexError):
            return load_average() or 0.0
        if k + 1 < samples:
            time.sleep(interval_s)
    return statistics.median(counts)


def fit_threads() -> str | None:
    """Size torch's threads to the cores other jobs leave free (at least one), unless OMP_NUM_THREADS says how many:
    a two-thread decode beside two busy processes ran 5.4 tok/s, the same with one thread 10.5-13.2 (README);
    alone the count stays what torch chose. Returns a note when it changed the count."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    current, others, cores = torch.get_num_threads(), round(other_load()), usable_cores()
    free = max(1, cores - others)
    if free >= current:
        return None
    torch.set_num_threads(free)
    return (f"note: other jobs keep {others} threads running on {cores} usable cores: decoding with {free} "
            f"thread(s) instead of {current} (set OMP_NUM_THREADS to choose)")

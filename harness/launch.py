"""Starting and stopping the ranks of a distributed run.

Two ways in. `spd-bench run ... --executor distributed` starts its own served ranks on this machine (spawned
processes: one per pipeline stage, or SSD's drafter; a free port on the loopback); the calling process becomes rank
0, the driver. Under `torchrun` (several nodes) every rank runs the same command line: rank 0 drives, the others
serve (`serve_from_env`). A served rank first receives the driver's plan, which names the server it runs. Either
way the group uses NCCL when the driver and every served rank have CUDA devices of their own and gloo otherwise, and
every wait is bounded by `--timeout`: a rank that dies or stops answering ends the run with one line.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from harness.errors import HarnessError
from methods.pipeline_distributed import StageGroup

EXECUTORS = ("local", "distributed")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def stage_devices(devices: str | None, driver_device: str, n: int, why: str = "") -> list[str]:
    """One device per served rank (a pipeline stage, SSD's drafter) from `--devices` (comma list); by default every
    rank on the driver's device type. `why` says where the count comes from, for the error."""
    if not devices:
        return ["cpu" if driver_device == "cpu" else driver_device] * n
    listed = [d.strip() for d in devices.split(",") if d.strip()]
    if len(listed) != n:
        raise HarnessError(f"--devices lists {len(listed)} devices but {why or f'the run serves {n} ranks'}")
    for device in listed:
        if device != "cpu" and not device.startswith("cuda"):
            raise HarnessError(f"--devices entry {device!r} is neither cpu nor cuda[:k]")
    return listed


def backend_for(driver_device: str, devices: list[str]) -> str:
    """NCCL when every rank has a GPU of its own; gloo otherwise (host memory in between), since NCCL refuses two
    ranks on one GPU."""
    ranks = [d if d != "cuda" else "cuda:0" for d in (driver_device, *devices)]
    return "nccl" if all(d.startswith("cuda") for d in ranks) and len(set(ranks)) == len(ranks) else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_parent(parent: int) -> None:
    """A served rank whose driver vanished (killed outright) exits instead of waiting out the timeout."""

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _serve(rank: int, device: str, backend: str, init: str, world: int, timeout_s: float) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        torch.set_num_threads(1)  # one core per stage process on a CPU host
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    wire = torch.device(device) if backend == "nccl" else torch.device("cpu")
    try:
        received = [None]
        dist.broadcast_object_list(received, src=0)  # the driver's plan says what this rank serves
        received[0].server(rank, device, wire).serve()
    except Exception as exc:  # noqa: BLE001 - a rank reports any failure in one line and leaves
        print(f"error: rank {rank}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}",
              file=sys.stderr, flush=True)
        os._exit(1)
    dist.destroy_process_group()


def _spawned(rank: int, device: str, backend: str, init: str, world: int, timeout_s: float, parent: int) -> None:
    _watch_parent(parent)
    _serve(rank, device, backend, init, world, timeout_s)


def serve_from_env(devices: list[str], driver_device: str, timeout_s: float) -> None:
    """A torchrun rank other than 0: serve stage RANK-1 on its `--devices` entry until the driver stops."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != len(devices) + 1:
        raise HarnessError(f"torchrun started {world} ranks; this run needs {len(devices) + 1} (one driver and "
                           f"{len(devices)} served)")
    _serve(rank, devices[rank - 1], backend_for(driver_device, devices), "env://", world, timeout_s)


@contextmanager
def stage_group(model: str, driver_device: str, devices: list[str], timeout_s: float):
    """Rank 0's process group for the run: served ranks spawned here (or already started by torchrun); on exit,
    however it is left, the group is torn down and no spawned process outlives it."""
    backend = backend_for(driver_device, devices)
    world = len(devices) + 1
    processes = []
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise HarnessError(f"torchrun started {os.environ['WORLD_SIZE']} ranks; this run needs {world} (one driver "
                               f"and {len(devices)} served)")
        init = "env://"
    else:
        init = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")
        for rank in range(1, world):
            process = context.Process(target=_spawned, daemon=True, name=f"spd-stage-{rank}",
                                      args=(rank, devices[rank - 1], backend, init, world, timeout_s, os.getpid()))
            process.start()
            processes.append(process)
    if driver_device.startswith("cuda"):
        torch.cuda.set_device(torch.device(driver_device))
    try:
        dist.init_process_group(backend, init_method=init, rank=0, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as exc:
        _stop(processes)
        raise HarnessError(f"distributed pipeline: the stage ranks did not join within {timeout_s:g} s ({exc}); "
                           f"raise --timeout or check that every rank can start") from None
    finished = False
    try:
        yield StageGroup(model=model, devices=devices, backend=backend, timeout_s=timeout_s)
        finished = True
    finally:
        _stop(processes, grace_s=10 if finished else 0)  # after a failure nobody waits for the ranks
        dist.destroy_process_group()


def _stop(processes: list, grace_s: float = 0) -> None:
    """Wait up to `grace_s` for the ranks to leave, then kill the rest (SIGKILL: a stopped or hung rank ignores
    anything milder)."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=5)

"""Starting, watching and stopping the ranks of a distributed run.

Two ways in. `spd-bench run ... --executor distributed` starts its own served ranks on this machine (spawned
processes: one per pipeline stage, or SSD's drafter); the calling process becomes rank 0, the driver. Under
`torchrun` (several nodes) every rank runs the same command line: rank 0 drives, the others serve
(`serve_from_env`). Either way the group uses NCCL when the driver and every served rank have CUDA devices of their
own and gloo otherwise.

Two deadlines, because starting a rank and answering within a run cost very different times. Starting (spawn,
import torch and transformers, receive the driver's plan, load what the rank serves) is bounded by the join
deadline (`--join-timeout`): the ranks report each step in a key-value store, the driver polls it, and a spawned
rank that exits meanwhile ends the wait at once with its own one-line reason. Only when every rank has built its
part does the process group form, with the run deadline (`--timeout`) on every wait from then on: a rank that dies
or stops answering mid-run ends the run with one line.
"""

from __future__ import annotations

import io
import math
import multiprocessing
import os
import pickle
import re
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from harness.runtime.devices import indexed
from harness.runtime.errors import HarnessError, first_line

EXECUTORS = ("local", "distributed")
DEVICE = re.compile(r"cpu|cuda(:\d+)?")
LONGEST_WAIT_S = 7 * 24 * 3600.0  # a week: beyond it a deadline is a typo (and timedelta overflows near 1e14 s)
SHORTEST_START_S = 1.0  # no rank starts a Python process, joins the group and loads its part sooner
PREFIX = "spd-bench"  # our keys in a store that torchrun's agent may share with others


def check_deadline(option: str, seconds: float, shortest: float = 0.0) -> None:
    """A deadline in seconds: above 0, at least `shortest` where less can never be met, at most a week."""
    if not (math.isfinite(seconds) and 0 < seconds <= LONGEST_WAIT_S and seconds >= shortest):
        low = f"from {shortest:g}" if shortest else "above 0"
        raise HarnessError(f"{option} must be a number of seconds {low} and up to {LONGEST_WAIT_S:.0f} (a week), "
                           f"got {seconds:g}")


def under_torchrun() -> bool:
    """torchrun sets all four; a cluster job that only exports RANK and WORLD_SIZE starts its own ranks."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def check_device(device: str, option: str, here: bool) -> None:
    """`device` is cpu or cuda[:k]; `here`: it must exist on this machine (the ranks this process spawns)."""
    if not DEVICE.fullmatch(device):
        raise HarnessError(f"{option} entry {device!r} is neither cpu nor cuda[:k]")
    if not here or device == "cpu":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise HarnessError(f"{option} names {device} but this machine has {count or 'no'} CUDA device"
                           f"{'' if count == 1 else 's'}; use cpu or a device it has")


def stage_devices(devices: str | None, driver_device: str, n: int, why: str = "") -> list[str]:
    """One device per served rank (a pipeline stage, SSD's drafter) from `--devices` (comma list); by default every
    rank on the driver's device type. `why` says where the count comes from, for the error."""
    if not devices:
        return ["cpu" if driver_device == "cpu" else driver_device] * n
    listed = [d.strip() for d in devices.split(",") if d.strip()]
    if len(listed) != n:
        raise HarnessError(f"--devices lists {len(listed)} devices but {why or f'the run serves {n} ranks'}")
    for device in listed:  # under torchrun a served rank's device lives on its own node: only its form is checked
        check_device(device, "--devices", here=not under_torchrun())
    return listed


def backend_for(driver_device: str, devices: list[str], per_node: int | None = None) -> str:
    """NCCL when every rank has a GPU of its own; gloo otherwise (host memory in between), since NCCL refuses two
    ranks on one GPU. A GPU is a (node, device) pair: under torchrun rank r runs on node r // `per_node` (its
    LOCAL_WORLD_SIZE), so two nodes' cuda:0 are two GPUs; ranks this process spawns share its node."""
    ranks = [indexed(d) for d in (driver_device, *devices)]
    gpus = {(rank // per_node if per_node else 0, device) for rank, device in enumerate(ranks)}
    return "nccl" if all(d.startswith("cuda") for d in ranks) and len(gpus) == len(ranks) else "gloo"


def join_group(backend: str, store: dist.Store, rank: int, world: int, timeout_s: float) -> None:
    """The process group, every wait in it bounded by the run deadline. NCCL's send, recv and wait only order the
    stream and return at once, so a rank that died would hang its peers until the watchdog; blocking wait makes each
    of them wait on the host for its work, up to the group's timeout, and raise, so a lost rank ends the run in one
    line within --timeout as on gloo."""
    if backend == "nccl":
        os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def ranks_per_node() -> int | None:
    """torchrun's ranks per node (LOCAL_WORLD_SIZE); None for ranks this process spawns, all on its node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"]) if under_torchrun() else None


class PlanUnpickler(pickle.Unpickler):
    """Reads the plan a served rank gets from the group's store: a dataclass of this harness with plain values,
    tensors and generators. Only classes and functions defined in harness/ or methods/ and torch's tensor rebuilders
    are built, and tensor storage is read weights-only, so nothing else in the bytes can run code."""

    OURS = ("harness", "methods")
    TORCH = {("collections", "OrderedDict"), ("torch", "device"), ("torch", "Size"), ("torch._C", "Generator"),
             ("torch._utils", "_rebuild_tensor_v2")}

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda data: torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if (module, name) in self.TORCH:
            return super().find_class(module, name)
        if module.split(".")[0] in self.OURS and "." not in name:
            found = super().find_class(module, name)
            if getattr(found, "__module__", "").split(".")[0] in self.OURS:  # defined here, not merely imported
                return found
        raise pickle.UnpicklingError(f"the plan names {module}.{name}, which a served rank does not build")


# --- the wire ---------------------------------------------------------------------------------------------------------
STOP = 0  # op 0 of every family's protocol: a served rank's loop ends


class Channel:
    """The one wire protocol of every served family: a control vector of `size` integers broadcast by the driver
    (rank 0) to every rank, its first the operation, and tensors point to point between the driver and one rank.
    On the driver every wait goes through `guard` (StageGroup.guarded: the run deadline and one line naming the failed
    rank); a served rank's failure ends its loop and reaches the driver through the group."""

    def __init__(self, wire: torch.device, device: torch.device, size: int, guard: Callable | None = None):
        self.wire, self.device, self.size = wire, device, size
        self.guard = guard or (lambda action: action())

    def control(self, op: int, *values: int, tail: list[int] = ()) -> None:
        """The driver's next operation for every rank: `values` after the op, `tail` at the vector's end."""
        vector = torch.zeros(self.size, dtype=torch.long)
        vector[0] = op
        vector[1: 1 + len(values)] = torch.tensor(values, dtype=torch.long)
        if tail:
            vector[self.size - len(tail):] = torch.tensor(tail, dtype=torch.long)
        self.guard(lambda: dist.broadcast(vector.to(self.wire), src=0))

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self.guard(lambda: dist.send(tensor.to(self.wire).contiguous(), dst=peer))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=self.wire)
        self.guard(lambda: dist.recv(buffer, src=peer))
        return buffer.to(self.device)

    def exchange(self, outgoing: list[tuple[int, torch.Tensor]], incoming: list[tuple[int, torch.Tensor]]) -> None:
        """Post every send and receive at once, then wait (the ranks of one step compute concurrently); `incoming`
        buffers live on the wire."""

        def run():
            works = [dist.isend(t.to(self.wire).contiguous(), dst=rank) for rank, t in outgoing]
            works += [dist.irecv(buffer, src=rank) for rank, buffer in incoming]
            for work in works:
                work.wait()

        self.guard(run)

    def serve(self, handlers: dict[int, Callable[[list[int]], None]]) -> None:
        """A served rank's loop: each control vector's operation runs its handler (with the values after the op)
        until the driver sends STOP."""
        vector = torch.zeros(self.size, dtype=torch.long, device=self.wire)
        while True:
            dist.broadcast(vector, src=0)
            op, *values = vector.tolist()
            if op == STOP:
                return
            if op not in handlers:
                raise HarnessError(f"the driver sent operation {op}, which this rank does not serve")
            with torch.inference_mode():  # a rank only decodes: no autograd records (a compiled step needs none)
                handlers[op](values)


# --- the driver's side ----------------------------------------------------------------------------------------------
@dataclass
class StageGroup:
    """The driver's view of the served ranks: started (`start`) with a plan only once the method has checked that the
    group fits it, then every exchange goes through `guarded`, which turns a failure into one line."""

    model: str
    devices: list[str]  # one per served rank
    backend: str
    timeout_s: float  # the run deadline
    join_timeout_s: float  # the start deadline
    store: dist.Store = field(repr=False)
    processes: list = field(default_factory=list, repr=False)  # spawned ranks; empty under torchrun
    started: bool = False

    @property
    def world_size(self) -> int:
        return len(self.devices) + 1

    @property
    def wire(self) -> torch.device:
        """Where exchanged tensors live: the driver's GPU under NCCL, host memory under gloo."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def start(self, plan) -> None:
        """Hand every served rank `plan` (whose `server(rank, device, wire)` says what the rank runs), wait until each
        has built it, then form the process group."""
        try:
            self.store.set("plan", pickle.dumps(plan))
            self._wait_until_ready()
            self.store.set("go", b"1")
            join_group(self.backend, dist.PrefixStore("group", self.store), 0, self.world_size, self.timeout_s)
        except (RuntimeError, dist.DistError) as exc:  # the store's host or a rank went away mid-start
            reason = self._rank_failure() or first_line(exc)
            raise HarnessError(f"distributed run: the ranks did not form a group ({reason}); nothing was "
                               f"decoded") from None
        self.started = True

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.join_timeout_s
        ranks = range(1, self.world_size)
        while True:
            waiting = [r for r in ranks if not self.store.check([f"ready/{r}"])]
            if not waiting:
                return
            reason = self._rank_failure()
            if reason:
                raise HarnessError(f"distributed run: {reason} while starting; nothing was decoded")
            if time.monotonic() > deadline:
                silent = [r for r in waiting if not self.store.check([f"started/{r}"])]
                raise HarnessError(
                    f"distributed run: rank(s) {', '.join(map(str, waiting))} did not finish starting within the join "
                    f"deadline (--join-timeout {self.join_timeout_s:g} s)"
                    + (f"; rank(s) {', '.join(map(str, silent))} never reached the driver" if silent else
                       "; they were still loading what they serve")
                    + ": raise --join-timeout on a slow or busy machine")
            time.sleep(0.1)

    def _rank_failure(self) -> str | None:
        """Why the group failed, root cause first: a spawned rank killed by a signal (the others' errors then follow
        from it), a served rank's own one-line reason, or the exit of a spawned rank that left none."""
        exits = {rank: p.exitcode for rank, p in enumerate(self.processes, start=1) if p.exitcode is not None}
        for rank, code in exits.items():
            if code < 0:
                return f"rank {rank} ({self.devices[rank - 1]}) exited (signal {-code})"
        for rank in range(1, self.world_size):
            if self.store.check([f"error/{rank}"]):
                return f"rank {rank} ({self.devices[rank - 1]}) failed: {self.store.get(f'error/{rank}').decode()}"
        if exits:
            rank, code = next(iter(exits.items()))
            return f"rank {rank} ({self.devices[rank - 1]}) exited (exit code {code})"
        return None

    def channel(self, role: str, device: torch.device, size: int) -> Channel:
        """The driver's end of the wire to the `role` ranks, its tensors received onto `device`."""
        return Channel(self.wire, device, size, lambda action: self.guarded(action, role))

    def guarded(self, action: Callable, role: str):
        """Run one exchange with the ranks; a rank that died or let the run deadline pass ends the run in one line."""
        try:
            return action()
        except (RuntimeError, dist.DistError) as exc:
            time.sleep(0.2)  # a dying rank's reason reaches the store a moment after its socket closes
            reason = self._rank_failure() or first_line(exc)
            raise HarnessError(f"distributed run: a {role} rank stopped answering ({reason}); the run deadline is "
                               f"--timeout {self.timeout_s:g} s") from None


@contextmanager
def stage_group(model: str, driver_device: str, devices: list[str], timeout_s: float, join_timeout_s: float = 900.0):
    """Rank 0's group for the run: served ranks spawned here (or already started by torchrun) but not yet waited for;
    on exit, however it is left, the group is torn down and no spawned process outlives it."""
    check_deadline("--timeout", timeout_s)
    check_deadline("--join-timeout", join_timeout_s, SHORTEST_START_S)
    world, backend = len(devices) + 1, backend_for(driver_device, devices, ranks_per_node())
    processes = []
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise HarnessError(f"torchrun started {os.environ['WORLD_SIZE']} ranks; this run needs {world} (one driver "
                               f"and {len(devices)} served)")
        store = torchrun_store(0, join_timeout_s)
    else:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=join_timeout_s))
        context = multiprocessing.get_context("spawn")
        for rank in range(1, world):
            process = context.Process(target=_spawned, daemon=True, name=f"spd-rank-{rank}",
                                      args=(rank, devices[rank - 1], backend, store.port,
                                            world, timeout_s, join_timeout_s, os.getpid()))
            process.start()
            processes.append(process)
    if driver_device.startswith("cuda"):
        torch.cuda.set_device(torch.device(indexed(driver_device)))
    group = StageGroup(model=model, devices=devices, backend=backend, timeout_s=timeout_s,
                       join_timeout_s=join_timeout_s, store=dist.PrefixStore(PREFIX, store), processes=processes)
    finished = False
    try:
        yield group
        finished = True
    finally:
        _stop(processes, grace_s=10 if finished else 0)  # after a failure nobody waits for the ranks
        if group.started:
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


# --- a served rank's side -------------------------------------------------------------------------------------------
def torchrun_store(rank: int, join_timeout_s: float) -> dist.Store:
    try:
        store, _, _ = next(dist.rendezvous("env://", rank=rank, timeout=timedelta(seconds=join_timeout_s)))
    except (RuntimeError, ValueError, dist.DistError) as exc:
        raise HarnessError(f"torchrun rank {rank} could not reach the group's store at {os.environ['MASTER_ADDR']}:"
                           f"{os.environ['MASTER_PORT']} within the join deadline (--join-timeout "
                           f"{join_timeout_s:g} s): {first_line(exc)}") from None
    return store


def _watch_parent(parent: int) -> None:
    """A served rank whose driver vanished (killed outright) exits instead of waiting out a deadline."""

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _serve(rank: int, device: str, backend: str, connect: Callable[[], dist.Store], world: int, timeout_s: float,
           join_timeout_s: float) -> None:
    """Start (report, receive the plan, build the server, wait for the group), then serve until the driver stops;
    any failure is one line, in the store for the driver and on stderr, and the rank leaves."""
    store = None
    try:
        store = dist.PrefixStore(PREFIX, connect())
        store.set(f"started/{rank}", b"1")
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(indexed(device)))
        else:
            torch.set_num_threads(1)  # one core per served rank on a CPU host
        try:
            plan = PlanUnpickler(io.BytesIO(store.get("plan"))).load()
        except dist.DistError:
            raise HarnessError(f"the driver sent no plan within the join deadline (--join-timeout "
                               f"{join_timeout_s:g} s)") from None
        wire = torch.device(device) if backend == "nccl" else torch.device("cpu")
        server = plan.server(rank, device, wire)
        store.set(f"ready/{rank}", b"1")
        store.wait(["go"])
        join_group(backend, dist.PrefixStore("group", store), rank, world, timeout_s)
        server.serve()
    except Exception as exc:  # noqa: BLE001 - a rank reports any failure in one line and leaves
        line = first_line(exc)
        if store is not None:
            try:
                store.set(f"error/{rank}", line.encode())
            except Exception:  # noqa: BLE001 - the driver may be gone already; stderr still has the line
                pass
        print(f"error: rank {rank}: {line}", file=sys.stderr, flush=True)
        os._exit(2)
    dist.destroy_process_group()


def _spawned(rank: int, device: str, backend: str, port: int, world: int, timeout_s: float, join_timeout_s: float,
             parent: int) -> None:
    _watch_parent(parent)

    def connect() -> dist.Store:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=join_timeout_s))

    _serve(rank, device, backend, connect, world, timeout_s, join_timeout_s)


def serve_from_env(devices: list[str], driver_device: str, timeout_s: float, join_timeout_s: float) -> None:
    """A torchrun rank other than 0: serve what the driver's plan names on its `--devices` entry until it stops."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != len(devices) + 1:
        raise HarnessError(f"torchrun started {world} ranks; this run needs {len(devices) + 1} (one driver and "
                           f"{len(devices)} served)")
    check_deadline("--timeout", timeout_s)
    check_deadline("--join-timeout", join_timeout_s, SHORTEST_START_S)
    check_device(devices[rank - 1], "--devices", here=True)
    _serve(rank, devices[rank - 1], backend_for(driver_device, devices, ranks_per_node()),
           lambda: torchrun_store(rank, join_timeout_s),
           world, timeout_s, join_timeout_s)

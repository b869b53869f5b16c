"""The ranks of one data-parallel `spd-bench train` (torchrun, or srun through torchrun): who they are, what they sum
and what they must agree on.

Every rank runs the same command line, takes its rows of each global batch, and the drafters' gradients are summed
over the ranks after backward (one flat fp32 all-reduce per drafter and step) before clipping and the optimiser
step, so every rank steps the same weights. The loop does not wrap the drafters in DistributedDataParallel: a
family's objective calls its drafter through its own functions (not one `forward`), and the loss is already a sum
over each rank's assistant tokens divided by the global count, so a plain sum of the ranks' gradients is the
one-process gradient of the global batch; DDP's average would have to be undone. Drafters are a layer or a few, so
their gradient all-reduce is small next to the teacher pass it follows.

A failed exchange names the rank that caused it: each rank notes in the group's store where it runs (host, pid) and
the last step whose exchange it reached, so a peer that was killed, stopped or is still computing is named in the
one line every survivor ends with.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from harness.runtime.distributed import check_deadline, join_group, torchrun_store, under_torchrun
from harness.runtime.errors import HarnessError, first_line

PREFIX = "spd-bench/train"
GONE, STOPPED = "is gone (killed or exited)", "is stopped"


class Quiet(SystemExit):
    """A rank other than 0 leaves with exit code 2 and no line of its own: rank 0 prints the one line for all."""

    def __init__(self):
        super().__init__(2)


@dataclass
class Ranks:
    """This process's place in the run: rank 0 of 1 when not under torchrun (every collective is then a no-op)."""

    rank: int = 0
    world: int = 1
    timeout_s: float = 1800.0
    store: dist.Store | None = field(default=None, repr=False)
    step: int = -1  # the step whose exchange this rank is in (for naming a peer that never reached it)

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks, in place."""
        if self.world > 1:
            self._guarded(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM))
        return tensor

    def sum_grads(self, params: list[torch.nn.Parameter], extra: torch.Tensor) -> torch.Tensor:
        """Every parameter's gradient and `extra` (figures for the progress bar) summed over the ranks in one flat
        fp32 all-reduce; a parameter without a gradient counts as zeros. Returns the summed `extra`."""
        if self.world == 1:
            return extra
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [extra.float().reshape(-1)])
        self.sum(flat)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g).to(p.dtype)
            offset += g.numel()
        return flat[offset:]

    def from_lead(self, value):
        """Rank 0's `value` on every rank (any picklable object: a checkpoint's state, the draft vocabulary)."""
        if self.world == 1:
            return value
        box = [value if self.lead else None]
        self._guarded(lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def gather(self, value) -> list:
        """Every rank's `value`, by rank."""
        if self.world == 1:
            return [value]
        out = [None] * self.world
        self._guarded(lambda: dist.all_gather_object(out, value))
        return out

    def verdict(self, error: str | None) -> None:
        """Stop every rank when any rank has an error: rank 0 raises the first (lowest rank's) line, the others
        leave quietly, so a bad input is one `error:` line whichever rank met it."""
        errors = [e for e in self.gather(error) if e]
        if not errors:
            return
        if self.lead:
            raise HarnessError(errors[0])
        raise Quiet()

    def together(self, action: Callable):
        """`action()` on every rank; a HarnessError on any rank stops them all (`verdict`)."""
        try:
            result, error = action(), None
        except HarnessError as exc:
            result, error = None, str(exc)
        self.verdict(error)
        return result

    def agree(self, what: dict[str, object]) -> None:
        """Every rank holds the same `what` (options, weights hash); else one line naming the first rank that differs
        and the entries it differs on."""
        mine = json.loads(json.dumps(what, sort_keys=True, default=str))
        error = None
        for rank, theirs in enumerate(self.gather(mine)):
            differing = sorted(key for key in mine if theirs.get(key) != mine.get(key))
            if differing:
                shown = "; ".join(f"{key}: {_short(theirs.get(key))} on rank {rank}, {_short(mine.get(key))} on rank "
                                  f"{self.rank}" for key in differing[:3])
                error = (f"the training ranks disagree ({shown}): start every rank with the same command line, "
                         f"model files and corpus")
                break
        self.verdict(error if self.lead else None)

    def enter(self, step: int) -> None:
        """Note that this rank reached step `step`'s exchange."""
        if self.world == 1:
            return
        self.step = step
        if self.store is not None:
            self.store.set(f"at/{self.rank}", str(step))

    def _guarded(self, action: Callable) -> None:
        try:
            action()
        except (RuntimeError, dist.DistError) as exc:
            raise HarnessError(self._failure(f"a peer stopped answering ({first_line(exc)})")) from None

    def stopped(self, signum=None, frame=None):
        """SIGTERM from the launcher (torchrun ends every rank once one has failed): the same one line."""
        raise HarnessError(self._failure("stopped by the launcher (SIGTERM)"))

    def _failure(self, otherwise: str) -> str:
        """The one line a survivor ends with: which rank failed and how (`otherwise` when no peer can be named), and
        the deadline."""
        where = f"step {self.step + 1}" if self.step >= 0 else "start-up"
        cause = self._blame() or otherwise
        return (f"training rank {self.rank} stopped at {where}: {cause}; the run deadline is --timeout "
                f"{self.timeout_s:g} s and the last checkpoint is kept (continue with --resume)")

    def _blame(self) -> str | None:
        """The ranks that failed, as this rank can see them: on its host by their process (gone or stopped),
        elsewhere by the last exchange they reached."""
        if self.store is None:
            return None
        lines = []
        for rank in range(self.world):
            if rank == self.rank:
                continue
            try:
                host, pid = self.store.get(f"pid/{rank}").decode().split(":")
                at = int(self.store.get(f"at/{rank}").decode()) if self.store.check([f"at/{rank}"]) else -1
            except (RuntimeError, dist.DistError, ValueError):
                return None  # the store itself is gone (its host died): nothing more to tell
            state = _process_state(int(pid)) if host == socket.gethostname() else None
            if state == STOPPED:  # it can never answer, and would hold its memory until the launcher's grace ends
                os.kill(int(pid), signal.SIGKILL)
                state += ", so this rank ended it"
            if state:
                lines.append(f"rank {rank} (pid {pid}) {state}")
            elif at < self.step:
                lines.append(f"rank {rank} never reached step {self.step + 1}'s exchange")
        return "; ".join(lines) or None

    def leave(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


ALONE = Ranks()  # one process: every collective a no-op, nothing noted


def _process_state(pid: int) -> str | None:
    """'is gone' or 'is stopped' for a process on this host that cannot answer; None while it runs."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return GONE
    except OSError:
        return None
    return {"T": STOPPED, "t": STOPPED, "Z": GONE}.get(state)


def _short(value, limit: int = 60) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def join(timeout_s: float, device: str, join_timeout_s: float = 900.0) -> Ranks:
    """This process's ranks: one alone, or its place in torchrun's group (NCCL where the ranks train on GPUs, gloo
    otherwise), every collective bounded by the run deadline."""
    check_deadline("--timeout", timeout_s)
    if not under_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return Ranks(timeout_s=timeout_s)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.PrefixStore(PREFIX, torchrun_store(rank, join_timeout_s))
    store.set(f"pid/{rank}", f"{socket.gethostname()}:{os.getpid()}")
    ranks = Ranks(rank=rank, world=world, timeout_s=timeout_s, store=store)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    try:
        join_group(backend, dist.PrefixStore("group", store), rank, world, timeout_s)
    except (RuntimeError, dist.DistError) as exc:
        raise HarnessError(f"training rank {rank}: the ranks did not form a group ({first_line(exc)})") from None
    signal.signal(signal.SIGTERM, ranks.stopped)
    return ranks


def rank_device(device: str) -> str:
    """Each rank's own GPU under torchrun: `cuda` means cuda:LOCAL_RANK."""
    if device == "cuda" and under_torchrun():
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return device

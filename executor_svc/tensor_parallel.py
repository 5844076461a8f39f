"""The tensor-parallel group: one executor spread over N ranks with
torch.distributed (NCCL between CUDA devices, gloo on CPU).

Rank 0 serves gRPC and drives the others through the group alone: it
forwards each step plan, reset and shutdown as a control message (over a
separate gloo group, so control never queues behind device work), samples
alone, and broadcasts the sampled ids, so that every rank's mirror of the
request tokens stays the same. Every rank runs the same forward pass on its
shard (sharding.py); the model's all-reduces and the logits gather are the
only device traffic.

Failures are fail-stop: a rank that exits, or does not answer a collective
within EXECUTOR_TENSOR_PARALLEL_TIMEOUT_S, stops the whole group with a
non-zero exit. A group that half-runs a step cannot be repaired, and the
scheduler already carries its requests across an executor restart. Errors
every rank meets alike (a bad plan, an injected fault) are raised before
the first collective on every rank, so each resets and the group serves on.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from executor_svc.model.sharding import Shard, check_size
from llmsched.errors import StartupError
from llmsched.server import free_port
from llmsched.server import exit_now

log = logging.getLogger(__name__)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Set on the ranks rank 0 starts itself (no torchrun): they leave signals to
# rank 0, which stops them with a shutdown message, and die with it.
SPAWNED_VAR = "LLMSCHED_TP_SPAWNED"
FAIL_STOP_EXIT = 1

# Control messages, rank 0 -> every rank. The LoRA ones register a runtime
# adapter (payload: a RegisterLoraAdapterRequest), forget one (payload: its
# key) or forget them all (a new step stream).
STEP, RESET, HEARTBEAT, SHUTDOWN, LORA_REGISTER, LORA_UNREGISTER, LORA_FORGET = 1, 2, 3, 4, 5, 6, 7


def fail_stop(what: str) -> NoReturn:
    """Ends this rank at once, with a non-zero exit. os._exit: a rank stuck
    in a collective or with a half-run step must not run cleanup that waits
    on its peers."""
    log.critical("tensor-parallel group stops: %s", what)
    exit_now(FAIL_STOP_EXIT)


def is_worker_rank(settings) -> bool:
    """Whether this process is a rank other than 0 (serves no gRPC)."""
    return settings.tensor_parallel_size > 1 and int(os.environ.get("RANK", "0")) != 0


def rank_device(setting: str, local_rank: int, size: int) -> torch.device:
    """EXECUTOR_DEVICE for one rank: auto or cuda mean cuda:LOCAL_RANK."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(setting)
    if size == 1 or device.type == "cpu":
        return device
    if device.type != "cuda" or device.index is not None:
        raise StartupError(f"EXECUTOR_DEVICE={setting!r}: with EXECUTOR_TENSOR_PARALLEL_SIZE={size} use auto, cuda "
                           f"or cpu (each rank takes cuda:LOCAL_RANK)")
    if local_rank >= torch.cuda.device_count():
        raise StartupError(f"EXECUTOR_TENSOR_PARALLEL_SIZE={size}: rank with LOCAL_RANK={local_rank} needs CUDA device "
                           f"{local_rank}, but this node has {torch.cuda.device_count()}")
    return torch.device("cuda", local_rank)


def _die_with_parent() -> None:
    # Linux: SIGKILL this process when the rank 0 that started it dies, so
    # a killed executor never leaves ranks behind.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(slots=True)
class TPGroup:
    rank: int
    size: int
    local_rank: int
    timeout_s: float
    control: dist.ProcessGroup  # gloo: control messages and sampled ids
    workers: list[subprocess.Popen] = field(default_factory=list)  # ranks rank 0 started itself
    stopping: threading.Event = field(default_factory=threading.Event)  # set by a clean shutdown

    @property
    def shard(self) -> Shard:
        return Shard(self.rank, self.size)

    # -- device collectives, called by the model on every rank ------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over ranks, in place."""
        try:
            dist.all_reduce(x)
        except Exception as exc:  # a peer died or timed out
            fail_stop(f"all-reduce failed on rank {self.rank}: {exc}")
        return x

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """[n, vocab/size] per rank -> [n, padded vocab] on rank 0, None elsewhere."""
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        try:
            dist.gather(local.contiguous(), parts, dst=0)
        except Exception as exc:
            fail_stop(f"logits gather failed on rank {self.rank}: {exc}")
        return torch.cat(parts, dim=-1) if parts is not None else None

    # -- control, over gloo ---------------------------------------------

    def _broadcast(self, t: torch.Tensor, what: str) -> None:
        try:
            dist.broadcast(t, src=0, group=self.control)
        except Exception as exc:
            fail_stop(f"{what} broadcast failed on rank {self.rank}: {exc}")

    def send(self, kind: int, payload: bytes = b"") -> None:
        """Rank 0: one control message to every rank."""
        self._broadcast(torch.tensor([kind, len(payload)], dtype=torch.int64), "control")
        if payload:
            self._broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), "control")
        if kind == HEARTBEAT:
            self.barrier()

    def receive(self) -> tuple[int, bytes]:
        """Other ranks: the next control message. Rank 0 sends heartbeats
        while idle, so waiting longer than the timeout means it is gone."""
        header = torch.empty(2, dtype=torch.int64)
        self._broadcast(header, "control")
        kind, n = header.tolist()
        payload = b""
        if n:
            data = torch.empty(n, dtype=torch.uint8)
            self._broadcast(data, "control")
            payload = data.numpy().tobytes()
        if kind == HEARTBEAT:
            self.barrier()
        return kind, payload

    def barrier(self) -> None:
        # An all-reduce needs every rank, so a hung one times it out.
        try:
            dist.all_reduce(torch.ones(1), group=self.control)
        except Exception as exc:
            fail_stop(f"barrier failed on rank {self.rank}: {exc}")

    def share_tokens(self, tokens: list[int] | None, n: int) -> list[int]:
        """Rank 0 passes the n sampled ids (None when its sampling failed);
        every rank gets them back. The other ranks raise if rank 0 failed,
        so they reset as it does."""
        t = torch.zeros(n + 1, dtype=torch.int64)
        if self.rank == 0 and tokens is not None:
            t[0] = 1
            t[1:] = torch.tensor(tokens, dtype=torch.int64)
        self._broadcast(t, "sampled ids")
        if not t[0]:
            if self.rank == 0:
                return []  # the caller re-raises its own error
            raise RuntimeError("rank 0 failed to sample this step")
        return t[1:].tolist()

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        except Exception as exc:
            fail_stop(f"start-up all-reduce failed on rank {self.rank}: {exc}")
        return int(t.item())

    # -- lifetime ---------------------------------------------------------

    def shutdown(self) -> None:
        """Rank 0: stops every rank (see leave()), then leaves the group."""
        self.stopping.set()
        self.send(SHUTDOWN)
        self.barrier()
        for p in self.workers:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        dist.destroy_process_group()

    def leave(self) -> NoReturn:
        """Other ranks, on SHUTDOWN (or any rank that only ever leaves, as
        the tests' and benchmarks' ranks do): exit once every rank is here.
        It skips destroy_process_group: gloo aborts a rank (SIGABRT) whose
        peers close their connections while it tears down its own."""
        self.barrier()
        exit_now(0)


def _watch(workers: list[subprocess.Popen], stopping: threading.Event) -> None:
    """Rank 0: a rank it started that exits stops the group at once, without
    waiting for a collective to time out (or, at start-up, for the others
    to give up waiting for it)."""

    def watch() -> None:
        while not stopping.is_set():
            for r, p in enumerate(workers, start=1):
                if p.poll() is not None and not stopping.is_set():
                    fail_stop(f"rank {r} exited with code {p.returncode}")
            time.sleep(0.2)

    threading.Thread(target=watch, name="tp-watch", daemon=True).start()


def join(settings, cfg, device: torch.device) -> TPGroup | None:
    """Joins (or, on rank 0 without torchrun, creates) the group; None at
    EXECUTOR_TENSOR_PARALLEL_SIZE=1. `cfg` is checked first: a size that
    does not divide the model is refused before any rank starts."""
    size = settings.tensor_parallel_size
    env = os.environ
    torchrun = "WORLD_SIZE" in env
    if torchrun and int(env["WORLD_SIZE"]) != size:
        raise StartupError(f"EXECUTOR_TENSOR_PARALLEL_SIZE={size} but WORLD_SIZE={env['WORLD_SIZE']}: "
                           f"every rank of the group must be started with the same size")
    check_size(cfg, size)
    if size == 1:
        return None
    workers: list[subprocess.Popen] = []
    if torchrun:
        missing = [v for v in TORCHRUN_VARS if v not in env]
        if missing:
            raise StartupError(f"WORLD_SIZE is set, so this executor joins a torchrun-style group, "
                               f"but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not")
        rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
    else:
        rank = local_rank = 0
        env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(free_port())
        for r in range(1, size):
            child = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(size), **{SPAWNED_VAR: "1"})
            workers.append(subprocess.Popen([sys.executable, "-m", "executor_svc"], env=child,
                                            preexec_fn=_die_with_parent))
    stopping = threading.Event()
    if workers:
        _watch(workers, stopping)
    if env.get(SPAWNED_VAR):
        # Ctrl-C reaches the whole process group; rank 0 stops this one.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    timeout = timedelta(seconds=settings.tensor_parallel_timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    log.info("rank %d of %d joining the tensor-parallel group (%s, master %s:%s)", rank, size, backend,
             env["MASTER_ADDR"], env["MASTER_PORT"])
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicators and the model's tensors on this rank's device
    try:
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout,
                                **({"device_id": device} if device.type == "cuda" else {}))
        control = dist.new_group(backend="gloo", timeout=timeout)
    except Exception as exc:
        stopping.set()
        for p in workers:
            p.kill()
        raise StartupError(f"EXECUTOR_TENSOR_PARALLEL_SIZE={size}: rank {rank} could not join the group at "
                           f"{env['MASTER_ADDR']}:{env['MASTER_PORT']} ({exc})") from None
    return TPGroup(rank, size, local_rank, settings.tensor_parallel_timeout_s, control, workers, stopping)

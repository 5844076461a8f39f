"""The host KV tier: a second pool of KV blocks in host memory, which the
scheduler copies device blocks to and from (StepPlan.swap_out / swap_in).

The scheduler owns every host block, as it owns the device's
(scheduler_svc/core/host_tier.py); the executor only copies, in the plan's
order: every swap_out, then every swap_in, then the forward. Under tensor
parallelism each rank holds its slice of every block (its KV heads), as in
its device pool, and runs the same copies on it. A host block mirrors a
device block layer by layer (kv_cache.CacheSpec): a K/V pair, or for
multi-head latent attention the one latent, whole on every rank. An FP8
pool's blocks are copied as their bytes, scales and all unchanged: a
block swapped back in reads as it did before it left.

On CUDA the pool is pinned memory and the copies run on a side stream: they
start after the steps before them (their sources), and the forward waits on
an event recorded after them, so the host prepares the step's inputs
meanwhile. The result of a step is sent only after its forward, hence after
its copies: a host block the result confirms has been written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from executor_svc.attention.kv_quant import as_bytes
from executor_svc.step.kv_cache import MIB, KVCachePool, bytes_per_block, free_memory_bytes
from executor_svc.model.model_config import ModelConfig
from executor_svc.step.request_rows import PlanError
from executor_svc.model.sharding import Shard
from llmsched.errors import StartupError


def host_pool_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, memory_mb: int,
                         shard: Shard = Shard(), ranks_on_node: int = 1) -> int:
    """Blocks of EXECUTOR_HOST_KV_CACHE_MEMORY_MB (per rank), refused by
    name when this node's ranks together would not fit MemAvailable: pinned
    memory cannot be swapped, and on the CPU an oversized pool is
    OOM-killed when written, not when allocated."""
    if memory_mb <= 0:
        return 0
    per_block = bytes_per_block(cfg, block_size, dtype, shard)
    num_blocks = memory_mb * MIB // per_block
    if num_blocks < 1:
        raise StartupError(f"EXECUTOR_HOST_KV_CACHE_MEMORY_MB={memory_mb}: smaller than one KV block "
                           f"({per_block / MIB:.2f} MiB)")
    available = free_memory_bytes(torch.device("cpu"))
    needed = num_blocks * per_block * ranks_on_node
    if available is not None and needed > available:
        on = f" ({ranks_on_node} ranks on this node)" if ranks_on_node > 1 else ""
        raise StartupError(f"EXECUTOR_HOST_KV_CACHE_MEMORY_MB={memory_mb}: the host KV tier needs "
                           f"{needed / MIB:.0f} MiB{on} but only {available / MIB:.0f} MiB is available "
                           "(MemAvailable)")
    return num_blocks


@dataclass(slots=True)
class SwapResult:
    # Indices into the plan's swap_out / swap_in pairs that were not copied.
    failed_outs: list[int] = field(default_factory=list)
    failed_ins: list[int] = field(default_factory=list)
    swap_ns: int = 0
    # On CUDA, events around the copies on the side stream: the forward
    # waits on `done`, and finish() times them.
    start: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None


class HostKVPool:
    """Mirrors a device pool (kv_cache.KVCachePool): each host block holds
    what a device block holds, layer by layer, as the layer's CacheSpec
    says (a K/V pair, or MLA's one latent)."""

    def __init__(self, device_pool: KVCachePool, num_blocks: int, device: torch.device, fail_every: int = 0):
        self.num_blocks, self.device = num_blocks, device
        self.block_bytes = device_pool.block_size * device_pool.bytes_per_token
        layers, tensors, _, block_size, heads, head_dim = device_pool.storage.shape
        # [num_blocks, num_layers, num_tensors (k, v or the latent), block_size, heads, head_dim]:
        # the device layout with the block dimension first, so a block is one
        # contiguous run and moves in one copy. Never read before a swap_out
        # writes it, so left unzeroed.
        self.storage = torch.empty(num_blocks, layers, tensors, block_size, heads, head_dim,
                                   dtype=device_pool.storage.dtype, pin_memory=device.type == "cuda")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Fault injection for tests: every fail_every-th copy fails (0: none).
        self.fail_every, self._num_copies = fail_every, 0

    def _check(self, what: str, device_blocks: list[int], host_blocks: list[int], num_device_blocks: int) -> None:
        if len(device_blocks) != len(host_blocks):
            raise PlanError(f"{what}: {len(device_blocks)} device blocks but {len(host_blocks)} host blocks")
        if device_blocks and max(device_blocks) >= num_device_blocks:
            raise PlanError(f"{what} names device block {max(device_blocks)} of {num_device_blocks}")
        if host_blocks and max(host_blocks) >= self.num_blocks:
            raise PlanError(f"{what} names host block {max(host_blocks)} of {self.num_blocks}")

    def _split(self, device_blocks: list[int], host_blocks: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(device, host) of the pairs to copy, and the indices that fail."""
        first, self._num_copies = self._num_copies, self._num_copies + len(host_blocks)
        if not self.fail_every:
            return device_blocks, host_blocks, []
        failed = [i for i in range(len(host_blocks)) if (first + i + 1) % self.fail_every == 0]
        keep = [i for i in range(len(host_blocks)) if i not in failed]
        return [device_blocks[i] for i in keep], [host_blocks[i] for i in keep], failed

    def swap(self, device_storage: torch.Tensor,  # [layers, tensors, num_device_blocks, block_size, heads, head_dim]
             out_device: list[int], out_host: list[int], in_host: list[int], in_device: list[int]) -> SwapResult:
        """Copies out_device -> out_host, then in_host -> in_device."""
        num_device_blocks = device_storage.shape[2]
        self._check("swap_out", out_device, out_host, num_device_blocks)
        self._check("swap_in", in_device, in_host, num_device_blocks)
        device_storage, host_storage = as_bytes(device_storage), as_bytes(self.storage)
        t0 = time.perf_counter_ns()
        out_d, out_h, failed_outs = self._split(out_device, out_host)
        in_d, in_h, failed_ins = self._split(in_device, in_host)
        result = SwapResult(failed_outs, failed_ins)
        if self.stream is None:
            self._copy_out(device_storage, host_storage, out_d, out_h)
            self._copy_in(device_storage, host_storage, in_h, in_d)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # sources written by earlier steps
            with torch.cuda.stream(self.stream):
                result.start, result.done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                result.start.record(self.stream)
                self._copy_out(device_storage, host_storage, out_d, out_h)
                self._copy_in(device_storage, host_storage, in_h, in_d)
                result.done.record(self.stream)
            # The forward writes blocks just swapped out and reads blocks just swapped in.
            torch.cuda.current_stream(self.device).wait_event(result.done)
            return result  # timed by finish()
        result.swap_ns = time.perf_counter_ns() - t0
        return result

    def _copy_out(self, device_storage: torch.Tensor, host_storage: torch.Tensor, device_blocks: list[int],
                  host_blocks: list[int]) -> None:
        if not device_blocks:
            return
        d = torch.tensor(device_blocks, dtype=torch.int64, device=self.device)
        blocks = device_storage[:, :, d].permute(2, 0, 1, 3, 4, 5)  # [n, layers, tensors, block_size, heads, head_dim]
        if self.stream is None:
            host_storage[torch.tensor(host_blocks)] = blocks
            return
        blocks = blocks.contiguous()
        for i, h in enumerate(host_blocks):  # one device-to-host copy per (contiguous) block
            host_storage[h].copy_(blocks[i], non_blocking=True)

    def _copy_in(self, device_storage: torch.Tensor, host_storage: torch.Tensor, host_blocks: list[int],
                 device_blocks: list[int]) -> None:
        if not device_blocks:
            return
        d = torch.tensor(device_blocks, dtype=torch.int64, device=self.device)
        if self.stream is None:
            blocks = host_storage[torch.tensor(host_blocks)]  # [n, layers, tensors, block_size, heads, head_dim]
        else:
            blocks = torch.empty((len(host_blocks), *host_storage.shape[1:]), dtype=host_storage.dtype,
                                 device=self.device)
            for i, h in enumerate(host_blocks):  # one host-to-device copy per block
                blocks[i].copy_(host_storage[h], non_blocking=True)
        device_storage[:, :, d] = blocks.permute(1, 2, 0, 3, 4, 5)

    def finish(self, result: SwapResult) -> None:
        """Waits for a step's copies (CUDA), and times them from the device's
        events: by then the forward has waited for them anyway."""
        if result.done is not None:
            result.done.synchronize()
            result.swap_ns = int(result.start.elapsed_time(result.done) * 1e6)
            result.start = result.done = None

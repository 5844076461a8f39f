"""EXECUTOR_TORCH_COMPILE=on: decode steps of small batches on CPU run as
one torch.compile'd graph, the CPU counterpart of cuda_graphs.py; an
executor that speculates verifies drafts in a second one. From hidden size
LAYERWISE_HIDDEN up they run layerwise instead: one compiled graph per
kind of decoder layer, called for each layer of that kind with its own
weights (_compile_layers), which compiles in seconds where the whole
unrolled step took minutes.

On a small model a decode step is mostly per-op overhead: some twenty ops
a layer, each paying Python and the dispatcher. Inductor fuses the
elementwise ops into C++ loops and calls the rest from one generated C++
function, so a step pays that overhead about once. stories260K, one thread,
one stream through the ModelRunner: 1.40 ms a token eager, 0.62 compiled.

The graph takes tensors only: token ids, positions, each row's block ids
(padded to the longest row) and lengths, from which it builds one additive
mask per sliding window the model uses. Attention reads each row's blocks
in loops inductor generates (decode) or gathers them and runs SDPA with
the GQA group as the query axis (verify). The new tokens' K/V come out of the
graph and are written into the pool after it (see DenseDecodeAttention). A
batch whose gathered K would pass MAX_GATHER_BYTES runs eagerly instead:
there the gather is the cost, not the dispatch, and the torch backend cuts
it into cache-sized pieces.

Shapes are dynamic (rows, blocks), but dynamo specialises sizes 0 and 1. So
the warm-up compiles for two rows or more, and tables are at least two
blocks wide (extra blocks are masked). One graph then serves every step;
it is compiled at start-up, not on a user's first request. Once compiled,
a graph is called without dynamo (DirectCall), which lets a one-row batch
run as it is where the warm-up showed that it may (_runs_one_row); else it
runs as two rows (row 0 twice; the copy's K/V and logits are dropped).

A verify step's rows hold a request's last known token and its drafts, or
one token for a row that decodes; the graph pads them to the longest (Q),
masks each row's new keys causally, and returns every token's logits for
the runner to verify as it does after an eager forward.

Inductor reorders floating-point sums (the RMSNorm reduction, for one), so
logits can differ from eager ones in the last bits; greedy tokens are
checked against HF's in tests/unit/test_compiled_decode.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields, is_dataclass

import numpy as np
import torch
from prometheus_client import Counter

from executor_svc.attention import dense_attention
from executor_svc.attention.kv_quant import is_fp8
from executor_svc.direct_call import DirectCall
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.model.model import CausalLM

log = logging.getLogger(__name__)

STEPS = Counter("llmsched_executor_compiled_decode_steps", "Decode steps, and verify steps of drafts, run by the compiled CPU graphs")

# Largest K gathered per layer (as much again of V) for a compiled step.
MAX_GATHER_BYTES = 4 << 20
# From this hidden size up, decode steps compile layerwise (one graph per
# kind of decoder layer, _compile_layers) rather than as one graph: the
# step's own graph unrolls every layer, which inductor took 141 s to
# compile cold for a Qwen3-0.6B shape (28 layers, hidden 1,024) against 7 s
# for one layer, while the few eager ops and one call a layer left outside
# cost little beside such a model's products. Below it (stories260K) those
# calls would be a large share of a step.
LAYERWISE_HIDDEN = 512


@dataclass(slots=True)
class DecodeMeta:
    """What the graph's attention reads; built inside the graph from its inputs."""

    block_ids: torch.Tensor  # [n * width] int64, row by row
    # sliding window -> additive mask: [n, 1, 1, width * block_size + 1] with
    # one token a row; [n, Q, width * block_size + Q] with Q (verify steps)
    masks: dict[int | None, torch.Tensor]
    new_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer so far: [n * Q, kvh, d] x2
    tokens_per_row: int = 1  # Q: 1 in decode steps, 1 + the most drafts in verify steps


class DenseDecodeAttention:
    """The attention backend traced into the graph: decode rows only.

    The graph never writes into the KV cache: a compiled graph that mutates
    its input copies the whole of it (functionalization), which for a pool
    of gigabytes is slower than any eager step. Each layer's new K/V are
    kept aside and attended as one extra key after the gathered ones (whose
    copy of that position is masked: it is not written yet), and the graph
    returns them for one write into the pool after it runs.
    """

    name = "compiled-decode"

    def write_kv(self, key, value, k_cache, v_cache, meta: DecodeMeta, k_scale=1.0, v_scale=1.0):
        # The pool is never FP8 here (CompiledDecode refuses it): the scales do not apply.
        meta.new_kv.append((key, value))

    def attend(self, query, k_cache, v_cache, meta: DecodeMeta, scale, sliding_window=None, softcap=None,
               k_scale=1.0, v_scale=1.0):
        if meta.tokens_per_row != 1:
            return self._attend_rows(query, k_cache, v_cache, meta, scale, sliding_window, softcap)
        n, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        new_k, new_v = meta.new_kv[-1]  # this layer's, from write_kv just before
        # [n * width, block_size, kvh, d] -> [n, ctx + 1, kvh, d]
        k = torch.cat([k_cache.index_select(0, meta.block_ids).view(n, -1, num_kv_heads, head_dim), new_k[:, None]], 1)
        v = torch.cat([v_cache.index_select(0, meta.block_ids).view(n, -1, num_kv_heads, head_dim), new_v[:, None]], 1)
        # Written as products and sums, not SDPA: inductor fuses the block
        # gather, q.k, the softmax and p.v into loops of its own, where
        # CPU flash attention paid its setup per layer (about 15 µs a call
        # at 64 keys) on top of a gathered copy of K and V. stories260K, one
        # thread, in process: 0.64 -> 0.57 ms a one-row step, 7.5 -> 5.8 ms
        # at 64 rows of 150 tokens; even, within noise, at head_dim 128
        # (one row at 300 and 1000 tokens, eight rows at 100).
        # In float32 throughout, as the flash kernel computes (the casts
        # fuse into the loops: nothing is copied for them).
        group = num_heads // num_kv_heads
        q = query.float().view(n, 1, num_kv_heads, group, head_dim)
        scores = (q * k.float()[:, :, :, None, :]).sum(-1) * scale  # [n, ctx + 1, kvh, group]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores + meta.masks[sliding_window].view(n, -1, 1, 1), dim=1)
        o = (probs[..., None] * v.float()[:, :, :, None, :]).sum(1)  # [n, kvh, group, d]
        return o.to(query.dtype).reshape(n, num_heads, head_dim)

    def _attend_rows(self, query, k_cache, v_cache, meta: DecodeMeta, scale, sliding_window, softcap):
        """Q query tokens a row (a verify step's last known token and its
        drafts, padded to one length): each row's gathered keys, then its Q
        new ones, which its own mask orders causally."""
        tokens, num_heads, head_dim = query.shape
        q_len = meta.tokens_per_row
        n = tokens // q_len
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        new_k, new_v = meta.new_kv[-1]
        # [n, ctx + Q, kvh, d] -> [n, kvh, ctx + Q, d]
        k = torch.cat([k_cache.index_select(0, meta.block_ids).view(n, -1, num_kv_heads, head_dim),
                       new_k.view(n, q_len, num_kv_heads, head_dim)], 1)
        v = torch.cat([v_cache.index_select(0, meta.block_ids).view(n, -1, num_kv_heads, head_dim),
                       new_v.view(n, q_len, num_kv_heads, head_dim)], 1)
        # The query axis is (token, group member): [n, kvh, Q * group, d].
        q = query.view(n, q_len, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4).reshape(
            n, num_kv_heads, q_len * group, head_dim)
        mask = meta.masks[sliding_window]  # [n, Q, ctx + Q]
        mask = mask[:, None, :, None, :].expand(n, 1, q_len, group, mask.shape[-1]).reshape(
            n, 1, q_len * group, mask.shape[-1])
        o = dense_attention(q, k.transpose(1, 2), v.transpose(1, 2), mask, False, scale, softcap)
        return o.view(n, num_kv_heads, q_len, group, head_dim).permute(0, 2, 1, 3, 4).reshape(
            tokens, num_heads, head_dim)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """A one-row run's outputs against the same row's in a two-row run. In
    float32 they differ by float rounding. In 16 bits they differ by each
    layer's activations rounding apart, as soon as a layer's product takes
    another path for one row: on a CPU without native bf16 a one-row step
    multiplies through the GEMV and a two-row one through the tiled kernel
    (cpu_gemv.py). A Qwen3-0.6B shape in bf16: 0.025 apart on logits up to
    2.97 (a 5% bound, scaled by the largest). A graph that mis-indexed a
    single row would compute another token's K/V and logits."""
    if dtype == torch.float32:
        return torch.allclose(got, want, rtol=1e-3, atol=1e-4)
    scale = want.float().abs().max().item()
    return torch.allclose(got.float(), want.float(), rtol=0, atol=5e-2 * scale)


class CompiledDecode:
    def __init__(self, model: CausalLM, pool: KVCachePool, verifies: bool = False, layerwise: bool | None = None):
        self.storage = pool.storage  # [layers, 2, blocks, block_size, kvh, d]
        self.slots = self.storage.flatten(2, 3)  # [layers, 2, slots, kvh, d], a view
        if self.storage.device.type != "cpu":
            raise ValueError(f"EXECUTOR_TORCH_COMPILE compiles CPU decode steps; the device is {self.storage.device}")
        if model.comm is not None:
            raise ValueError("EXECUTOR_TORCH_COMPILE is not implemented under tensor parallelism")
        if is_fp8(self.storage.dtype):
            raise ValueError("EXECUTOR_TORCH_COMPILE is not implemented with an FP8 KV cache")
        self.model, self.kv_caches = model, pool.layer_caches()
        self.block_size = pool.block_size
        self.token_bytes = self.storage[0, 0, 0, 0].numel() * self.storage.element_size()
        self.dtype = self.storage.dtype
        cfg = model.cfg
        self.windows = sorted({cfg.layer_window(i) for i in range(cfg.num_layers)}, key=lambda w: (w is not None, w))
        self._backend = DenseDecodeAttention()
        # The C++ wrapper calls the kernels without a Python line per op: a
        # further 0.1 ms a step on stories260K, for about the same compile time.
        self._direct = DirectCall("compiled decode step", {"cpp_wrapper": True})
        # Whether a one-row decode and verify step run as one row (_runs_one_row).
        self._one_row = [False, False]
        # Layerwise: one graph per kind of decoder layer, called for every
        # layer of that kind (_compile_layers); else one graph for the step.
        # None: layerwise from LAYERWISE_HIDDEN up.
        self.layerwise = layerwise = cfg.hidden_size >= LAYERWISE_HIDDEN if layerwise is None else layerwise
        self._layer_calls: list[tuple[DirectCall, list | None, str, tuple[torch.Tensor, ...]]] = []
        self._graph = None if layerwise else torch.compile(self._step, fullgraph=True, backend=self._direct.backend)
        t = time.perf_counter()
        self._warm_up()
        log.info("compiled the CPU decode step in %.1f s%s", time.perf_counter() - t,
                 f" (layerwise: {len({id(c[0]) for c in self._layer_calls})} graphs for {len(self._layer_calls)} "
                 "layers)" if layerwise else "")
        if layerwise and verifies:
            log.info("layerwise compiled decode: verify steps of drafts run eagerly")
            verifies = False
        # An executor that speculates also verifies drafts in a graph of its
        # own: run eagerly, a verify step cost several compiled decode steps,
        # more than its drafts saved (docs/performance.md, P21).
        self._verify_graph = None
        self._direct_verify = DirectCall("compiled verify step", {"cpp_wrapper": True})
        if verifies:
            self._verify_graph = torch.compile(self._verify_step, fullgraph=True, backend=self._direct_verify.backend)
            t = time.perf_counter()
            self._warm_up_verify()
            log.info("compiled the CPU verify step in %.1f s", time.perf_counter() - t)

    def _runs_one_row(self, name: str, call, inputs: tuple[torch.Tensor, ...], two_rows: tuple,
                      tokens_per_row: int) -> bool:
        """Whether a bound graph may run a one-row batch as it is, instead of
        as two rows (row 0 twice): dynamo compiled it for at least two rows
        (it specialises a size of 1), but called directly, nothing holds it
        to that. The warm-up's two rows are one input twice over; the first
        row alone must give the first row's outputs within float rounding
        (BLAS takes another path for one row: not bit for bit), which a
        graph that mis-indexed a single row would not. Measured on
        stories260K: a one-row decode graph 0.30 ms against 0.42 as two
        rows, a verify graph of 5 tokens 0.56 against 0.89."""
        ids, positions, block_ids, last = inputs
        width = block_ids.shape[0] // ids.shape[0]
        try:
            logits, new_kv = call((ids[:1], positions[:1], block_ids[:width], last[:1]))
        except Exception:
            log.exception("%s: one-row batches run as two rows (one row alone failed)", name)
            return False
        want_logits, want_kv = two_rows[0][:tokens_per_row], two_rows[1][:, :, :tokens_per_row]
        ok = (logits.shape == want_logits.shape and new_kv.shape == want_kv.shape
              and _close(logits, want_logits, want_kv.dtype) and _close(new_kv, want_kv, want_kv.dtype))
        if not ok:
            log.info("%s: one-row batches run as two rows (one row alone disagreed)", name)
        return ok

    @staticmethod
    def _call(direct: DirectCall, graph, inputs: tuple[torch.Tensor, ...]) -> tuple:
        if direct.bound:
            return direct.call(inputs)
        # After the warm-up, a guard that fails would mean compiling again
        # for seconds while requests wait: raise instead (the runner then
        # runs eagerly). Guards are not evaluated (see run()).
        with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
            return graph(*inputs)

    @property
    def below_wrappers(self) -> tuple[bool, bool]:
        """Decode's and verify's: whether bound calls skip AOT autograd's
        and the compiled graph's wrappers (DirectCall._bind_inductor)."""
        if self.layerwise:
            return all(c[0].below_wrappers for c in self._layer_calls), False
        return self._direct.below_wrappers, self._direct_verify.below_wrappers

    @property
    def direct(self) -> tuple[bool, bool]:
        """Whether decode and verify steps call their compiled graph without
        dynamo (DirectCall)."""
        if self.layerwise:
            return bool(self._layer_calls), False  # _compile_layers binds every layer or raises
        return self._direct.bound, self._direct_verify.bound

    @property
    def runs_one_row(self) -> tuple[bool, bool]:
        """Whether one-row decode and verify steps run as one row (else as
        two, _runs_one_row)."""
        return self._one_row[0], self._one_row[1]

    @property
    def verifies(self) -> bool:
        return self._verify_graph is not None

    def stop_verifying(self) -> None:
        """After a failed verify step: verify steps run eagerly from now on."""
        self._verify_graph = None

    def fits(self, rows: int, width: int) -> bool:
        """Whether a decode step of `rows` rows reading up to `width` blocks each runs compiled."""
        return max(2, rows) * max(2, width) * self.block_size * self.token_bytes <= MAX_GATHER_BYTES

    def _masks(self, block_ids, seq_lens, windows) -> dict[int | None, torch.Tensor]:
        """Per sliding window: a decode step's additive mask, [n, 1, 1, ctx + 1]."""
        n = seq_lens.shape[0]
        ctx = block_ids.shape[0] // n * self.block_size
        # Gathered keys from the new token's position on are hidden (it is
        # the extra last key); a window also hides those before it.
        keys = torch.arange(ctx, device=seq_lens.device)[None, :]  # [1, ctx]
        last = seq_lens[:, None] - 1  # [n, 1]: the new token's position
        masks = {}
        for window in windows:
            hidden = keys >= last if window is None else (keys >= last) | (keys <= last - window)
            # [n, ctx + 1]: the extra last key, the new token's own, is always visible
            mask = torch.cat([torch.where(hidden, float("-inf"), 0.0), keys.new_zeros(n, 1, dtype=torch.float32)], 1)
            masks[window] = mask.to(self.dtype)[:, None, None]
        return masks

    def _step(self, input_ids, positions, block_ids, seq_lens):
        meta = DecodeMeta(block_ids, self._masks(block_ids, seq_lens, self.windows))
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self._backend)
        new_kv = torch.stack([torch.stack(kv) for kv in meta.new_kv])  # [layers, 2, n, kvh, d]
        return self.model.compute_logits(hidden), new_kv

    def _layer_graph(self, layer: torch.nn.Module, window: int | None):
        """One decoder layer of a decode step, as a function of tensors only:
        what _compile_layers compiles once per kind of layer."""
        def layer_step(x, cos, sin, k_cache, v_cache, block_ids, seq_lens):
            meta = DecodeMeta(block_ids, self._masks(block_ids, seq_lens, (window,)))
            out = layer(x, cos, sin, (k_cache, v_cache), meta, self._backend)
            new_k, new_v = meta.new_kv[0]
            return out, new_k, new_v
        return layer_step

    def _layerwise_step(self, input_ids, positions, block_ids, seq_lens):
        """_step with each decoder layer one call of its kind's compiled
        graph, and the rest (embedding, RoPE's rows, the final norm, the
        head: a few ops) eager."""
        x, rope = self.model.embed_and_rope(input_ids, positions)
        new_kv = []
        for direct, template, layer_type, (k_cache, v_cache) in self._layer_calls:
            x, k, v = direct.call((x, *rope[layer_type], k_cache, v_cache, block_ids, seq_lens), template)
            new_kv.append(torch.stack((k, v)))
        return self.model.compute_logits(self.model.model.norm(x)), torch.stack(new_kv)  # [layers, 2, n, kvh, d]

    def _compile_layers(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Compiles one graph per kind of decoder layer (layers alike in
        class, plain attributes, window, RoPE type and tensor shapes:
        _structure), called directly for every layer of its kind with that
        layer's own weights (DirectCall.retargeted). Inductor then compiles
        one layer instead of the whole unrolled step: a Qwen3-0.6B shape
        (28 layers) in 7 s cold instead of 141. Each layer's direct call is
        checked against the same layer run eagerly; a layer that disagrees,
        or a graph that cannot be called directly, raises (the runner then
        serves eagerly)."""
        input_ids, positions, block_ids, seq_lens = inputs
        cfg = self.model.cfg
        masks = self._masks(block_ids, seq_lens, self.windows)
        x, rope = self.model.embed_and_rope(input_ids, positions)
        kinds: dict[tuple, tuple[DirectCall, dict[str, torch.Tensor]]] = {}
        calls = []
        for i, (layer, cache) in enumerate(zip(self.model.model.layers, self.kv_caches)):
            layer_type, window = cfg.layer_types[i], cfg.layer_window(i)
            args = (x, *rope[layer_type], *cache, block_ids, seq_lens)
            tensors = _module_tensors(layer)
            key = (layer_type, window, _structure(layer, tensors))
            if key not in kinds:
                direct = DirectCall(f"compiled decode layer {i}", {"cpp_wrapper": True})
                graph = torch.compile(self._layer_graph(layer, window), fullgraph=True, backend=direct.backend)
                for t in (args[0], args[1], args[2], args[5], args[6]):  # rows; the tables' blocks
                    torch._dynamo.mark_dynamic(t, 0)
                with torch.compiler.set_stance("default"):
                    direct.bind(args, graph(*args))
                if not direct.bound:
                    raise RuntimeError(f"the compiled graph of decoder layer {i} cannot be called directly")
                kinds[key] = (direct, tensors)
                template = None
            else:
                direct, first = kinds[key]
                template = direct.retargeted({id(t): tensors[name] for name, t in first.items()})
            want_meta = DecodeMeta(block_ids, masks)
            want = layer(x, *rope[layer_type], cache, want_meta, self._backend)
            got = direct.call(args, template)
            if not all(_close(g, w, self.dtype) for g, w in zip(got, (want, *want_meta.new_kv[0]))):
                raise RuntimeError(f"decoder layer {i}'s compiled graph disagrees with the layer run eagerly")
            calls.append((direct, template, layer_type, cache))
            x = want
        self._layer_calls = calls

    def _verify_step(self, input_ids, positions, block_ids, starts):
        """input_ids, positions: [n, Q]; starts: [n], each row's first new
        position (its tokens before it are in the pool). Logits [n * Q,
        vocab] and the new K/V, as _step's."""
        n, q_len = input_ids.shape
        ctx = block_ids.shape[0] // n * self.block_size
        keys = torch.arange(ctx, device=input_ids.device)[None, None, :]  # [1, 1, ctx]
        at = positions[:, :, None]  # [n, Q, 1]: each query token's position
        # Gathered keys from the row's first new position on are not written
        # yet (the new keys come after them); a new key after the query is
        # in its future. A window also hides keys at or before at - window.
        unwritten = keys >= starts[:, None, None]  # [n, 1, ctx]
        index = torch.arange(q_len, device=input_ids.device)
        future = (index[None, :] > index[:, None])[None]  # [1, Q, Q]
        new_at = positions[:, None, :]  # [n, 1, Q]: each new key's position
        masks = {}
        for window in self.windows:
            hide_old = unwritten if window is None else unwritten | (keys <= at - window)
            hide_new = future if window is None else future | (new_at <= at - window)
            mask = torch.cat([torch.where(hide_old.expand(n, q_len, ctx), float("-inf"), 0.0),
                              torch.where(hide_new.expand(n, q_len, q_len), float("-inf"), 0.0)], -1)
            masks[window] = mask.to(self.dtype)
        meta = DecodeMeta(block_ids, masks, tokens_per_row=q_len)
        hidden = self.model(input_ids.reshape(-1), positions.reshape(-1), self.kv_caches, meta, self._backend)
        new_kv = torch.stack([torch.stack(kv) for kv in meta.new_kv])  # [layers, 2, n * Q, kvh, d]
        return self.model.compute_logits(hidden), new_kv

    @torch.inference_mode()
    def _warm_up_verify(self) -> None:
        # Two rows of three tokens at positions 0-2, four blocks wide: rows,
        # tokens a row and blocks differ in number, or dynamo would give two
        # of them one symbol (as in _warm_up).
        ids = torch.zeros(6, dtype=torch.long)
        positions = torch.arange(3).repeat(2)
        self.run_verify(ids, positions, torch.zeros(6, dtype=torch.long), torch.zeros(2, 4, dtype=torch.int32),
                        np.array([3, 3]), stance="default")

    @torch.inference_mode()
    def _warm_up(self) -> None:
        # Two rows at position 0 of block 0: nothing is cached yet, and a
        # block is written by its owner before anyone reads it. Rows and
        # blocks differ in number, or dynamo would give them one symbol.
        # The dtypes are the runner's, and no two inputs are one tensor: the
        # graph's guards check both.
        zeros = [torch.zeros(2, dtype=torch.long) for _ in range(3)]
        self.run(*zeros, torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32), stance="default")

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, stance: str = "fail_on_recompile") -> torch.Tensor:
        """Logits [n, vocab] of a decode step, one token per row, whose K/V
        it writes at slot_mapping (int64). block_tables: [n, width], int32 or
        int64 (entries past a row's blocks may be any valid block id: they
        are masked); seq_lens: [n], each row's length with its new token."""
        n, width = block_tables.shape
        if width < 2:
            block_tables = torch.cat([block_tables, block_tables], dim=1)
        if n == 1 and not self._one_row[0]:
            input_ids, positions, block_tables, seq_lens = (
                torch.cat([t, t]) for t in (input_ids, positions, block_tables, seq_lens))
        inputs = (input_ids, positions, block_tables.reshape(-1).long(), seq_lens)
        if stance == "default" and self.layerwise:  # the warm-up, which compiles each kind of layer
            self._compile_layers(inputs)
            logits, new_kv = self._layerwise_step(*inputs)
            self._one_row[0] = self._runs_one_row("compiled decode layers", lambda i: self._layerwise_step(*i),
                                                  inputs, (logits, new_kv), 1)
        elif stance == "default":  # the warm-up, which compiles
            # Rows and blocks vary; everything else (the caches and weights
            # among them) is static. Once compiled, the graph's sizes are
            # symbols: later calls need not mark them again.
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 0)
            with torch.compiler.set_stance(stance):
                logits, new_kv = self._graph(*inputs)
            self._direct.bind(inputs, (logits, new_kv))
            self._one_row[0] = self._direct.bound and self._runs_one_row(
                self._direct.name, self._direct.call, inputs, (logits, new_kv), 1)
        elif self.layerwise:
            logits, new_kv = self._layerwise_step(*inputs)
        else:
            # Guards are not evaluated at all (DirectCall, or
            # skip_guard_eval_unsafe): there is one compiled graph, this is
            # its only caller, and what its guards check is fixed here (the
            # inputs' dtypes and ranks, sizes of at least 2 unless the
            # warm-up cleared one row, _runs_one_row; inference mode, the
            # same pool and weights; a step with LoRA adapter tokens
            # never comes here, runner.py). Evaluating them cost about 35 µs
            # a step on stories260K, a tenth of the compiled step.
            logits, new_kv = self._call(self._direct, self._graph, inputs)
        self.slots.index_copy_(2, slot_mapping, new_kv[:, :, :n])
        return logits[:n]

    def run_verify(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                   block_tables: torch.Tensor, tokens_per_row: np.ndarray,
                   stance: str = "fail_on_recompile") -> torch.Tensor:
        """Logits [num_tokens, vocab] of a step whose rows hold
        tokens_per_row[i] tokens each (1 for a decode row, 1 + drafts for a
        speculating one), laid out row after row as the runner's batch is;
        it writes their K/V at slot_mapping (rejected drafts' too, as an
        eager step does: they are overwritten later)."""
        n, width = block_tables.shape
        q_len = int(tokens_per_row.max())
        first = np.cumsum(tokens_per_row) - tokens_per_row  # each row's first token in the batch
        # Index arithmetic in numpy, one gather per tensor: a few torch ops
        # a step instead of a dozen (about 0.1 ms of a stories260K step).
        starts = torch.from_numpy(positions.numpy()[first])
        if int(tokens_per_row.min()) == q_len:  # rows of one length: nothing to pad
            ids_p, pos_p, padded = input_ids.view(n, q_len), positions.view(n, q_len), None
        else:
            # Padding repeats each row's last token at its position: its
            # outputs are dropped, and causally no real token sees it.
            within = np.arange(q_len)
            source = torch.from_numpy((first[:, None] + np.minimum(within, tokens_per_row[:, None] - 1)).reshape(-1))
            ids_p, pos_p = input_ids[source].view(n, q_len), positions[source].view(n, q_len)
            padded = torch.from_numpy(np.flatnonzero(within < tokens_per_row[:, None]))  # batch -> [n * Q]
        if width < 2:
            block_tables = torch.cat([block_tables, block_tables], dim=1)
        if n == 1 and not self._one_row[1]:
            ids_p, pos_p, block_tables, starts = (torch.cat([t, t]) for t in (ids_p, pos_p, block_tables, starts))
        inputs = (ids_p, pos_p, block_tables.reshape(-1).long(), starts)
        if stance == "default":
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(ids_p, 1)
            torch._dynamo.mark_dynamic(pos_p, 1)
            with torch.compiler.set_stance(stance):
                logits, new_kv = self._verify_graph(*inputs)
            self._direct_verify.bind(inputs, (logits, new_kv))
            self._one_row[1] = self._direct_verify.bound and self._runs_one_row(
                self._direct_verify.name, self._direct_verify.call, inputs, (logits, new_kv), q_len)
        else:  # as run()'s: one graph, one caller, guards fixed here
            logits, new_kv = self._call(self._direct_verify, self._verify_graph, inputs)
        if padded is None:  # (a one-row batch run as two rows: the copy comes last)
            logits, new_kv = logits[:n * q_len], new_kv[:, :, :n * q_len]
        else:
            logits, new_kv = logits[padded], new_kv[:, :, padded]
        self.slots.index_copy_(2, slot_mapping, new_kv)
        return logits


def _module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a module's forward may read, by name: parameters,
    buffers and plain tensor attributes of it and its submodules, and the
    tensors of its dataclass attributes (the CPU int kernels' weights,
    cpu_int_linear.CpuIntWeights): a layer that shares another's graph
    must pass its own."""
    out = {}
    for prefix, m in module.named_modules():
        for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False),
                        *((k, v) for k, v in vars(m).items() if isinstance(v, torch.Tensor)),
                        *((f"{k}.{f.name}", getattr(v, f.name)) for k, v in vars(m).items()
                          if is_dataclass(v) and not isinstance(v, type)
                          for f in fields(v) if isinstance(getattr(v, f.name), torch.Tensor))]:
            out[f"{prefix}.{name}" if prefix else name] = t
    return out


def _structure(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> tuple:
    """What a compiled layer graph bakes in besides its tensors' values:
    each submodule's class and plain attributes (a window, a scale, a row
    count), and each of its tensors' (_module_tensors) name, shape, dtype
    and strides. Layers with equal structures share a graph."""
    parts = []
    for prefix, m in module.named_modules():
        attrs = tuple(sorted((k, _plain(v)) for k, v in vars(m).items()
                             if not k.startswith("_") and not isinstance(v, torch.Tensor)))
        parts.append((prefix, type(m).__qualname__, attrs))
    parts += [(name, tuple(t.shape), t.dtype, t.stride()) for name, t in tensors.items()]
    return tuple(parts)


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, *(_plain(getattr(value, f.name)) for f in fields(value)))
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    # Functions (an activation) by name; other objects by type: a layer
    # whose graph would bake in such an object's state is caught by the
    # check against eager (_compile_layers).
    return getattr(value, "__qualname__", type(value).__qualname__)

"""The plain-PyTorch attention backend: gathers the cache blocks each query
can see and hands them to SDPA, with decodes batched in chunks and long
contexts split and merged (see TorchAttentionBackend)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from executor_svc.attention.kv_quant import as_bytes, dequantize, quantize
from executor_svc.model.invariant_ops import tail_free
from executor_svc.attention.metadata import AttentionMetadata

# Bytes of K gathered per decode chunk (rows x padded context x one token's
# K), and as many of V. Big enough that the per-call overhead vanishes, small
# enough that the gathered copies are still in cache when SDPA reads them
# back; 1 MiB measured best for head_dim 8 and 32 (bench/attention.py).
DECODE_CHUNK_BYTES = 1 << 20
# A request with at most this many query tokens (a step verifying
# speculative drafts, a prefill's short tail) is attended as that many
# decodes, each query seeing the keys up to its own position: batched with
# the other decodes, instead of an SDPA call of its own per layer, which
# costs more than the attention itself at these sizes.
SHORT_QUERY_MAX = 8
# Batch-invariant mode: keys per piece of every query's context
# (_plan_fixed_split). Larger pieces mean fewer calls and merges, smaller
# ones less padding (up to half of a last piece): on stories260K's P22 run
# the executor's step time on/off was 0.91 at 512 and 0.81 at 256.
INVARIANT_SPLIT_TOKENS = 512
# A last, partial piece is gathered at the next power of two blocks, and at
# least this many keys: fewer shapes, so fewer and larger SDPA calls.
INVARIANT_MIN_WIDTH_TOKENS = 64
# Rows per SDPA call: up to this much gathered K (and as much V), and at
# least INVARIANT_MIN_ROWS. A row's result does not depend on how many rows
# share its call, so both are a matter of speed only: a small model's step
# is mostly per-call overhead (4 MiB: one call per width on stories260K at
# 64 decodes), and a prefill's queries are rows too.
INVARIANT_CALL_BYTES = 4 << 20
INVARIANT_MIN_ROWS = 32
# A prompt's queries reading one piece at one width share one copy of its
# keys when there are at least this many of them (fewer join the other
# rows' calls: fewer calls for what they copy).
INVARIANT_SHARED_MIN_ROWS = 8
# Rows per call where the kernel is batched matmuls rather than the CPU
# flash kernel (a softcap, or a device other than the CPU): fixed, so that
# every call has one shape (_attention_with_lse_in_fixed_calls).
INVARIANT_MATH_ROWS = 16


@dataclass(slots=True)
class _DecodeChunk:
    """Decode rows of similar length, attended in one SDPA call: rows
    start:end of the step's sorted decode rows."""

    start: int
    end: int
    block_ids: torch.Tensor  # [n * num_blocks] int64: blocks to gather, row by row ([num_blocks] when shared)
    num_blocks: int  # per row, after padding to the chunk's longest
    mask: torch.Tensor | None  # [n, 1, 1, num_blocks * block_size] additive; None: every key visible
    # Fixed-split layouts: every row reads the same keys (one request's
    # queries in one piece): block_ids holds them once, gathered once and
    # broadcast over the rows.
    shared: bool = False


@dataclass(slots=True)
class _Prefill:
    """One request with more than one query token (prefill or chunk)."""

    start: int  # its query rows are start:end in the step batch
    end: int
    block_ids: torch.Tensor  # [num_blocks] int64: the blocks holding its visible keys
    kv_len: int  # keys used, from the first gathered block's first position
    mask: torch.Tensor | None  # [q_len, kv_len] additive; None: plain causal (q_len == kv_len)


@dataclass(slots=True)
class _AttentionLayout:
    # A decode row is one request's visible keys, or a piece of them when they
    # outgrow one chunk (split-KV): rows are sorted by length and chunked.
    row_tokens: torch.Tensor  # [num_rows] int64: each row's query in the step batch
    # Set when some decode is split: each row's decode (0..num_decodes-1) and
    # each decode's query row, to merge the pieces by their log-sum-exp.
    row_decodes: torch.Tensor | None  # [num_rows] int64
    decode_tokens: torch.Tensor | None  # [num_decodes] int64
    decodes: list[_DecodeChunk]
    prefills: list[_Prefill]
    max_gather_blocks: int  # the largest decode chunk, to size the reused gather buffers
    # Fixed-split layouts (_plan_fixed_split): how the rows become queries.
    merge: _FixedMerge | None = None


@dataclass(slots=True)
class _FixedMerge:
    """A fixed-split step's rows to queries. A query with one piece is that
    row's output as the kernel wrote it; a query with several has its
    pieces merged in piece order, whatever order the calls computed them
    in. Which applies is a function of the query's position alone."""

    whole: torch.Tensor  # [a] int64: rows that are a whole query
    whole_tokens: torch.Tensor  # [a] int64: their queries' places in the step batch
    parts: torch.Tensor | None  # [b] int64: the other queries' rows, in (query, piece) order; None: no such query
    part_queries: torch.Tensor | None  # [b] int64: each one's query among those (0..m-1)
    part_tokens: torch.Tensor | None  # [m] int64: those queries' places in the step batch


class TorchAttentionBackend:
    """Plain PyTorch. Every layer gathers only the cache blocks a query can
    see and hands them to SDPA (CPU flash attention):

    - decodes are sorted by how many blocks they read and cut into chunks
      of about DECODE_CHUNK_BYTES of K (and as much V); each chunk is
      gathered into reused buffers and attended in one call, with the GQA
      group as the query axis so K/V are never repeated per head. A context
      longer than one chunk is cut into pieces whose outputs are merged by
      their log-sum-exp (split-KV, as flash-decoding does on GPUs). A
      request with up to SHORT_QUERY_MAX query tokens (drafts being
      verified) joins them as that many decodes;
    - longer prefills and chunks are attended one request at a time (their
      query lengths differ, so batching them would mostly multiply padding).

    Which blocks, the padding masks and the order are worked out once per
    step (and window) and kept in meta.cache for every layer. A sliding
    window skips the blocks wholly before it. Softcapping has no SDPA kernel,
    so it takes an explicit matmul-softmax-matmul path.

    An FP8 cache (kv_quant.py) is gathered as stored and only the gathered
    blocks are converted to the compute dtype: on the CPU the conversion
    is an elementwise loop, so the step pays for what it reads, not for
    the pool.
    """

    name = "torch"

    def __init__(self, fixed_split_tokens: int | None = None):
        # Batch-invariant mode (EXECUTOR_BATCH_INVARIANT): every query's keys
        # are cut into pieces of this many positions (_plan_fixed_split);
        # None: the layout above, sized by the step.
        self.fixed_split_tokens = fixed_split_tokens

    def write_kv(self, key, value, k_cache, v_cache, meta, k_scale=1.0, v_scale=1.0):
        # key, value: [num_tokens, num_kv_heads, head_dim]
        _scatter(k_cache, meta.slot_mapping, key, k_scale)
        _scatter(v_cache, meta.slot_mapping, value, v_scale)

    def write_latent(self, latent, cache, meta, k_scale=1.0):
        _scatter(cache, meta.slot_mapping, latent, k_scale)

    def attend_latent(self, query, cache, meta, scale, value_dim, k_scale=1.0):
        # The whole latent is the value too (K = V: one cache read, and CPU
        # flash attention wants equal head sizes); the extra dims are dropped.
        return self.attend(query, cache, cache, meta, scale, k_scale=k_scale, v_scale=k_scale)[..., :value_dim]

    def attend(self, query, k_cache, v_cache, meta, scale, sliding_window=None, softcap=None, sinks=None,
               k_scale=1.0, v_scale=1.0):
        # query: [num_tokens, num_heads, head_dim] -> same shape
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        block_size = k_cache.shape[1]
        key = ("torch", block_size, sliding_window)
        plan = meta.cache.get(key)
        if plan is None:
            # What SDPA reads: the gathered K in the compute dtype, whatever the cache's.
            token_bytes = k_cache[0, 0].numel() * query.element_size()
            if self.fixed_split_tokens is None:
                plan = _plan_step(meta, block_size, token_bytes, sliding_window, query.dtype, query.device)
            else:
                plan = _plan_fixed_split(meta, block_size, token_bytes, sliding_window, query.dtype, query.device,
                                         max(1, self.fixed_split_tokens // block_size))
            meta.cache[key] = plan
        out = torch.empty_like(query)
        if plan.merge is not None:
            _attend_fixed_split(query, k_cache, v_cache, plan, scale, softcap, sinks, out, k_scale, v_scale)
        elif plan.decodes:
            _attend_decodes(query, k_cache, v_cache, plan, scale, softcap, sinks, out, k_scale, v_scale)
        num_kv_heads, head_dim = k_cache.shape[2:]
        for pf in plan.prefills:
            k = dequantize(_gather(k_cache, pf.block_ids, None), k_scale, query.dtype)
            v = dequantize(_gather(v_cache, pf.block_ids, None), v_scale, query.dtype)
            k = k.view(-1, num_kv_heads, head_dim)[: pf.kv_len]
            v = v.view(-1, num_kv_heads, head_dim)[: pf.kv_len]
            # q: [1, h, q_len, d]; k, v: [1, kvh, kv_len, d]
            q = query[pf.start : pf.end].transpose(0, 1).unsqueeze(0)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = dense_attention(q, k, v, pf.mask, pf.mask is None, scale, softcap, sinks)  # [1, h, q_len, d]
            out[pf.start : pf.end] = o[0].transpose(0, 1)
        return out


def _attend_decodes(query, k_cache, v_cache, plan: _AttentionLayout, scale, softcap, sinks, out,
                    k_scale=1.0, v_scale=1.0) -> None:
    """Writes the decodes' rows of out ([num_tokens, num_heads, head_dim]).
    Sinks join after the pieces merge: a piece's output is normalised over
    its own keys, and its log-sum-exp says how much it weighs; the sink's
    exp then takes its share of the whole softmax's denominator."""
    num_heads, head_dim = query.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    k_buf = k_cache.new_empty(plan.max_gather_blocks, block_size, num_kv_heads, head_dim)
    v_buf = v_cache.new_empty(plan.max_gather_blocks, block_size, num_kv_heads, head_dim)
    # Query head h reads KV head h // group, so the group is a query axis.
    q_rows = query.index_select(0, plan.row_tokens).view(-1, num_kv_heads, group, head_dim)
    o_rows = torch.empty_like(q_rows)  # [num_rows, kvh, group, d]
    split = plan.row_decodes is not None
    with_lse = split or sinks is not None
    lse_rows = q_rows.new_empty(q_rows.shape[:-1], dtype=torch.float32) if with_lse else None  # [num_rows, kvh, group]
    for chunk in plan.decodes:
        n, ctx = chunk.end - chunk.start, chunk.num_blocks * block_size
        # [n, ctx, kvh, d] viewed as [n, kvh, ctx, d]
        k = dequantize(_gather(k_cache, chunk.block_ids, k_buf), k_scale, query.dtype)
        v = dequantize(_gather(v_cache, chunk.block_ids, v_buf), v_scale, query.dtype)
        k = k.view(n, ctx, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(n, ctx, num_kv_heads, head_dim).transpose(1, 2)
        q = q_rows[chunk.start : chunk.end]
        if with_lse:
            o, lse = _attention_with_lse(q, k, v, chunk.mask, scale, softcap)
            o_rows[chunk.start : chunk.end], lse_rows[chunk.start : chunk.end] = o, lse
        else:
            o_rows[chunk.start : chunk.end] = dense_attention(q, k, v, chunk.mask, False, scale, softcap)
    tokens = plan.row_tokens
    if split:
        o_rows, lse_rows = _merge_pieces(o_rows, lse_rows, plan.row_decodes, plan.decode_tokens.shape[0])
        tokens = plan.decode_tokens
    if sinks is not None:
        # softmax with the sink = softmax without it * S / (S + exp(sink)) = sigmoid(lse - sink)
        sink = sinks.float().view(num_kv_heads, group)  # [kvh, group]
        o_rows = (o_rows.float() * torch.sigmoid(lse_rows - sink)[..., None]).to(o_rows.dtype)
    out.index_copy_(0, tokens, o_rows.reshape(-1, num_heads, head_dim))


def _scatter(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """x ([num_tokens, heads, d]) into cache ([num_blocks, block_size, heads, d]) at
    its tokens' slots, as the cache stores it (kv_quant.quantize)."""
    as_bytes(cache).view(-1, *x.shape[1:])[slot_mapping] = as_bytes(quantize(x, scale, cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """cache's blocks block_ids, copied back to back (into buf when given),
    still in the cache's dtype.

    index_select on the block dimension copies whole blocks, about twice as
    fast on CPU as advanced indexing with a 2-D index.
    """
    # cache: [num_blocks, block_size, kvh, d] -> [len(block_ids), block_size, kvh, d]
    if buf is None:
        return as_bytes(cache).index_select(0, block_ids).view(cache.dtype)
    return torch.index_select(as_bytes(cache), 0, block_ids, out=as_bytes(buf)[: block_ids.shape[0]]).view(cache.dtype)


def dense_attention(q, k, v, mask, causal, scale, softcap, sinks=None):
    """softmax(q k^T * scale [+ mask]) v, query head h reading KV head h // group.

    q: [b, h, m, d]; k, v: [b, kvh, kv_len, d]; mask: additive, broadcastable
    to [b, h, m, kv_len], or None; causal: top-left aligned (m == kv_len);
    sinks: [h] extra softmax logits without a value, or None.
    Returns [b, h, m, d].
    """
    gqa = q.shape[1] != k.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    b, h, m, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, kvh, h // kvh, m, d)  # [b, kvh, group, m, d]
    scores = torch.matmul(qg, k.transpose(-1, -2).unsqueeze(2)).float() * scale  # [b, kvh, group, m, kv_len]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        mask = torch.full((m, k.shape[2]), float("-inf"), device=q.device).triu_(1)
    if mask is not None:
        scores = scores + mask.unsqueeze(2) if mask.dim() == 4 else scores + mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
    else:
        # As HF's gpt-oss: the sink is one more column of the softmax, then dropped.
        sink = sinks.float().view(1, kvh, h // kvh, 1, 1).expand(b, kvh, h // kvh, m, 1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1].to(v.dtype)
    return torch.matmul(probs, v.unsqueeze(2)).reshape(b, h, m, d)


def _attention_with_lse(q, k, v, mask, scale, softcap):
    """dense_attention without GQA or causality (q: [b, h, m, d], k, v: [b, h, kv_len, d]),
    also returning each query row's log-sum-exp of its masked scores, [b, h, m] fp32."""
    if softcap is None and q.device.type == "cpu":
        # CPU flash attention, the kernel SDPA runs here, which also returns the LSE.
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
        return out, lse
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [b, h, m, kv_len]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v), lse


def _merge_pieces(o_rows, lse_rows, row_decodes, num_decodes, elementwise=None):
    """Attention over a decode's whole context from its pieces' outputs.

    o_rows: [num_rows, kvh, group, d], each normalised over its own keys;
    lse_rows: [num_rows, kvh, group]. Each piece counts in proportion to the
    exp-sum of its scores. Returns [num_decodes, kvh, group, d] and the
    whole context's log-sum-exp, [num_decodes, kvh, group].
    """
    apply = elementwise or (lambda fn, x: fn(x))
    shape = (num_decodes, *lse_rows.shape[1:])
    index = row_decodes[:, None, None].expand_as(lse_rows)
    top = lse_rows.new_full(shape, float("-inf")).scatter_reduce_(0, index, lse_rows, "amax")
    weight = apply(torch.exp, lse_rows - top.index_select(0, row_decodes))  # [num_rows, kvh, group]
    total = lse_rows.new_zeros(shape).index_add_(0, row_decodes, weight)
    merged = lse_rows.new_zeros(num_decodes, *o_rows.shape[1:])  # fp32, whatever o_rows' dtype
    merged.index_add_(0, row_decodes, o_rows * weight[..., None])
    return (merged / total[..., None]).to(o_rows.dtype), top + apply(torch.log, total)


def _plan_step(
    meta: AttentionMetadata, block_size: int, token_bytes: int, window: int | None, dtype: torch.dtype,
    device: torch.device,
) -> _AttentionLayout:
    """Which blocks each request's queries can see, and the masks for the
    padding and window edges; shared by every layer of the step.

    token_bytes: one token's K as gathered (num_kv_heads * head_dim * the compute dtype's element size);
    dtype: the masks', the activations' dtype, as SDPA wants.
    """
    q_lens, seq_lens = meta.query_lens_host, meta.seq_lens_host
    starts, decodes, prefills = 0, [], []
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        # First key position the request's first query can see.
        first = max(0, seq_len - q_len - window + 1) if window is not None else 0
        if q_len <= SHORT_QUERY_MAX:
            for i in range(q_len):  # query i sees the keys up to its own position
                seen = seq_len - q_len + 1 + i
                decodes.append((r, starts + i, max(0, seen - window) if window is not None else 0, seen))
        else:
            prefills.append(_plan_prefill(meta, r, starts, q_len, seq_len, first, block_size, window, dtype, device))
        starts += q_len
    if not decodes:
        return _AttentionLayout(torch.empty(0, dtype=torch.long, device=device), None, None, [], prefills, 0)

    chunk_tokens = max(1, DECODE_CHUNK_BYTES // token_bytes)
    # Pieces of at most chunk_tokens keys: one gathered piece stays in cache.
    # Only the CPU kernel returns the log-sum-exp needed to merge pieces.
    max_piece = max(1, chunk_tokens // block_size) if device.type == "cpu" else None
    pieces = []  # (decode index, first block, num blocks, visible keys [lo, hi) relative to the first block)
    for d, (_, _, first_pos, seq_len) in enumerate(decodes):
        first, last = first_pos // block_size, (seq_len - 1) // block_size
        step = max_piece or last - first + 1
        for b in range(first, last + 1, step):
            n = min(step, last + 1 - b)
            base = b * block_size
            pieces.append((d, b, n, max(0, first_pos - base), min(n * block_size, seq_len - base)))
    # Fewest blocks first, so that each chunk pads little.
    pieces.sort(key=lambda p: p[2])
    num_blocks = [p[2] for p in pieces]

    # Every row's block ids, padded to the longest; shorter rows repeat their
    # last block (the mask hides the repeats).
    width = num_blocks[-1]
    first_t = torch.tensor([p[1] for p in pieces], device=device)  # [num_rows]
    last_t = first_t + torch.tensor(num_blocks, device=device) - 1
    cols = torch.minimum(first_t[:, None] + torch.arange(width, device=device), last_t[:, None])  # [num_rows, width]
    reqs = torch.tensor([decodes[p[0]][0] for p in pieces], device=meta.block_tables.device)
    block_ids = meta.block_tables.index_select(0, reqs).to(device).long().gather(1, cols)  # [num_rows, width]

    chunks: list[_DecodeChunk] = []
    i = 0
    while i < len(pieces):
        j = i + 1
        # Grow while the padded chunk (rows x its longest, the newest) fits.
        while j < len(pieces) and (j + 1 - i) * num_blocks[j] * block_size <= chunk_tokens:
            j += 1
        w = num_blocks[j - 1]
        ctx = w * block_size
        lo, hi = [p[3] for p in pieces[i:j]], [p[4] for p in pieces[i:j]]
        mask = None
        if any(lo) or any(h != ctx for h in hi):
            t = torch.arange(ctx, device=device)[None, :]  # [1, ctx]
            hidden = (t < torch.tensor(lo, device=device)[:, None]) | (t >= torch.tensor(hi, device=device)[:, None])
            mask = torch.zeros(j - i, 1, 1, ctx, dtype=dtype, device=device)
            mask.masked_fill_(hidden[:, None, None, :], float("-inf"))
        chunks.append(_DecodeChunk(i, j, block_ids[i:j, :w].reshape(-1), w, mask))
        i = j
    row_tokens = torch.tensor([decodes[p[0]][1] for p in pieces], dtype=torch.long, device=device)
    row_decodes = decode_tokens = None
    if len(pieces) > len(decodes):
        row_decodes = torch.tensor([p[0] for p in pieces], dtype=torch.long, device=device)
        decode_tokens = torch.tensor([start for _, start, _, _ in decodes], dtype=torch.long, device=device)
    max_gather = max((c.end - c.start) * c.num_blocks for c in chunks)
    return _AttentionLayout(row_tokens, row_decodes, decode_tokens, chunks, prefills, max_gather)


def _plan_prefill(meta, r, start, q_len, seq_len, first_pos, block_size, window, dtype, device) -> _Prefill:
    first_block = first_pos // block_size
    last_block = (seq_len - 1) // block_size
    block_ids = meta.block_tables[r, first_block : last_block + 1].to(device=device, dtype=torch.long)
    base = first_block * block_size  # position of the first gathered key
    kv_len = seq_len - base
    if q_len == kv_len and (window is None or window >= q_len):
        return _Prefill(start, start + q_len, block_ids, kv_len, None)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]  # [q_len, 1]
    k_pos = torch.arange(base, seq_len, device=device)[None, :]  # [1, kv_len]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    mask = torch.zeros(q_len, kv_len, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    return _Prefill(start, start + q_len, block_ids, kv_len, mask)


def _plan_fixed_split(
    meta: AttentionMetadata, block_size: int, token_bytes: int, window: int | None, dtype: torch.dtype,
    device: torch.device, piece_blocks: int,
) -> _AttentionLayout:
    """The batch-invariant layout: a query's arithmetic depends on its own
    position and keys only, never on the other queries of the step, nor on
    how its prompt was chunked.

    Every query token, decode or prefill, is attended as one batch row of
    the CPU flash kernel, its GQA group as the query axis. Its visible keys
    are cut at multiples of piece_blocks blocks (absolute positions, so the
    cuts do not move with the batch). A piece is gathered padded to a width
    that is a function of the piece alone: piece_blocks for a whole piece,
    the next power of two blocks (at least INVARIANT_MIN_WIDTH_TOKENS) for
    the query's last, partial one (padding masked: a masked key weighs
    exactly 0, whatever it holds), so the kernel sees one of a few shapes.
    It computes each batch row on its own, whatever shares its call and
    whether the row's keys are a copy of its own or one copy read through a
    zero stride (checked bitwise by the tests), so:

    - one request's queries reading one piece at one width (at least
      INVARIANT_SHARED_MIN_ROWS of them: a prompt's) share one gathered
      copy of its keys, in one call;
    - the other rows (decodes, a prompt's few queries in a piece) gather
      their own keys, batched by width.

    (Stacking a prompt's queries on the query axis instead would change a
    row's GEMM from the group's 2 rows to many, and with it the order of
    its sums.) A query with one piece is that row's output; one with
    several has them merged by their log-sum-exp in piece order, whichever
    calls computed them (_FixedMerge).
    """
    q_lens = np.asarray(meta.query_lens_host, dtype=np.int64)
    seq_lens = np.asarray(meta.seq_lens_host, dtype=np.int64)
    num_tokens = int(q_lens.sum())
    if not num_tokens:
        return _AttentionLayout(torch.empty(0, dtype=torch.long, device=device), None, None, [], [], 0)
    req = np.repeat(np.arange(len(q_lens)), q_lens)  # [num_tokens]: each query's request
    cu = np.cumsum(q_lens) - q_lens
    seen = seq_lens[req] - q_lens[req] + 1 + (np.arange(num_tokens) - cu[req])  # keys [0, seen) up to its own
    lo = np.maximum(0, seen - window) if window is not None else np.zeros_like(seen)
    last_block = (seen - 1) // block_size
    first_piece, last_piece = lo // block_size // piece_blocks, last_block // piece_blocks
    count = last_piece - first_piece + 1  # [num_tokens] pieces per query
    # Rows in (query, piece) order: the merge order.
    token = np.repeat(np.arange(num_tokens), count)  # [num_rows]: each piece's query
    piece = np.repeat(first_piece, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    base = piece * piece_blocks  # first block of each piece
    span = np.minimum(last_block[token] - base + 1, piece_blocks)  # blocks the piece holds up to its query's last
    min_width = max(1, INVARIANT_MIN_WIDTH_TOKENS // block_size)
    width = np.minimum(piece_blocks, np.maximum(min_width, 1 << np.ceil(np.log2(span)).astype(np.int64)))  # [num_rows]
    # Rows of one request reading one piece at one width have the same keys.
    _, group, group_rows = np.unique((req[token] * (piece.max() + 1) + piece) * (piece_blocks + 1) + width,
                                     return_inverse=True, return_counts=True)
    shared = group_rows[group] >= INVARIANT_SHARED_MIN_ROWS
    # Shared groups first, each contiguous; then the other rows by width.
    order = np.concatenate([np.flatnonzero(shared)[np.argsort(group[shared], kind="stable")],
                            np.flatnonzero(~shared)[np.argsort(width[~shared], kind="stable")]])
    token_o, base_o, width_o, group_o = token[order], base[order], width[order], group[order]
    tables = meta.block_tables.index_select(0, torch.from_numpy(req[token_o]).to(meta.block_tables.device)).long()
    chunks: list[_DecodeChunk] = []
    start, num_shared = 0, int(shared.sum())
    while start < len(order):
        w = int(width_o[start])
        is_shared = start < num_shared
        if is_shared:  # one group, one call
            end = start + int(np.searchsorted(group_o[start:num_shared], group_o[start], side="right"))
        else:
            end = start + int(np.searchsorted(width_o[start:], w, side="right"))
            end = min(end, start + max(INVARIANT_MIN_ROWS, INVARIANT_CALL_BYTES // token_bytes // (w * block_size)))
        # Blocks past the query's last visible one repeat it (masked below).
        # A shared group reads up to its last query's last block: its tokens ascend.
        rows = slice(end - 1, end) if is_shared else slice(start, end)
        cols = np.minimum(base_o[rows, None] + np.arange(w), last_block[token_o[rows]][:, None])  # [rows, w]
        ids = tables[rows].gather(1, torch.from_numpy(cols).to(tables.device)).to(device)
        keys = np.arange(w * block_size)[None, :] + (base_o[start:end] * block_size)[:, None]  # [rows, w * bs]
        t = token_o[start:end]
        hidden = torch.from_numpy((keys < lo[t][:, None]) | (keys >= seen[t][:, None])).to(device)
        mask = torch.zeros(end - start, w * block_size, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        chunks.append(_DecodeChunk(start, end, ids.reshape(-1), w, mask, is_shared))
        start = end
    place = np.argsort(order)  # [num_rows]: each (query, piece) row's place among the rows as computed
    whole = count[token] == 1
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
    merge = _FixedMerge(t(place[whole]), t(token[whole]), None, None, None)
    if not whole.all():
        multi_tokens = np.flatnonzero(count > 1)
        merge.parts = t(place[~whole])
        merge.part_queries = t(np.searchsorted(multi_tokens, token[~whole]))
        merge.part_tokens = t(multi_tokens)
    return _AttentionLayout(t(token_o), None, None, chunks, [],
                            max(c.num_blocks * (1 if c.shared else c.end - c.start) for c in chunks), merge)


def _attend_fixed_split(query, k_cache, v_cache, plan: _AttentionLayout, scale, softcap, sinks, out,
                        k_scale=1.0, v_scale=1.0) -> None:
    """Writes out ([num_tokens, num_heads, head_dim]) from a fixed-split
    layout (_plan_fixed_split): every row a call of its own to the kernel's
    arithmetic, its keys a copy of its own or one shared copy; the pieces
    merge in piece order; sinks join after, as in _attend_decodes."""
    num_heads, head_dim = query.shape[1:]
    _, block_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    k_buf = k_cache.new_empty(plan.max_gather_blocks, block_size, kvh, head_dim)
    v_buf = v_cache.new_empty(plan.max_gather_blocks, block_size, kvh, head_dim)
    q_rows = query.index_select(0, plan.row_tokens).view(-1, kvh, group, head_dim)  # [num_rows, kvh, group, d]
    o_rows = torch.empty_like(q_rows)
    lse_rows = q_rows.new_empty(q_rows.shape[:-1], dtype=torch.float32)  # [num_rows, kvh, group]
    for chunk in plan.decodes:
        n, ctx = chunk.end - chunk.start, chunk.num_blocks * block_size
        k = dequantize(_gather(k_cache, chunk.block_ids, k_buf), k_scale, query.dtype)
        v = dequantize(_gather(v_cache, chunk.block_ids, v_buf), v_scale, query.dtype)
        if chunk.shared:  # one copy of the piece, read by every row through a zero stride
            k, v = (t.view(1, ctx, kvh, head_dim).expand(n, -1, -1, -1) for t in (k, v))
        # [n, ctx, kvh, d] viewed as [n, kvh, ctx, d]
        k, v = (t.view(n, ctx, kvh, head_dim).transpose(1, 2) for t in (k, v))
        q, mask = q_rows[chunk.start : chunk.end], chunk.mask[:, None, None]
        if softcap is None and q.device.type == "cpu":
            o, lse = _attention_with_lse(q, k, v, mask, scale, softcap)  # the flash kernel: row by row
        else:
            o, lse = _attention_with_lse_in_fixed_calls(q, k, v, mask, scale, softcap)
        o_rows[chunk.start : chunk.end], lse_rows[chunk.start : chunk.end] = o, lse
    m = plan.merge
    outputs = [(o_rows.index_select(0, m.whole), lse_rows.index_select(0, m.whole), m.whole_tokens)]
    if m.parts is not None:
        outputs.append((*_merge_pieces(o_rows.index_select(0, m.parts), lse_rows.index_select(0, m.parts),
                                       m.part_queries, m.part_tokens.shape[0], tail_free), m.part_tokens))
    for o, lse, tokens in outputs:
        if sinks is not None:
            sink = sinks.float().view(kvh, group)  # [kvh, group]
            o = (o.float() * tail_free(torch.sigmoid, lse - sink)[..., None]).to(o.dtype)
        out.index_copy_(0, tokens, o.reshape(-1, num_heads, head_dim))


def _attention_with_lse_in_fixed_calls(q, k, v, mask, scale, softcap):
    """_attention_with_lse's explicit path (softcap, or off the CPU) over
    rows in calls of exactly INVARIANT_MATH_ROWS rows, the last padded with
    zero rows: its batched matmuls pick their kernel from the whole batch's
    size (a plain loop for small ones, the BLAS for large), so every call
    gets the same shape and each row the same sums whatever the step.
    q: [n, h, m, d]; k, v: [n, h, ctx, d]; mask: [n, 1, 1, ctx]."""
    n, rows = q.shape[0], INVARIANT_MATH_ROWS
    outs, lses = [], []
    for a in range(0, n, rows):
        # Contiguous whatever they were views of (a shared piece is read
        # through a zero stride): the matmuls' kernel follows the layout too.
        part = [t[a : a + rows].contiguous() for t in (q, k, v, mask)]
        pad = rows - part[0].shape[0]
        if pad:
            part = [torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in part]
        o, lse = _attention_with_lse(*part, scale, softcap)
        outs.append(o[: rows - pad])
        lses.append(lse[: rows - pad])
    return torch.cat(outs), torch.cat(lses)


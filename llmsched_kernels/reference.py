"""Plain-torch reference implementations of the KV-cache and attention ops.

These are deliberately slow and literal (a Python loop per request) so that they are
easy to check by eye. They are the ground truth for the Triton kernels' tests and the
implementation used by the CPU executor. They import only torch.

Shapes (shared with the Triton launchers):

* key / value:      [num_tokens, num_kv_heads, head_dim]
* query / output:   [num_tokens, num_heads, head_dim], requests back to back
* k_cache / v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
* slot_mapping:     [num_tokens] int64, slot = block_id * block_size + offset_in_block,
                    negative = padding token, not written
* cu_query_lens:    [num_reqs + 1] int32, cumulative query lengths (cu[0] == 0)
* seq_lens:         [num_reqs] int32, context length INCLUDING this step's query tokens
* block_tables:     [num_reqs, max_blocks_per_req] int32, entries past a request's
                    need are arbitrary padding and never read
* block_mapping:    [n, 2] int64 rows of (src_block, dst_block)

An FP8 cache (float8_e4m3fn or float8_e5m2) holds value / scale, saturated to the
format's finite range (``quantize_kv``); a read is ``stored.float() * scale``
(``dequantize_kv``). k_scale and v_scale are per call (per layer); a cache in the
activations' dtype ignores them.

Mixture of experts (``fused_moe``):

* x:                [num_tokens, hidden]
* w13 / w2:         [num_experts, 2 * inter, hidden] (gate rows, then up) / [num_experts, hidden, inter]
* weights / ids:    [num_tokens, top_k] routing weights / expert ids

FP8 with block scales (``fp8_block_linear``):

* x:                [M, K]
* weight:           [N, K] float8_e4m3fn
* scales:           [grid rows, cdiv(K, block_k)] float32; grid_rows: [N] the scale row of each weight row

Integer weights with group scales and zero points (``int_weight_linear``, W4A16 / W8A16;
GPTQ, AWQ and compressed-tensors checkpoints are converted to this at load):

* qweight:          [N, cdiv(K, 2)] uint8 for 4 bits (column 2j in byte j's low nibble,
                    2j + 1 in its high nibble), [N, K] uint8 for 8 bits; unsigned q
* scales:           [N, cdiv(K, group_size)] float16, bfloat16 or float32
* zeros:            [N, cdiv(K, group_size)] uint8, unsigned zero points
* g_idx:            [K] int32 group of each column (GPTQ act-order) or None: k // group_size
* W[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)] in scales' dtype, then cast to x's

4-bit floats (``dequantize_mxfp4``, ``dequantize_nvfp4``; the fused-MoE kernel's quantized experts):

* blocks:           [N, groups, group / 2] uint8 E2M1 codes, value 2j in byte j's low nibble
* MXFP4:            groups of 32, scales [N, groups] uint8 E8M0: W = value * 2^(scale - 127)
* NVFP4:            groups of 16, scales [N, groups] float8_e4m3fn and a float32 global
                    scale per row: W = bf16(value * (scale / global_scale)), each step
                    rounded in float32 (compressed-tensors' decompression)

Multi-LoRA (``lora_shrink``, ``lora_expand``; executor_svc/model/lora.py's slot buffers):

* a:                [num_slots, num_parts, max_rank, K]  each slot's A per part, zero past its rank
* b:                [num_slots, max_rank, N]             each slot's B^T, the parts' columns side by side
* token_slots:      [num_tokens] int, -1 = no adapter; ranks: [num_slots] int; scales: [num_slots] float
* part_rows:        the N columns of each part, in order
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["write_kv_cache", "paged_attention", "fused_moe", "mla_decode", "fp8_block_linear", "dequantize_fp8_block",
           "dequantize_mxfp4", "dequantize_nvfp4", "fp4_weight_linear", "pack_int", "unpack_int", "dequantize_int",
           "int_weight_linear", "quantize_kv", "dequantize_kv", "lora_shrink", "lora_expand"]

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of cache_dtype stores it: x / scale in fp32, clamped to FP8's finite range."""
    if cache_dtype not in FP8_KV_DTYPES:
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return torch.clamp(x.float() / scale, -limit, limit).to(cache_dtype)


def dequantize_kv(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """What a cache holds, in fp32: stored * scale for FP8, stored itself otherwise."""
    if stored.dtype not in FP8_KV_DTYPES:
        return stored.float()
    return stored.float() * scale


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter each token's K/V into its cache slot, in place; negative slots are skipped."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=key.device, dtype=torch.int64)  # [num_tokens]
    keep = slots >= 0  # [num_tokens]
    slots = slots[keep]  # [num_kept]
    block_ids = slots // block_size  # [num_kept]
    offsets = slots % block_size  # [num_kept]
    k_cache[block_ids, offsets] = quantize_kv(key[keep], k_scale, k_cache.dtype)
    v_cache[block_ids, offsets] = quantize_kv(value[keep], v_scale, v_cache.dtype)


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row: torch.Tensor,  # [max_blocks_per_req] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """The first ``seq_len`` cached positions of one request, in position order."""
    block_size = cache.shape[1]
    num_blocks_used = -(-seq_len // block_size)
    # Only the blocks the request needs: the rest of the row is padding.
    block_ids = block_table_row[:num_blocks_used].to(device=cache.device, dtype=torch.int64)
    blocks = cache[block_ids]  # [num_blocks_used, block_size, num_kv_heads, head_dim]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_query_lens: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] fp32
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each request's new query tokens over its paged context.

    Query token i of a request with q_len new tokens sits at position
    ``seq_len - q_len + i`` and sees every cached position <= its own. One code path
    covers decode (q_len 1), prefill, chunked prefill and prefix-cache hits.

    sliding_window W (None = unbounded): a query at position i sees only positions j
    with ``i - W < j <= i`` (W = 1: itself). softcap s (None = off): the scaled scores
    become ``s * tanh(scores / s)`` before masking and softmax. sinks (None = off):
    head h's softmax gets one more logit, ``sinks[h]``, which weighs no value. All as in
    HF transformers (Mistral / Gemma 2 / gpt-oss).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    group = num_heads // num_kv_heads

    out = torch.zeros_like(query)  # [num_tokens, num_heads, head_dim]
    # One host sync for the whole call is fine here: this is the slow reference.
    cu = cu_query_lens.tolist()
    lens = seq_lens.tolist()
    for req, seq_len in enumerate(lens):
        q_start, q_end = cu[req], cu[req + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        assert q_len <= seq_len, f"request {req}: {q_len} query tokens but seq_len {seq_len}"

        # Positions before the first query's window are never read (the Triton kernel
        # skips them too), so they may hold anything, even NaN.
        first = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)
        keys = gather_context(k_cache, block_tables[req], seq_len)[first:]  # [kv_len, num_kv_heads, head_dim]
        values = gather_context(v_cache, block_tables[req], seq_len)[first:]  # [kv_len, num_kv_heads, head_dim]
        # GQA: query head h reads kv head h // group, i.e. each kv head repeated group times.
        keys = dequantize_kv(keys, k_scale).repeat_interleave(group, dim=1)  # [kv_len, num_heads, head_dim]
        values = dequantize_kv(values, v_scale).repeat_interleave(group, dim=1)  # [kv_len, num_heads, head_dim]
        q = query[q_start:q_end].float()  # [q_len, num_heads, head_dim]

        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale  # [num_heads, q_len, kv_len]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [q_len]
        kv_pos = torch.arange(first, seq_len, device=query.device)  # [kv_len]
        visible = kv_pos[None, :] <= q_pos[:, None]  # [q_len, kv_len]
        if sliding_window is not None:
            visible &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(num_heads, q_len, 1)  # [num_heads, q_len, 1]
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)  # [num_heads, q_len, kv_len]
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return out


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    weights: torch.Tensor,  # [num_tokens, top_k]
    ids: torch.Tensor,  # [num_tokens, top_k]
    activation,  # [rows, 2 * inter] -> [rows, inter]
    b13: torch.Tensor | None = None,  # [num_experts, 2 * inter]
    b2: torch.Tensor | None = None,  # [num_experts, hidden]
) -> torch.Tensor:  # [num_tokens, hidden]
    """sum over slots j of weights[t, j] * down_e(activation(gate_up_e(x[t]))), e = ids[t, j], in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].float() @ x[t].float()  # [2 * inter]
            if b13 is not None:
                h = h + b13[e].float()
            y = w2[e].float() @ activation(h[None])[0]  # [hidden]
            if b2 is not None:
                y = y + b2[e].float()
            out[t] += weights[t, j].float() * y
    return out.to(x.dtype)


def mla_decode(
    query: torch.Tensor,  # [num_reqs, num_heads, latent_dim]
    cache: torch.Tensor,  # [num_blocks, block_size, 1, latent_dim]
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    scale: float,
    value_dim: int,
    k_scale: float = 1.0,
) -> torch.Tensor:  # [num_reqs, num_heads, value_dim]
    """MLA decode (one token per request): attention over the latent cache as one
    shared KV head, each latent the key and its first value_dim values the value
    (an FP8 latent is scaled by k_scale, as key and as value)."""
    cu = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    return paged_attention(query, cache, cache, cu, seq_lens, block_tables, scale, k_scale=k_scale,
                           v_scale=k_scale)[..., :value_dim]


def dequantize_fp8_block(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scales: torch.Tensor,  # [grid rows, cdiv(K, block_k)] float32
    grid_rows: torch.Tensor,  # [N]
    block_k: int,
) -> torch.Tensor:  # [N, K] float32
    """W[n, k] = weight[n, k] * scales[grid_rows[n], k // block_k], the product in fp32."""
    n, k = weight.shape
    w = torch.empty(n, k, dtype=torch.float32, device=weight.device)
    for col in range(0, k, block_k):
        cols = slice(col, min(col + block_k, k))
        w[:, cols] = weight[:, cols].float() * scales[grid_rows, col // block_k].float()[:, None]
    return w


def fp8_block_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scales: torch.Tensor,  # [grid rows, cdiv(K, block_k)] float32
    grid_rows: torch.Tensor,  # [N]
    block_k: int,
) -> torch.Tensor:  # [M, N]
    """x W^T, W = dequantize_fp8_block(...): the product in fp32, cast to x's dtype, then the
    matmul in fp32."""
    w = dequantize_fp8_block(weight, scales, grid_rows, block_k)
    return (x.float() @ w.to(x.dtype).float().T).to(x.dtype)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_values(blocks: torch.Tensor) -> torch.Tensor:  # [N, groups * group] float32
    """The 4-bit floats of blocks [N, groups, group / 2] uint8, value 2j in byte j's low nibble."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1)  # [N, groups, group / 2, 2]
    return lut[codes.long()].flatten(1)


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [N, groups, 16] uint8
    scales: torch.Tensor,  # [N, groups] uint8, E8M0
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, groups * 32] in dtype
    """W = value * 2^(scale - 127), exact in float32 and bf16, then cast to dtype."""
    exponents = scales.to(torch.int32).repeat_interleave(32, dim=1) - 127  # [N, groups * 32]
    return torch.ldexp(e2m1_values(blocks), exponents).to(dtype)


def dequantize_nvfp4(
    blocks: torch.Tensor,  # [N, groups, 8] uint8
    scales: torch.Tensor,  # [N, groups] float8_e4m3fn
    global_scale: float | torch.Tensor,  # float32: a scalar, or [N] one per row
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, groups * 16] in dtype
    """W = value * (scale / global_scale) in float32, rounded to bfloat16, then cast to dtype."""
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=blocks.device).reshape(-1, 1)  # [N or 1, 1]
    s = scales.float() / gs  # [N, groups]
    w = e2m1_values(blocks) * s.repeat_interleave(16, dim=1)  # [N, groups * 16]
    return w.to(torch.bfloat16).to(dtype)


def fp4_weight_linear(
    x: torch.Tensor,  # [M, K] float16, bfloat16 or float32
    qweight: torch.Tensor,  # [N, cdiv(K, 2)] uint8 E2M1 codes, column 2j in byte j's low nibble
    scales: torch.Tensor,  # [N, cdiv(K, group_size)]: NVFP4 float8_e4m3fn, MXFP4 uint8 E8M0
    global_scale: torch.Tensor | None,  # [N] float32 (NVFP4) or None (MXFP4)
    group_size: int,  # 16 (NVFP4) or 32 (MXFP4)
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """x W^T (+ bias), W dequantized by dequantize_nvfp4 / dequantize_mxfp4 (K padded
    to whole groups with zero codes, then cropped), in x's dtype."""
    n, k = qweight.shape[0], x.shape[1]
    groups = scales.shape[1]
    padded = F.pad(qweight, (0, groups * group_size // 2 - qweight.shape[1])).view(n, groups, group_size // 2)
    if global_scale is None:
        w = dequantize_mxfp4(padded, scales, x.dtype)
    else:
        w = dequantize_nvfp4(padded, scales, global_scale, x.dtype)
    return F.linear(x, w[:, :k], None if bias is None else bias.to(x.dtype))


def pack_int(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [N, K] uint8 (values below 2**bits) in the packed layout: unpack_int's inverse."""
    assert bits in (4, 8), f"bits {bits}: 4 or 8"
    q = q.to(torch.uint8)
    if bits == 8:
        return q.contiguous()
    if q.shape[1] % 2:  # the last byte's high nibble is padding
        q = torch.cat([q, q.new_zeros(q.shape[0], 1)], dim=1)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # [N, cdiv(K, 2)]


def unpack_int(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:  # [N, K] uint8
    """The unsigned values of a packed weight: column 2j is byte j's low nibble, 2j + 1 its high one."""
    assert bits in (4, 8), f"bits {bits}: 4 or 8"
    if bits == 8:
        return qweight[:, :k]
    nibbles = torch.stack([qweight & 0xF, qweight >> 4], dim=-1)  # [N, cdiv(K, 2), 2]
    return nibbles.flatten(1)[:, :k]


def group_of_columns(k: int, group_size: int, g_idx: torch.Tensor | None, device) -> torch.Tensor:  # [K] int64
    """The scale/zero column of each weight column: g_idx (act-order) or k // group_size."""
    if g_idx is not None:
        return g_idx.to(device=device, dtype=torch.int64)
    return torch.arange(k, device=device) // group_size


def dequantize_int(
    qweight: torch.Tensor,  # [N, cdiv(K, 2)] (4 bits) or [N, K] (8 bits) uint8
    scales: torch.Tensor,  # [N, n_groups]
    zeros: torch.Tensor,  # [N, n_groups] uint8
    group_size: int,
    bits: int,
    g_idx: torch.Tensor | None,  # [K] int32
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K] in dtype
    """W[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)], computed in scales' dtype (as
    compressed-tensors does; q - z is an integer of at most 9 bits, exact in any float
    dtype, so the product is rounded once), then cast to dtype."""
    q = unpack_int(qweight, bits, k).to(torch.int16)  # [N, K]
    if g_idx is None:
        # Column k is in group k // group_size: broadcast each group's scale and zero over its
        # columns (K padded to whole groups) instead of gathering them per column.
        n, n_groups = scales.shape
        q = F.pad(q, (0, n_groups * group_size - k)).view(n, n_groups, group_size)
        w = (q - zeros.to(torch.int16)[:, :, None]).to(scales.dtype) * scales[:, :, None]
        return w.flatten(1)[:, :k].to(dtype)
    groups = group_of_columns(k, group_size, g_idx, qweight.device)  # [K]
    z = zeros.index_select(1, groups)  # [N, K]
    s = scales.index_select(1, groups)  # [N, K]
    return ((q - z.to(torch.int16)).to(scales.dtype) * s).to(dtype)


def int_weight_linear(
    x: torch.Tensor,  # [M, K] float16, bfloat16 or float32
    qweight: torch.Tensor,  # [N, cdiv(K, 2)] (4 bits) or [N, K] (8 bits) uint8
    scales: torch.Tensor,  # [N, n_groups]
    zeros: torch.Tensor,  # [N, n_groups] uint8
    group_size: int,
    bits: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """x W^T (+ bias) with W = dequantize_int(...) in x's dtype."""
    w = dequantize_int(qweight, scales, zeros, group_size, bits, g_idx, x.shape[1], x.dtype)  # [N, K]
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, K]
    a: torch.Tensor,  # [num_slots, num_parts, max_rank, K]
    token_slots: torch.Tensor,  # [num_tokens]
    ranks: torch.Tensor,  # [num_slots]
) -> torch.Tensor:  # [num_tokens, num_parts, max_rank] in x's dtype
    """s[t, p, :r] = x[t] A[slot, p, :r]^T in fp32, rounded to x's dtype, for each token of a
    slot (r its rank); zero for base tokens (slot -1) and past the rank."""
    num_slots, num_parts, max_rank, _ = a.shape
    s = torch.zeros(x.shape[0], num_parts, max_rank, dtype=x.dtype, device=x.device)
    for t in range(x.shape[0]):
        slot = int(token_slots[t])
        if slot < 0:
            continue
        r = int(ranks[slot])
        s[t, :, :r] = (a[slot, :, :r].float() @ x[t].float()).to(x.dtype)  # [num_parts, r]
    return s


def lora_expand(
    y: torch.Tensor,  # [num_tokens, N]
    s: torch.Tensor,  # [num_tokens, num_parts, max_rank]
    b: torch.Tensor,  # [num_slots, max_rank, N]
    token_slots: torch.Tensor,  # [num_tokens]
    ranks: torch.Tensor,  # [num_slots]
    scales: torch.Tensor,  # [num_slots]
    part_rows: tuple[int, ...],
) -> torch.Tensor:  # [num_tokens, N], a new tensor
    """y[t, part p] + scale * (s[t, p, :r] b[slot, :r, part p]), summed in fp32 and rounded
    once to y's dtype, for each token of a slot; base tokens' rows unchanged."""
    out = y.clone()
    for t in range(y.shape[0]):
        slot = int(token_slots[t])
        if slot < 0:
            continue
        r, start = int(ranks[slot]), 0
        for p, rows in enumerate(part_rows):
            cols = slice(start, start + rows)
            delta = s[t, p, :r].float() @ b[slot, :r, cols].float()  # [rows]
            out[t, cols] = (y[t, cols].float() + float(scales[slot]) * delta).to(y.dtype)
            start += rows
    return out

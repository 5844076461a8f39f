"""Attention and KV-cache kernels for the executor.

Layout shared by every op (see ``llmsched_kernels.reference`` for the semantics):

* K/V cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per cache, one for K
  and one for V; a token's slot is ``block_id * block_size + offset_in_block``.
* Queries are flattened and unpadded: ``[num_tokens, num_heads, head_dim]`` with the
  requests back to back, delimited by ``cu_query_lens``.

Modules:

* ``llmsched_kernels.reference``      plain-torch references (slow, obviously correct, CPU friendly)
* ``llmsched_kernels.kv_write``       Triton ``write_kv_cache``
* ``llmsched_kernels.paged_attention`` Triton ``paged_attention``
* ``llmsched_kernels.int_linear``     Triton ``int_weight_linear`` (W4A16 / W8A16 GEMM)
* ``llmsched_kernels.triton_bits``    what the kernels share: e4m3 decoded from its bits, bf16 rounding, the interpreter check

Nothing here imports Triton at package import time: the CPU executor imports
``llmsched_kernels.reference`` on machines where Triton is not installed.
"""

"""Gemma 2: (1+w) RMSNorms, sandwich norms around attention and MLP,
embeddings scaled by sqrt(hidden), GeGLU, query_pre_attn_scalar, score and
logit soft-capping, sliding and global layers alternating."""

from __future__ import annotations

from typing import Any

from executor_svc.model.families.base import Family, layer_types, no_bias, single_rope
from executor_svc.model.model import CausalLM, SandwichDecoderLayer
from executor_svc.model.model_config import FULL, SLIDING, ConfigReader


def gemma_common(r: ConfigReader) -> dict[str, Any]:
    """What Gemma 2 and 3 share in config.json: (1+w) norms, scaled
    embeddings, GeGLU, query_pre_attn_scalar."""
    no_bias(r)
    r.refuse_unless("hidden_activation", "gelu_pytorch_tanh", "Gemma's MLP is implemented with gelu_pytorch_tanh")
    r.refuse_unless("use_bidirectional_attention", False, "only causal attention is implemented")
    return dict(hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, embed_scale=True,
                query_pre_attn_scalar=float(r.get("query_pre_attn_scalar", 256)))


def read_gemma2(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    out = gemma_common(r)
    rope = single_rope(r, c)
    return out | dict(
        layer_types=layer_types(r, c["num_layers"], lambda i: SLIDING if (i + 1) % 2 else FULL),
        sliding_window=r.get("sliding_window", 4096),
        rope={FULL: rope, SLIDING: rope},
        attn_softcap=r.get("attn_logit_softcapping", 50.0),
        final_softcap=r.get("final_logit_softcapping", 30.0),
    )


class Gemma2ForCausalLM(CausalLM):
    layer_cls = SandwichDecoderLayer


GEMMA_IGNORED = {"hidden_act": "Gemma's modeling reads hidden_activation; hidden_act is a legacy duplicate"}

FAMILY = Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), read_gemma2,
                defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "head_dim": 256,
                          "tie_word_embeddings": True},
                ignored=GEMMA_IGNORED, model_cls=Gemma2ForCausalLM)

"""What the executor's handshake says of the model and its KV pool, as a
plain record: the scheduler reads these and nothing else of the executor
(executor_client.py converts the protobuf)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelFacts:
    instance_id: str  # one per executor process: a new one means a restart
    model: str
    architecture: str
    rope_type: str
    device: str
    tensor_parallel_size: int  # 0 from an executor older than the field
    tokenizer_json: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_logprobs: int
    supports_constraints: bool
    chat_template: str
    bos_token: str
    eos_token: str
    # The KV pool.
    block_size: int
    num_kv_blocks: int
    num_host_kv_blocks: int
    max_model_len: int
    # The weights on one rank, as loaded, and how the checkpoint stores them.
    weight_bytes: int = 0
    quantization: str = ""
    # How embeddings pool ("last+normalize"); empty: no embeddings. And the
    # pooled vector's width.
    pooling: str = ""
    hidden_size: int = 0
    embedding_only: bool = False  # no lm_head: Generate is refused
    # The executor's speculative decoding: its proposer ("" = off) and most
    # drafts per request per step.
    speculative_method: str = ""
    speculative_tokens: int = 0
    # EXECUTOR_BATCH_INVARIANT: prompt chunks are then cut independently of
    # load (SchedulerConfig.batch_invariant).
    batch_invariant: bool = False
    # LoRA adapters the executor serves, by name (GenerateRequest.adapter).
    lora_adapters: tuple[str, ...] = ()
    # Device slots for them (lora_slots.py; 0: an executor older than the
    # field, which holds every adapter at once).
    max_loras: int = 0
    max_cpu_loras: int = 0
    # EXECUTOR_RUNTIME_LORA_DIR, resolved: LoadLoraAdapter is served when set.
    runtime_lora_dir: str = ""

    @property
    def geometry(self) -> tuple:
        """What the live requests' state depends on. Not the host tier's
        size: it comes back empty after a restart anyway. The LoRA adapters
        are: a live request's adapter must still be served."""
        return (self.model, self.block_size, self.num_kv_blocks, self.max_model_len, self.vocab_size,
                self.speculative_tokens, self.batch_invariant, self.lora_adapters, self.max_loras,
                self.runtime_lora_dir)

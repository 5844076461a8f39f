from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterLoraAdapterRequest(_message.Message):
    __slots__ = ("key", "path")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    key: str
    path: str
    def __init__(self, key: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class RegisterLoraAdapterResponse(_message.Message):
    __slots__ = ("resolved_path", "rank")
    RESOLVED_PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    resolved_path: str
    rank: int
    def __init__(self, resolved_path: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class UnregisterLoraAdapterRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class UnregisterLoraAdapterResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("model", "tokenizer_json", "block_size", "num_kv_blocks", "max_model_len", "instance_id", "vocab_size", "eos_token_ids", "max_logprobs", "device", "chat_template", "bos_token", "eos_token", "architecture", "rope_type", "tensor_parallel_size", "supports_constraints", "kv_bytes_per_token", "num_host_kv_blocks", "weight_bytes", "quantization", "pooling", "hidden_size", "embedding_only", "speculative_method", "speculative_tokens", "batch_invariant", "lora_adapters", "max_loras", "max_cpu_loras", "step_socket", "runtime_lora_dir")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    ROPE_TYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_CONSTRAINTS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_ONLY_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_LORA_DIR_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokenizer_json: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    instance_id: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_logprobs: int
    device: str
    chat_template: str
    bos_token: str
    eos_token: str
    architecture: str
    rope_type: str
    tensor_parallel_size: int
    supports_constraints: bool
    kv_bytes_per_token: int
    num_host_kv_blocks: int
    weight_bytes: int
    quantization: str
    pooling: str
    hidden_size: int
    embedding_only: bool
    speculative_method: str
    speculative_tokens: int
    batch_invariant: bool
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    max_cpu_loras: int
    step_socket: str
    runtime_lora_dir: str
    def __init__(self, model: _Optional[str] = ..., tokenizer_json: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., instance_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_logprobs: _Optional[int] = ..., device: _Optional[str] = ..., chat_template: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., architecture: _Optional[str] = ..., rope_type: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., supports_constraints: _Optional[bool] = ..., kv_bytes_per_token: _Optional[int] = ..., num_host_kv_blocks: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., quantization: _Optional[str] = ..., pooling: _Optional[str] = ..., hidden_size: _Optional[int] = ..., embedding_only: _Optional[bool] = ..., speculative_method: _Optional[str] = ..., speculative_tokens: _Optional[int] = ..., batch_invariant: _Optional[bool] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., step_socket: _Optional[str] = ..., runtime_lora_dir: _Optional[str] = ...) -> None: ...

class StepSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "has_seed", "seed", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "min_tokens_held_ids", "logit_bias_ids", "logit_bias_values", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_HELD_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    min_tokens_held_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., min_tokens_held_ids: _Optional[_Iterable[int]] = ..., logit_bias_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("handle", "token_ids", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "sampling", "num_output_tokens", "constraint", "embed", "adapter")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    handle: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: StepSampling
    num_output_tokens: int
    constraint: Constraint
    embed: bool
    adapter: str
    def __init__(self, handle: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., sampling: _Optional[_Union[StepSampling, _Mapping]] = ..., num_output_tokens: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., embed: _Optional[bool] = ..., adapter: _Optional[str] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("grammar", "ignore_eos")
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    grammar: str
    ignore_eos: bool
    def __init__(self, grammar: _Optional[str] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_handles", "cached_num_scheduled_tokens", "new_block_handles", "new_block_ids", "finished_handles", "traceparent", "epoch", "after_idle", "swap_out_device_blocks", "swap_out_host_blocks", "swap_in_host_blocks", "swap_in_device_blocks", "draft_handles", "draft_counts", "multi_step", "stop_token_ids", "multi_step_drafts", "lora_evict_slots", "lora_load_slots", "lora_load_adapters")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    CACHED_NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_HANDLES_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_IDLE_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    MULTI_STEP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MULTI_STEP_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    LORA_EVICT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LORA_LOAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LORA_LOAD_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_handles: _containers.RepeatedScalarFieldContainer[int]
    cached_num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_block_handles: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    finished_handles: _containers.RepeatedScalarFieldContainer[int]
    traceparent: str
    epoch: int
    after_idle: bool
    swap_out_device_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_out_host_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_in_host_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_in_device_blocks: _containers.RepeatedScalarFieldContainer[int]
    draft_handles: _containers.RepeatedScalarFieldContainer[int]
    draft_counts: _containers.RepeatedScalarFieldContainer[int]
    multi_step: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    multi_step_drafts: int
    lora_evict_slots: _containers.RepeatedScalarFieldContainer[int]
    lora_load_slots: _containers.RepeatedScalarFieldContainer[int]
    lora_load_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_handles: _Optional[_Iterable[int]] = ..., cached_num_scheduled_tokens: _Optional[_Iterable[int]] = ..., new_block_handles: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., finished_handles: _Optional[_Iterable[int]] = ..., traceparent: _Optional[str] = ..., epoch: _Optional[int] = ..., after_idle: _Optional[bool] = ..., swap_out_device_blocks: _Optional[_Iterable[int]] = ..., swap_out_host_blocks: _Optional[_Iterable[int]] = ..., swap_in_host_blocks: _Optional[_Iterable[int]] = ..., swap_in_device_blocks: _Optional[_Iterable[int]] = ..., draft_handles: _Optional[_Iterable[int]] = ..., draft_counts: _Optional[_Iterable[int]] = ..., multi_step: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., multi_step_drafts: _Optional[int] = ..., lora_evict_slots: _Optional[_Iterable[int]] = ..., lora_load_slots: _Optional[_Iterable[int]] = ..., lora_load_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class SampledLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("handle", "first", "logprobs", "top_k", "top_token_ids", "top_logprobs")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    first: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_k: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, handle: _Optional[int] = ..., first: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_k: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("handle", "values")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    handle: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, handle: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_handles", "sampled_token_ids", "logprobs", "prepare_ns", "forward_ns", "sample_ns", "error", "discarded", "request_errors", "swap_ns", "failed_swap_outs", "failed_swap_ins", "prompt_logprobs", "embeddings", "verified_handles", "verified_draft_counts", "accepted_draft_counts", "lora_load_ns", "lora_disk_reads")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ERRORS_FIELD_NUMBER: _ClassVar[int]
    SWAP_NS_FIELD_NUMBER: _ClassVar[int]
    FAILED_SWAP_OUTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_SWAP_INS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    LORA_LOAD_NS_FIELD_NUMBER: _ClassVar[int]
    LORA_DISK_READS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_handles: _containers.RepeatedScalarFieldContainer[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[SampledLogprobs]
    prepare_ns: int
    forward_ns: int
    sample_ns: int
    error: str
    discarded: bool
    request_errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    swap_ns: int
    failed_swap_outs: _containers.RepeatedScalarFieldContainer[int]
    failed_swap_ins: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    verified_handles: _containers.RepeatedScalarFieldContainer[int]
    verified_draft_counts: _containers.RepeatedScalarFieldContainer[int]
    accepted_draft_counts: _containers.RepeatedScalarFieldContainer[int]
    lora_load_ns: int
    lora_disk_reads: int
    def __init__(self, step_id: _Optional[int] = ..., sampled_handles: _Optional[_Iterable[int]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[SampledLogprobs, _Mapping]]] = ..., prepare_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ..., sample_ns: _Optional[int] = ..., error: _Optional[str] = ..., discarded: _Optional[bool] = ..., request_errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., swap_ns: _Optional[int] = ..., failed_swap_outs: _Optional[_Iterable[int]] = ..., failed_swap_ins: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., verified_handles: _Optional[_Iterable[int]] = ..., verified_draft_counts: _Optional[_Iterable[int]] = ..., accepted_draft_counts: _Optional[_Iterable[int]] = ..., lora_load_ns: _Optional[int] = ..., lora_disk_reads: _Optional[int] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("handle", "message")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    handle: int
    message: str
    def __init__(self, handle: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

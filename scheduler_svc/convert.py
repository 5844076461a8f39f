"""Dataclasses <-> protobuf for the scheduler: the step plan going out,
the step result coming back, and the public stream responses."""

from __future__ import annotations

from collections.abc import Callable

from llmsched.v1 import executor_pb2 as epb
from llmsched.v1 import scheduler_pb2 as spb
from scheduler_svc.core.model_facts import ModelFacts
from scheduler_svc.core.plan import PromptLogprobsResult, StepPlan, StepResult
from scheduler_svc.core.request import Request, RequestStatus, SamplingParams
from scheduler_svc.output_processor import RequestDelta

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: spb.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: spb.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: spb.FINISH_REASON_ABORT,
    RequestStatus.FINISHED_ERROR: spb.FINISH_REASON_ABORT,
}


def model_facts(h: epb.HandshakeResponse) -> ModelFacts:
    return ModelFacts(
        instance_id=h.instance_id, model=h.model, architecture=h.architecture, rope_type=h.rope_type, device=h.device,
        tensor_parallel_size=h.tensor_parallel_size, tokenizer_json=h.tokenizer_json, vocab_size=h.vocab_size,
        eos_token_ids=tuple(h.eos_token_ids), max_logprobs=h.max_logprobs, supports_constraints=h.supports_constraints,
        chat_template=h.chat_template, bos_token=h.bos_token, eos_token=h.eos_token, block_size=h.block_size,
        num_kv_blocks=h.num_kv_blocks, num_host_kv_blocks=h.num_host_kv_blocks, max_model_len=h.max_model_len,
        weight_bytes=h.weight_bytes, quantization=h.quantization, pooling=h.pooling, hidden_size=h.hidden_size,
        embedding_only=h.embedding_only, speculative_method=h.speculative_method,
        speculative_tokens=h.speculative_tokens, batch_invariant=h.batch_invariant,
        lora_adapters=tuple(h.lora_adapters), max_loras=h.max_loras, max_cpu_loras=h.max_cpu_loras,
        runtime_lora_dir=h.runtime_lora_dir,
    )


def finish_reason_name(status: RequestStatus) -> str:
    """`stop`, `length` or `abort`, as the request log and the OpenAI API say it."""
    return spb.FinishReason.Name(FINISH_REASONS[status]).removeprefix("FINISH_REASON_").lower()


def step_sampling(s: SamplingParams, eos_token_ids: frozenset[int] = frozenset(),
                  prompt_logprobs: bool = False) -> epb.StepSampling:
    """prompt_logprobs: whether this plan asks for the prompt's logprobs
    (not once they were all streamed, for a request resent after a
    preemption)."""
    out = epb.StepSampling(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        has_seed=s.seed is not None,
        seed=s.seed or 0,
        logprobs=s.logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        min_p=s.min_p,
        min_tokens=s.min_tokens,
    )
    if s.min_tokens:
        # What would end the request (Scheduler._check_stop) is masked
        # until min_tokens tokens were generated.
        held = set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos_token_ids))
        out.min_tokens_held_ids.extend(sorted(held))
    if prompt_logprobs and s.prompt_logprobs is not None:
        out.prompt_logprobs = s.prompt_logprobs
    if s.logit_bias:
        out.logit_bias_ids.extend(t for t, _ in s.logit_bias)
        out.logit_bias_values.extend(b for _, b in s.logit_bias)
    return out


def plan_to_proto(out: StepPlan) -> epb.StepPlan:
    plan = epb.StepPlan(
        step_id=out.step_id,
        cached_handles=[r.handle for r in out.cached_requests],
        cached_num_scheduled_tokens=out.cached_num_scheduled_tokens,
        new_block_handles=out.new_block_handles,
        new_block_ids=out.new_block_ids,
        finished_handles=out.finished_handles,
        epoch=out.executor_epoch,
        draft_handles=out.lookahead_handles,
        draft_counts=out.lookahead_counts,
        multi_step=out.multi_step,
        stop_token_ids=out.stop_token_ids,
        multi_step_drafts=out.multi_step_drafts,
        lora_evict_slots=out.lora_evicts,
        lora_load_slots=[s for s, _ in out.lora_loads],
        lora_load_adapters=[a for _, a in out.lora_loads],
    )
    if out.swaps is not None:
        plan.swap_out_device_blocks.extend(out.swaps.out_device)
        plan.swap_out_host_blocks.extend(out.swaps.out_host)
        plan.swap_in_host_blocks.extend(out.swaps.in_host)
        plan.swap_in_device_blocks.extend(out.swaps.in_device)
    for n in out.new_requests:
        plan.new_requests.append(
            epb.NewRequest(
                handle=n.handle,
                token_ids=n.token_ids,
                block_ids=n.block_ids,
                num_computed_tokens=n.num_computed_tokens,
                num_scheduled_tokens=n.num_scheduled_tokens,
                sampling=step_sampling(n.request.sampling, n.request.eos_token_ids,
                                       prompt_logprobs=not n.num_output_tokens),
                num_output_tokens=n.num_output_tokens,
                constraint=constraint_to_proto(n.request),
                embed=n.request.embed,
                adapter=n.request.adapter,
            )
        )
    return plan


def constraint_to_proto(req: Request) -> epb.Constraint | None:
    if req.constraint is None:
        return None
    return epb.Constraint(grammar=req.constraint.grammar, ignore_eos=req.sampling.ignore_eos)


def request_errors_from_proto(result: epb.StepResult) -> list[tuple[int, str]]:
    return [(e.handle, e.message) for e in result.request_errors]


def outcome_from_proto(result: epb.StepResult) -> StepResult:
    return StepResult(sampled=sampled_from_proto(result), request_errors=request_errors_from_proto(result),
                       error=result.error, discarded=result.discarded, forward_ns=result.forward_ns,
                       sample_ns=result.sample_ns, failed_swap_outs=list(result.failed_swap_outs),
                       failed_swap_ins=list(result.failed_swap_ins), swap_ns=result.swap_ns,
                       prompt_logprobs=[PromptLogprobsResult(p.handle, p.first, list(p.logprobs), p.top_k,
                                                             list(p.top_token_ids), list(p.top_logprobs))
                                        for p in result.prompt_logprobs],
                       embeddings=[(e.handle, list(e.values)) for e in result.embeddings],
                       verified_drafts=list(zip(result.verified_handles, result.verified_draft_counts,
                                                result.accepted_draft_counts, strict=True)),
                       lora_load_ns=result.lora_load_ns, lora_disk_reads=result.lora_disk_reads)


def sampled_from_proto(result: epb.StepResult) -> list[tuple[int, int, tuple | None]]:
    if result.logprobs:
        lps = [(lp.logprob, list(lp.top_token_ids), list(lp.top_logprobs)) for lp in result.logprobs]
    else:
        lps = [None] * len(result.sampled_handles)
    return list(zip(result.sampled_handles, result.sampled_token_ids, lps))


def delta_to_response(request_id: str, d: RequestDelta, want_logprobs: bool,
                      decode: Callable[[int], str] | None = None) -> spb.GenerateResponse:
    """decode gives the text of one token id, for TokenLogprobs.token(s)."""
    resp = spb.GenerateResponse(request_id=request_id, token_ids=d.token_ids, text=d.text)
    if want_logprobs:
        _add_logprobs(resp.logprobs, d.logprobs, decode)
    if d.prompt_logprobs:
        _add_logprobs(resp.prompt_logprobs, d.prompt_logprobs, decode)
    if d.finish_status is not None:
        resp.finish_reason = FINISH_REASONS[d.finish_status]
    if d.stop_string:
        resp.stop_string = d.stop_string
    if d.usage is not None:
        resp.usage.CopyFrom(
            spb.Usage(
                prompt_tokens=d.usage.prompt_tokens,
                completion_tokens=d.usage.completion_tokens,
                cached_prompt_tokens=d.usage.cached_prompt_tokens,
            )
        )
    return resp


def _add_logprobs(field, entries: list[tuple[int, float, list[int], list[float]]],
                  decode: Callable[[int], str] | None) -> None:
    for token_id, lp, top_ids, top_lps in entries:
        field.add(token_id=token_id, logprob=lp, top_token_ids=top_ids, top_logprobs=top_lps,
                  token=decode(token_id) if decode else "", top_tokens=[decode(t) for t in top_ids] if decode else [])

"""Protobuf <-> runner dataclasses: the only place the executor touches
step-protocol messages."""

from __future__ import annotations

from executor_svc.step.runner import NewRequestData, StepPlan, StepResult
from executor_svc.step.sampler import SamplingSettings
from executor_svc.step.step_loop import Plan, UndecodablePlan
from llmsched.v1 import executor_pb2 as pb


def sampling_from_proto(s: pb.StepSampling) -> SamplingSettings:
    return SamplingSettings(
        temperature=s.temperature,
        top_p=s.top_p if s.top_p > 0 else 1.0,
        top_k=s.top_k,
        seed=s.seed if s.has_seed else None,
        logprobs=s.logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty > 0 else 1.0,
        min_p=s.min_p,
        min_tokens=s.min_tokens,
        min_tokens_held_ids=tuple(s.min_tokens_held_ids),
        logit_bias=tuple(zip(s.logit_bias_ids, s.logit_bias_values)),
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
    )


def step_from_proto(plan: pb.StepPlan, keep_wire: bool = False) -> StepPlan:
    """keep_wire: the plan also carries the message's bytes, for the other
    tensor-parallel ranks."""
    return StepPlan(
        step_id=plan.step_id,
        new_requests=[
            NewRequestData(
                handle=r.handle,
                token_ids=list(r.token_ids),
                block_ids=list(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                sampling=sampling_from_proto(r.sampling),
                num_output_tokens=r.num_output_tokens,
                grammar=r.constraint.grammar if r.HasField("constraint") else None,
                ignore_eos=r.constraint.ignore_eos,
                embed=r.embed,
                adapter=r.adapter,
            )
            for r in plan.new_requests
        ],
        cached_handles=list(plan.cached_handles),
        cached_num_scheduled_tokens=list(plan.cached_num_scheduled_tokens),
        new_block_handles=list(plan.new_block_handles),
        new_block_ids=list(plan.new_block_ids),
        finished_handles=list(plan.finished_handles),
        swap_out_device_blocks=list(plan.swap_out_device_blocks),
        swap_out_host_blocks=list(plan.swap_out_host_blocks),
        swap_in_host_blocks=list(plan.swap_in_host_blocks),
        swap_in_device_blocks=list(plan.swap_in_device_blocks),
        draft_handles=list(plan.draft_handles),
        draft_counts=list(plan.draft_counts),
        lora_evict_slots=list(plan.lora_evict_slots),
        lora_load_slots=list(plan.lora_load_slots),
        lora_load_adapters=list(plan.lora_load_adapters),
        multi_step=plan.multi_step,
        stop_token_ids=list(plan.stop_token_ids),
        multi_step_drafts=plan.multi_step_drafts,
        epoch=plan.epoch,
        after_idle=plan.after_idle,
        traceparent=plan.traceparent,
        wire=plan.SerializeToString() if keep_wire else b"",
    )


def receive_plan(plan: pb.StepPlan, keep_wire: bool) -> Plan:
    """The plan as the step loop runs it; a message that does not decode
    becomes that step's failure, reported in its turn."""
    try:
        return step_from_proto(plan, keep_wire)
    except Exception as exc:
        return UndecodablePlan(plan.step_id, plan.epoch, plan.traceparent, plan.after_idle,
                               plan.SerializeToString() if keep_wire else b"", exc)


def result_to_proto(out: StepResult) -> pb.StepResult:
    result = pb.StepResult(
        step_id=out.step_id,
        sampled_handles=out.sampled_handles,
        sampled_token_ids=out.sampled_token_ids,
        prepare_ns=out.prepare_ns,
        forward_ns=out.forward_ns,
        sample_ns=out.sample_ns,
        error=out.error or "",
        discarded=out.was_discarded,
        lora_load_ns=out.lora_load_ns,
        lora_disk_reads=out.lora_disk_reads,
    )
    if out.logprobs is not None:
        for lp, top_ids, top_lps in out.logprobs:
            result.logprobs.add(logprob=lp, top_token_ids=top_ids, top_logprobs=top_lps)
    for p in out.prompt_logprobs:
        result.prompt_logprobs.add(handle=p.handle, first=p.first, logprobs=p.logprobs, top_k=p.top_k,
                                   top_token_ids=p.top_token_ids, top_logprobs=p.top_logprobs)
    for handle, values in out.embeddings:
        result.embeddings.add(handle=handle, values=values)
    for handle, verified, accepted in out.verified_drafts:
        result.verified_handles.append(handle)
        result.verified_draft_counts.append(verified)
        result.accepted_draft_counts.append(accepted)
    for handle, message in out.request_errors:
        result.request_errors.add(handle=handle, message=message)
    if out.swaps is not None:
        result.swap_ns = out.swaps.swap_ns
        result.failed_swap_outs.extend(out.swaps.failed_outs)
        result.failed_swap_ins.extend(out.swaps.failed_ins)
    return result

"""A tensor-parallel rank other than 0: it serves nothing, and runs what
rank 0 sends over the group until told to stop (tensor_parallel.py)."""

from __future__ import annotations

import logging
from typing import NoReturn

from executor_svc.convert import step_from_proto
from executor_svc.loading import LoadedModel
from executor_svc.tensor_parallel import LORA_FORGET, LORA_REGISTER, LORA_UNREGISTER, RESET, SHUTDOWN, STEP
from llmsched.v1 import executor_pb2 as pb

log = logging.getLogger(__name__)


def run_worker(loaded: LoadedModel) -> NoReturn:
    tp, runner = loaded.tp, loaded.runner
    log.info("rank %d of %d ready on %s", tp.rank, tp.size, loaded.device)
    while True:
        kind, payload = tp.receive()
        if kind == STEP:
            plan = pb.StepPlan.FromString(payload)
            try:
                runner.execute(step_from_proto(plan))
            except Exception:
                # Rank 0 meets the same error at the same point (same plan,
                # same state) and resets too; its RESET follows.
                log.exception("rank %d: step %d failed", tp.rank, plan.step_id)
                runner.reset()
        elif kind == RESET:
            runner.reset()
        elif kind == LORA_REGISTER:
            # Rank 0 read and checked it; this rank reads it at its first load.
            msg = pb.RegisterLoraAdapterRequest.FromString(payload)
            runner.lora.register(msg.key, msg.path)
        elif kind == LORA_UNREGISTER:
            runner.lora.unregister(payload.decode())
        elif kind == LORA_FORGET:
            runner.lora.forget_runtime()
        elif kind == SHUTDOWN:
            log.info("rank %d stopping", tp.rank)
            tp.leave()

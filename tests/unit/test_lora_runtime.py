"""Runtime LoRA adapters on the scheduler's side, driven synchronously: the
registry (scheduler_svc/core/lora_registry.py: names, per-load keys,
refusals), and the unload rule through the engine core and the slots
(an unloaded adapter is freed only once no live request uses it and no
plan in flight names it; a reload under the same name never hits the old
one's cached blocks)."""

from __future__ import annotations

import pytest

from scheduler_svc.core.backpressure import AdmissionLimits
from scheduler_svc.core.engine_core import CoreLimits, CoreListener, EngineCore, TurnKind
from scheduler_svc.core.lora_registry import AdapterRefused, LoraRegistry
from scheduler_svc.core.plan import StepResult
from scheduler_svc.core.scheduler_config import SchedulerConfig
from tests.factories import FakeExecutor, make_request

PROMPT = list(range(100, 116))  # 4 whole blocks of 4


class Failures(CoreListener):
    def __init__(self):
        self.failed: list[tuple[str, str]] = []

    def request_failed(self, request_id: str, code: str, message: str) -> None:
        self.failed.append((request_id, code))


def make_core(max_loras: int = 1, plans_in_flight: int = 2) -> tuple[EngineCore, Failures]:
    listener = Failures()
    core = EngineCore(CoreLimits(plans_in_flight, AdmissionLimits(1000, 10**6, 0.0, 64, 8)), listener)
    core.attach(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256, max_num_seqs=8,
                                max_num_batched_tokens=64, max_prefill_chunk=32, max_loras=max_loras,
                                runtime_lora=True))
    return core, listener


def load(registry: LoraRegistry, core: EngineCore, name: str, path: str = "/adapters/x") -> str:
    """What Engine.load_lora does once the executor took the adapter."""
    adapter = registry.begin_load(name, path)
    registry.finish_load(adapter, path, 8)
    core.scheduler.lora.register(adapter.key)
    return adapter.key


def send(core: EngineCore):
    core.apply_pending()
    turn = core.next_turn()
    assert turn.kind is TurnKind.SEND, turn.kind
    core.on_sent(turn.step, 0.0)
    return turn.step.out


def receive(core: EngineCore) -> None:
    core.on_result(StepResult(sampled=FakeExecutor().run(core.in_flight[0].out)), 0.0)


# ----- the registry -----------------------------------------------------------

def test_each_load_of_a_name_gets_a_new_key_so_a_reload_is_another_adapter():
    registry = LoraRegistry(static=["s"])
    first = registry.begin_load("sql", "/a")
    registry.finish_load(first, "/a", 8)
    registry.unload("sql")
    second = registry.begin_load("sql", "/b")
    assert first.key != second.key and "@" in first.key
    assert registry.key_of("s") == "s", "a start-up adapter's key is its name"


def test_a_name_already_loaded_or_loading_or_static_is_refused_as_already_exists():
    registry = LoraRegistry(static=["s"])
    loading = registry.begin_load("x", "/a")
    for name in ("s", "x"):
        with pytest.raises(AdapterRefused) as exc:
            registry.begin_load(name, "/b")
        assert exc.value.code == "ALREADY_EXISTS" and "has already been loaded" in str(exc.value)
    registry.abandon_load(loading)
    registry.begin_load("x", "/a")  # a refused load frees the name


@pytest.mark.parametrize("name", ["", "a@b", "-x", "a b", "x" * 129])
def test_a_bad_lora_name_is_refused_naming_the_field(name):
    with pytest.raises(AdapterRefused) as exc:
        LoraRegistry().begin_load(name, "/a")
    assert exc.value.code == "INVALID_ARGUMENT" and exc.value.field == "lora_name"


def test_unloading_an_unknown_name_is_not_found_and_a_static_one_failed_precondition():
    registry = LoraRegistry(static=["s"])
    with pytest.raises(AdapterRefused) as exc:
        registry.unload("nope")
    assert exc.value.code == "NOT_FOUND" and "'nope' cannot be found" in str(exc.value)
    with pytest.raises(AdapterRefused) as exc:
        registry.unload("s")
    assert exc.value.code == "FAILED_PRECONDITION" and "EXECUTOR_LORA_ADAPTERS" in str(exc.value)


def test_an_unloaded_name_is_no_longer_served_but_its_key_stays_registered_while_retiring():
    registry = LoraRegistry()
    adapter = registry.begin_load("x", "/a")
    registry.finish_load(adapter, "/a", 8)
    assert registry.names() == ["x"]
    registry.unload("x")
    assert registry.names() == [] and registry.key_of("x") is None
    assert registry.registered() == [adapter], "a restarted executor still needs it for its live requests"
    registry.retired(adapter.key)
    assert registry.registered() == []


# ----- the unload rule, through the core ---------------------------------------

def test_an_unloaded_adapter_is_freed_only_after_its_last_request_and_the_plan_naming_it():
    registry, (core, _) = LoraRegistry(), make_core()
    key = load(registry, core, "x")
    req = make_request(prompt=PROMPT, max_tokens=2, adapter=key)
    core.enqueue(req)
    first = send(core)
    assert first.lora_loads == [(0, key)]
    registry.unload("x")
    assert not core.release_adapter(key), "freed while its request runs"
    receive(core)
    send(core)  # the request's last token
    receive(core)
    assert req.status.is_finished
    assert core.release_adapter(key)
    sched = core.scheduler
    assert sched.lora.slot_of == {} and key not in sched.lora.adapters
    assert sched.num_free_blocks == 64, "leaked KV blocks"


def test_an_adapter_whose_last_request_was_aborted_waits_for_the_plan_in_flight():
    registry, (core, _) = LoraRegistry(), make_core()
    key = load(registry, core, "x")
    req = make_request(prompt=PROMPT, max_tokens=8, adapter=key)
    core.enqueue(req)
    send(core)
    registry.unload("x")
    core.abort(req.request_id)
    core.apply_pending()
    assert not core.adapter_users(key)
    assert not core.release_adapter(key), "its slot freed while a plan in flight reads it"
    receive(core)
    assert core.release_adapter(key)


def test_a_pending_request_keeps_an_unloaded_adapter():
    registry, (core, _) = LoraRegistry(), make_core()
    key = load(registry, core, "x")
    core.enqueue(make_request(prompt=PROMPT, max_tokens=1, adapter=key))
    registry.unload("x")
    assert not core.release_adapter(key)


def test_a_reload_under_the_same_name_never_hits_the_old_adapters_cached_blocks():
    registry, (core, _) = LoraRegistry(), make_core()
    old = load(registry, core, "x")
    first = make_request(prompt=PROMPT + [1], max_tokens=1, adapter=old)
    core.enqueue(first)
    send(core)
    receive(core)
    assert first.status.is_finished
    registry.unload("x")
    assert core.release_adapter(old)
    new = load(registry, core, "x")
    second = make_request(prompt=PROMPT + [1], max_tokens=1, adapter=new)
    core.enqueue(second)
    out = send(core)
    assert out.lora_loads == [(0, new)]
    assert second.num_cached_prompt_tokens == 0, "a block cached under the old weights served the new adapter"
    receive(core)
    again = make_request(prompt=PROMPT + [1], max_tokens=1, adapter=new)
    core.enqueue(again)
    send(core)
    assert again.num_cached_prompt_tokens == 16, "the new adapter's own blocks are cached"


def test_failing_an_adapter_ends_its_queued_and_pending_requests_only():
    registry, (core, listener) = LoraRegistry(), make_core()
    key = load(registry, core, "x")
    queued, pending = make_request(adapter=key), make_request(adapter=key)
    other = make_request()
    core.enqueue(queued)
    core.enqueue(other)
    core.apply_pending()
    core.enqueue(pending)
    core.fail_adapter(key, "UNAVAILABLE", "gone")
    assert sorted(listener.failed) == sorted([(queued.request_id, "UNAVAILABLE"), (pending.request_id, "UNAVAILABLE")])
    assert core.adapter_users(key) == [] and other.request_id in core.scheduler.requests


def test_a_request_for_an_adapter_the_slots_do_not_know_is_refused():
    core, _ = make_core()
    with pytest.raises(ValueError, match="not served"):
        core.scheduler.add_request(make_request(adapter="x@gone.1"))

"""vLLM's runtime LoRA routes on the gateway with GATEWAY_ALLOW_RUNTIME_LORA
off (the default): refused by name before any scheduler is asked (none
listens here), and bodies checked as vLLM's."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from gateway_svc.app import create_app
from gateway_svc.config import GatewaySettings


def client(**settings) -> TestClient:
    # Nothing listens at the address: a route that called the scheduler would answer 503.
    return TestClient(create_app(GatewaySettings(scheduler_address="127.0.0.1:9", **settings)))


@pytest.mark.parametrize("route, body", [("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/a"}),
                                         ("/v1/unload_lora_adapter", {"lora_name": "x"})])
def test_runtime_lora_routes_are_off_by_default_and_name_the_setting(route, body):
    with client() as http:
        r = http.post(route, json=body)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert "GATEWAY_ALLOW_RUNTIME_LORA=on" in error["message"] and error["code"] == "runtime_lora_disabled"


def test_a_load_without_lora_path_or_with_an_unknown_field_is_a_400_naming_it():
    with client(allow_runtime_lora=True) as http:
        missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        extra = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a", "load_inplace": True})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path", missing.text
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "load_inplace", extra.text


def test_with_the_setting_on_a_load_reaches_the_scheduler():
    with client(allow_runtime_lora=True) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a"})
    assert r.status_code == 503, f"the route did not call the scheduler: {r.text}"

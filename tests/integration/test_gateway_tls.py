"""The gateway speaks TLS (mutual TLS too) and API keys to a scheduler that
requires them; certificates made in the test."""

from __future__ import annotations

import openai
import pytest

from llmsched.launch import launch
from tests.integration.test_security import creds, pki  # noqa: F401 -- pki is a fixture

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def secured_gateway(pki):  # noqa: F811
    server_cert, server_key = pki["ca-server"]
    client_cert, client_key = pki["ca-client"]
    services = launch(
        executor_env={"EXECUTOR_TLS_CERT": server_cert, "EXECUTOR_TLS_KEY": server_key,
                      "EXECUTOR_TLS_CLIENT_CA": pki["ca"]},
        scheduler_env={
            "SCHEDULER_TLS_CERT": server_cert, "SCHEDULER_TLS_KEY": server_key, "SCHEDULER_TLS_CLIENT_CA": pki["ca"],
            "SCHEDULER_EXECUTOR_TLS_CA": pki["ca"], "SCHEDULER_EXECUTOR_TLS_CERT": client_cert,
            "SCHEDULER_EXECUTOR_TLS_KEY": client_key, "SCHEDULER_API_KEYS": "key-one",
        },
        # Mutual TLS to the scheduler: the CA plus a client certificate.
        gateway_env={"GATEWAY_SCHEDULER_TLS_CA": pki["ca"], "GATEWAY_SCHEDULER_TLS_CERT": client_cert,
                     "GATEWAY_SCHEDULER_TLS_KEY": client_key},
        with_gateway=True,
    )
    services.executor_credentials = creds(pki, client="ca-client")
    services.scheduler_credentials = creds(pki, client="ca-client")
    services.start()
    yield services
    services.stop()


def test_gateway_reaches_a_mutual_tls_scheduler_with_the_forwarded_api_key(secured_gateway):
    client = openai.OpenAI(base_url=secured_gateway.gateway_url + "/v1", api_key="key-one", max_retries=0)
    out = client.completions.create(model="tiny-random", prompt="hi", max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=secured_gateway.gateway_url + "/v1", api_key="key-two", max_retries=0).completions.create(
            model="tiny-random", prompt="hi", max_tokens=4)

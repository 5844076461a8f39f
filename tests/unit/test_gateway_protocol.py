"""The gateway stays torch-free; requests are refused by field name; gRPC
statuses map to OpenAI's HTTP errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from pydantic import ValidationError

from gateway_svc.errors import from_rpc_error
from gateway_svc.openai_format import ChatFormat
from gateway_svc.protocol import ChatCompletionRequest, CompletionRequest, RequestError, param_of

REPO = Path(__file__).resolve().parents[2]


def test_gateway_modules_never_import_torch():
    root = REPO / "gateway_svc"
    modules = sorted("gateway_svc." + ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                     for p in root.rglob("*.py") if p != root / "__init__.py")
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + (
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'llguidance')]\n"
        "assert not bad, f'torch, transformers or llguidance imported: {bad[:5]}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert {"gateway_svc.app", "gateway_svc.__main__", "gateway_svc.tool_parsers.hermes"} <= set(modules)


@pytest.mark.parametrize("extra, param", [
    ({"best_of": 2}, "best_of"),
    ({"logit_bias": {"a": 2}}, "logit_bias"),
    ({"logit_bias": {"-1": 2}}, "logit_bias"),
    ({"suffix": "x"}, "suffix"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"continue_final_message": True}, "continue_final_message"),
])
def test_unimplemented_values_are_refused_by_name(extra, param):
    body = CompletionRequest.model_validate({"prompt": "hi", **extra})
    with pytest.raises(RequestError) as exc:
        body.check_inert_fields()
    assert exc.value.param == param and param in exc.value.message


def test_default_values_a_router_adds_pass():
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "logprobs": False, "continue_final_message": False,
        "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True, "ignore_eos": False,
        "no_stop_trim": False, "return_hidden_states": False, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "tools": None, "tool_choice": "none", "response_format": {"type": "text"}, "user": "someone"})
    body.check_inert_fields()


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
])
def test_sampling_fields_out_of_range_are_refused_by_name(extra, param):
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"prompt": "hi", **extra})
    assert param_of(exc.value.errors()[0]["loc"]) == param


def test_sampling_fields_reach_the_generate_request():
    from gateway_svc.gateway import _sampling

    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5, "frequency_penalty": -1,
        "repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 4, "logit_bias": {"7": 100, "9": -50.5}})
    body.check_inert_fields()
    s = _sampling(body, 16, None, 0)
    assert (s.presence_penalty, s.frequency_penalty, s.min_tokens) == (0.5, -1.0, 4)
    assert s.repetition_penalty == pytest.approx(1.3) and s.min_p == pytest.approx(0.1)
    assert dict(s.logit_bias) == {7: 100.0, 9: -50.5}
    unset = _sampling(CompletionRequest.model_validate({"prompt": "hi"}), 16, None, 0)
    assert not unset.HasField("repetition_penalty") and not unset.logit_bias and unset.min_tokens == 0


def test_message_fields_and_parts():
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "x", "refusal": "no"}]})
    assert body.messages[0].for_template(0)["content"] == "a\nb"
    with pytest.raises(RequestError) as exc:
        body.messages[1].for_template(1)
    assert exc.value.param == "messages[1].refusal"


class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self, code, details, trailers=()):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


@pytest.mark.parametrize("code, details, trailers, status, param, retry_after", [
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop[0]: empty stop string", (("llmsched-field", "sampling.stop[0]"),),
     400, "stop", None),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[3]: token id 9 is outside",
     (("llmsched-field", "prompt_token_ids[3]"),), 400, "prompt", None),
    # No field detail (a request that can never fit): no param, whatever the text says.
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt: looks like a field", (), 400, None, None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded: queue full", (("retry-after-ms", "1200"),), 429, None, 2),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded", (("retry-after-ms", "10"),), 429, None, 1),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "message larger than max", (), 413, "prompt", None),
    (grpc.StatusCode.UNAVAILABLE, "no executor is connected", (), 503, None, None),
    (grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key", (), 401, None, None),
])
def test_grpc_status_maps_to_http(code, details, trailers, status, param, retry_after):
    err = from_rpc_error(FakeRpcError(code, details, trailers))
    assert (err.status, err.param, err.retry_after_s) == (status, param, retry_after)


def test_chat_names_its_own_fields():
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.logprobs: at most 20, got 50",
                                      (("llmsched-field", "sampling.logprobs"),)), ChatFormat.fields)
    assert err.param == "top_logprobs"


@pytest.mark.parametrize("body, param", [
    ({"prompt": [-1, 5]}, "prompt"),
    ({"prompt": [[1, 2], [2**32]]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids"),
])
def test_token_ids_out_of_range_are_refused_before_any_call(body, param):
    with pytest.raises(RequestError) as exc:
        parsed = CompletionRequest.model_validate(body)
        parsed.check_inert_fields()
        parsed.prompts()
    assert exc.value.param == param


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, {"prompt": [1, "a"]}, "prompt"),
    (CompletionRequest, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (CompletionRequest, {"prompt": "x", "priority": 2**40}, "priority"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (ChatCompletionRequest, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (ChatCompletionRequest, {"messages": []}, "messages"),
])
def test_validation_errors_name_the_field_as_the_client_wrote_it(model, body, param):
    with pytest.raises(ValidationError) as exc:
        model.model_validate(body)
    assert param_of(exc.value.errors()[0]["loc"]) == param


def test_failed_precondition_is_a_400_with_the_schedulers_reason():
    why = "model 'm' cannot serve embeddings: its checkpoint has no sentence-transformers pooling config"
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, why))
    assert (err.status, err.type, err.code, err.message) == (400, "invalid_request_error", "model_not_supported", why)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": ["a", [1]]}, "input"),
    ({"input": ["a", ""]}, "input[1]"),
    ({"input": [[1], []]}, "input[1]"),
    ({"input": [[1], ["x"]]}, "input[1]"),
    ({"input": [[1], [2**32]]}, "input[1]"),
    ({"input": [-1]}, "input"),
    ({"input": "a", "normalize": True}, "normalize"),
])
def test_embedding_inputs_are_refused_naming_the_input(body, param):
    from gateway_svc.protocol import EmbeddingRequest

    with pytest.raises(RequestError) as exc:
        parsed = EmbeddingRequest.model_validate(body)
        parsed.check_fields()
        parsed.inputs()
    assert exc.value.param == param and param in exc.value.message


def test_embedding_inputs_each_get_their_own_call_and_name():
    from gateway_svc.protocol import EmbeddingRequest

    assert EmbeddingRequest.model_validate({"input": "a"}).inputs() == [("input", "a")]
    assert EmbeddingRequest.model_validate({"input": [1, 2]}).inputs() == [("input", [1, 2])]
    assert EmbeddingRequest.model_validate({"input": [[1], [2, 3]]}).inputs() == [("input[0]", [1]),
                                                                                  ("input[1]", [2, 3])]


def _entry(token_id, logprob, top=()):
    from llmsched.v1 import scheduler_pb2 as spb

    return spb.TokenLogprobs(token_id=token_id, logprob=logprob, token=f"t{token_id}",
                             top_token_ids=[t for t, _ in top], top_logprobs=[lp for _, lp in top],
                             top_tokens=[f"t{t}" for t, _ in top])


def test_vllm_prompt_logprobs_rank_only_what_is_among_the_top():
    from gateway_svc.openai_format import vllm_prompt_logprobs

    entries = [_entry(1, float("nan")), _entry(7, -0.5, [(7, -0.5), (9, -1.0)]),
               _entry(8, -3.0, [(9, -0.1), (5, -2.0)]), _entry(4, float("-inf"), [(9, -0.2), (5, -1.9)])]
    got = vllm_prompt_logprobs(entries, 2)
    assert got[0] is None
    assert got[1] == {"7": {"logprob": -0.5, "rank": 1, "decoded_token": "t7"},
                      "9": {"logprob": -1.0, "rank": 2, "decoded_token": "t9"}}
    assert list(got[2]) == ["8", "9", "5"] and got[2]["8"]["rank"] is None and got[2]["5"]["rank"] == 2
    assert got[3]["4"]["logprob"] == -9999.0, "-inf is not JSON"
    assert list(vllm_prompt_logprobs(entries, 1)[2]) == ["8", "9"], "k alternatives at most"


def test_echo_with_max_tokens_0_drops_the_one_generated_token():
    from gateway_svc.openai_format import CompletionFormat, Sample, usage
    from llmsched.v1 import scheduler_pb2 as spb

    fmt = CompletionFormat(1, echo=["Once"], prompt_only=True)
    sample = Sample(0, 0, call=None)
    fmt.start(sample)
    resp = spb.GenerateResponse(token_ids=[2], text="", finish_reason=spb.FINISH_REASON_STOP,
                                logprobs=[_entry(2, -0.1, [(2, -0.1)])],
                                prompt_logprobs=[_entry(1, float("nan")), _entry(7, -0.5, [(7, -0.5)])],
                                usage=spb.Usage(prompt_tokens=2, completion_tokens=1))
    sample.add(resp)
    [chunk] = fmt.delta_choices(sample, resp)
    choice = fmt.choice(sample)
    for c in (chunk, choice):
        assert c["text"] == "Once" and c["finish_reason"] == "length", "EOS ended the dropped token, not the client's"
        assert c["logprobs"]["tokens"] == ["t1", "t7"] and c["logprobs"]["token_logprobs"] == [None, -0.5]
    assert usage([sample])["completion_tokens"] == 0 and usage([sample])["prompt_tokens"] == 2


def test_model_may_name_a_lora_adapter_and_an_unknown_one_is_a_404():
    from gateway_svc.gateway import _check_model

    assert _check_model("base", ["base"], ("a8",)) == ""
    assert _check_model(None, ["base"], ("a8",)) == ""
    assert _check_model("a8", ["base"], ("a8",)) == "a8"
    with pytest.raises(RequestError) as exc:
        _check_model("b16", ["base"], ("a8",))
    assert exc.value.status == 404 and exc.value.code == "model_not_found" and "'a8'" in str(exc.value)
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, "adapter 'x' is not served"))
    assert err.status == 404 and err.code == "model_not_found"

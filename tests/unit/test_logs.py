"""Logging set-up shared by the three services (llmsched/logs.py): the JSON
and text formats, the request-log line, the settings that choose them, and
the launcher's start timeout."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from gateway_svc.config import GatewaySettings
from llmsched import launch, logs
from llmsched.errors import StartupError, load_settings
from scheduler_svc.config import SchedulerSettings


def _record(msg="hello %s", args=("world",), exc_info=None, fields=None) -> logging.LogRecord:
    record = logging.LogRecord("scheduler_svc.engine", logging.WARNING, __file__, 1, msg, args, exc_info)
    if fields is not None:
        record.fields = fields
    return record


def test_a_json_line_is_one_object_with_the_traceback_inside():
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        line = logs.JsonFormatter("scheduler").format(_record(exc_info=sys.exc_info()))
    assert "\n" not in line
    obj = json.loads(line)
    assert (obj["level"], obj["service"], obj["logger"], obj["msg"]) == (
        "WARNING", "scheduler", "scheduler_svc.engine", "hello world")
    assert obj["ts"].endswith("Z") and "ValueError: boom" in obj["exc"]


def test_request_fields_are_top_level_keys_in_json_and_key_value_pairs_in_text():
    fields = {"request_id": "r1", "status": 400, "tenant": None, "reason": 'bad "x" = y'}
    obj = json.loads(logs.JsonFormatter("gateway").format(_record("request", (), fields=fields)))
    assert obj["msg"] == "request" and {k: obj[k] for k in fields} == fields
    text = logs.TextFormatter().format(_record("request", (), fields=fields))
    assert text.endswith('request request_id=r1 status=400 tenant=- reason="bad \\"x\\" = y"')


def test_log_format_falls_back_to_the_shared_variable_and_the_service_s_own_wins(monkeypatch):
    monkeypatch.setenv("LOG_FORMAT", "json")
    assert SchedulerSettings().log_format == GatewaySettings().log_format == "json"
    assert logs.format_from_env("SCHEDULER") == "json"
    monkeypatch.setenv("GATEWAY_LOG_FORMAT", "text")
    assert GatewaySettings().log_format == "text" and logs.format_from_env("GATEWAY") == "text"


def test_log_level_takes_any_case_and_a_wrong_one_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("SCHEDULER_LOG_LEVEL", "debug")
    assert SchedulerSettings().log_level == "DEBUG"
    monkeypatch.setenv("SCHEDULER_LOG_LEVEL", "verbose")
    with pytest.raises(StartupError, match="SCHEDULER_LOG_LEVEL='VERBOSE': Input should be 'DEBUG', 'INFO'"):
        load_settings(SchedulerSettings)
    monkeypatch.delenv("SCHEDULER_LOG_LEVEL")
    monkeypatch.setenv("LOG_FORMAT", "xml")
    with pytest.raises(StartupError, match="^LOG_FORMAT='xml': Input should be 'text' or 'json'"):
        load_settings(SchedulerSettings)
    monkeypatch.setenv("SCHEDULER_LOG_FORMAT", "yaml")
    with pytest.raises(StartupError, match="^SCHEDULER_LOG_FORMAT='yaml'"):
        load_settings(SchedulerSettings)


def test_a_settings_error_is_a_json_line_when_json_logs_are_asked_for():
    env = {"PATH": "/usr/bin:/bin", "LOG_FORMAT": "json", "GATEWAY_PORT": "not-a-port"}
    proc = subprocess.run([sys.executable, "-m", "gateway_svc"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    obj = json.loads(line)
    assert obj["level"] == "CRITICAL" and obj["msg"].startswith("cannot start: GATEWAY_PORT='not-a-port'")


def test_served_model_names_are_comma_separated(monkeypatch):
    monkeypatch.setenv("GATEWAY_SERVED_MODEL_NAME", " meta-llama/Llama-3.1-8B-Instruct, llama-8b ,")
    assert GatewaySettings().served_model_names == ["meta-llama/Llama-3.1-8B-Instruct", "llama-8b"]
    monkeypatch.delenv("GATEWAY_SERVED_MODEL_NAME")
    assert GatewaySettings().served_model_names == []  # the scheduler's name, the checkpoint directory's


@pytest.mark.parametrize("raw", ["abc", "0", "-5"])
def test_a_start_timeout_that_is_not_a_positive_number_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv("LLMSCHED_START_TIMEOUT_S", raw)
    with pytest.raises(SystemExit, match="LLMSCHED_START_TIMEOUT_S"):
        launch.start_timeout_from_env()


def test_a_longer_start_timeout_is_waited_for_and_given_to_the_scheduler(monkeypatch):
    monkeypatch.setenv("LLMSCHED_START_TIMEOUT_S", "900")
    monkeypatch.delenv("SCHEDULER_EXECUTOR_CONNECT_TIMEOUT_S", raising=False)
    waited = []
    monkeypatch.setattr(launch, "wait_serving", lambda address, timeout_s, *a: waited.append(timeout_s))
    monkeypatch.setattr(launch.Services, "start_executor", lambda self, wait: None)
    monkeypatch.setattr(launch.Services, "start_scheduler", lambda self, wait: None)
    services = launch.Services(1, 2, start_timeout_s=launch.start_timeout_from_env()).start()
    assert waited == [900.0, 900.0]
    assert services.scheduler_env["SCHEDULER_EXECUTOR_CONNECT_TIMEOUT_S"] == "900.0"


def test_launch_takes_the_start_timeout_from_the_environment_as_main_does(monkeypatch):
    """The benchmarks start services through launch(); a first compile of a
    large model's decode step outlasts the default wait."""
    monkeypatch.setenv("LLMSCHED_START_TIMEOUT_S", "900")
    assert launch.launch().start_timeout_s == 900.0
    monkeypatch.delenv("LLMSCHED_START_TIMEOUT_S")
    assert launch.launch().start_timeout_s == launch.DEFAULT_START_TIMEOUT_S


def test_the_launcher_s_own_lines_are_json_too_under_log_format_json(monkeypatch, capsys):
    monkeypatch.setenv("LOG_FORMAT", "json")
    launch._say("serving llmsched.v1.Scheduler on 127.0.0.1:50051")
    launch._say("launch: the executor exited with code 1", error=True)
    out, err = capsys.readouterr()
    assert json.loads(out)["msg"].startswith("serving") and json.loads(err)["level"] == "ERROR"
    monkeypatch.delenv("LOG_FORMAT")
    launch._say("serving")
    assert capsys.readouterr().out == "serving\n"

"""The reference parts of the docs are generated from the code and cannot
drift: docs/configuration.md from the settings classes, docs/grpc-api.md
from scheduler.proto's comments (devtools/docgen.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from devtools import docgen
from llmsched.v1 import scheduler_pb2

REPO = Path(__file__).resolve().parents[2]
CLASSES = [docgen.settings_class(module, name) for _, module, name in docgen.SETTINGS_CLASSES]


def test_committed_pages_equal_what_the_code_renders():
    stale = docgen.stale_pages()
    assert not stale, (f"{', '.join(str(p.relative_to(REPO)) for p in stale)} differ from what the code renders: "
                       f"run `{docgen.REGENERATE}` and commit the result")


def test_every_page_region_has_a_renderer_and_every_renderer_a_region():
    regions = [name for page in docgen.PAGES for name in docgen.region_names(page.read_text())]
    assert sorted(regions) == sorted(docgen.regions()), regions


def test_every_setting_has_a_description():
    missing = docgen.missing_descriptions(CLASSES)
    assert not missing, f"settings without Field(description=...): {missing}"


def test_the_configuration_page_lists_every_setting_of_the_three_classes():
    page = docgen.CONFIG_PAGE.read_text()
    names = [docgen.env_name(cls, field) for cls in CLASSES for field in cls.model_fields]
    assert len(names) > 50
    prefixes = {name.split("_")[0] for name in names}
    assert prefixes == {"SCHEDULER", "EXECUTOR", "GATEWAY"}
    missing = [name for name in names if f"| `{name}` |" not in page]
    assert not missing, f"settings missing from docs/configuration.md: {missing}"


def test_a_new_setting_makes_the_configuration_page_stale():
    """What happens when someone adds a setting and does not run docgen."""
    scheduler = docgen.settings_class("scheduler_svc.config", "SchedulerSettings")

    class WithANewSetting(scheduler):
        model_config = SettingsConfigDict(env_prefix="SCHEDULER_", extra="ignore")
        brand_new_knob: int = Field(default=3, ge=0, description="A setting added without regenerating the page.")

    renderers = docgen.regions()
    renderers["scheduler-settings"] = lambda: docgen.settings_table(WithANewSetting)
    assert docgen.stale_pages(renderers) == [docgen.CONFIG_PAGE]
    assert "| `SCHEDULER_BRAND_NEW_KNOB` | int (≥ 0) | `3` |" in docgen.render(docgen.CONFIG_PAGE.read_text(),
                                                                           renderers)


def test_the_check_command_fails_on_a_stale_page_and_names_the_fix(tmp_path, monkeypatch):
    page = tmp_path / "configuration.md"
    page.write_text(docgen.CONFIG_PAGE.read_text().replace("`SCHEDULER_PORT`", "`SCHEDULER_PORTS`"))
    monkeypatch.setattr(docgen, "PAGES", (page,))
    monkeypatch.setattr(docgen, "REPO_ROOT", tmp_path)
    assert docgen.main(["--check"]) == 1
    assert "SCHEDULER_PORTS" in page.read_text(), "--check must not write"
    assert docgen.main([]) == 0 and docgen.main(["--check"]) == 0
    assert page.read_text() == docgen.CONFIG_PAGE.read_text()


def test_an_unknown_region_name_is_an_error():
    with pytest.raises(KeyError, match="no renderer for generated region 'nope'"):
        docgen.render("<!-- generated: nope -->\n<!-- end generated: nope -->", docgen.regions())


def test_the_api_reference_covers_every_method_message_field_and_enum_value():
    page = docgen.API_PAGE.read_text()
    file = scheduler_pb2.DESCRIPTOR
    for service in file.services_by_name.values():
        assert f"### {service.name}" in page
        for method in service.methods:
            assert f"| `{method.name}` |" in page, method.full_name
    for message in file.message_types_by_name.values():
        assert f"### {message.name}" in page, message.full_name
        for field in message.fields:
            assert f"| `{field.name}` | {field.number} |" in page, field.full_name
    for enum in file.enum_types_by_name.values():
        assert f"### {enum.name}" in page, enum.full_name
        for value in enum.values:
            assert f"| `{value.name}` | {value.number} |" in page, value.name


def test_the_api_reference_carries_the_proto_comments():
    page = docgen.API_PAGE.read_text()
    assert "Keep only the k most likely tokens; 0 means off." in page  # SamplingParams.top_k
    assert "Cancels a live request by id." in page  # Scheduler.Abort


def test_settings_modules_and_docgen_never_import_torch():
    code = ("import sys, scheduler_svc.config, executor_svc.config, gateway_svc.config, devtools.docgen\n"
            "devtools.docgen.regions()['executor-settings']()\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
            "assert not bad, f'torch imported: {bad[:5]}'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_changed_roofline_estimate_makes_the_capacity_page_stale():
    from simulator import roofline

    profiles = roofline.all_profiles()
    name = "llama-3.1-8b_h100_tp1"
    renderers = docgen.regions()
    renderers["roofline-profiles"] = lambda: roofline.profiles_table({**profiles, name: None})
    assert docgen.stale_pages(renderers) == [docgen.CAPACITY_PAGE]
    assert f"| `roofline/{name}` | does not fit" in docgen.render(docgen.CAPACITY_PAGE.read_text(), renderers)

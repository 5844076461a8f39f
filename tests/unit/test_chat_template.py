"""Chat templates render exactly as transformers' apply_chat_template does,
down to the token ids; the executor finds the template and BOS/EOS strings
in every shape checkpoints ship them."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer

from executor_svc.chat_template import CHATML_TEMPLATE, load_chat_template, read_chat_template
from gateway_svc import chat_template
from tests.chat_templates import ALL

CONVERSATIONS = [
    [{"role": "user", "content": "Once upon a time"}],
    [{"role": "system", "content": "Tell \"short\" <stories>."},
     {"role": "user", "content": "  A dog and a cat  ", "name": "Tim"},
     {"role": "assistant", "content": "They played."},
     {"role": "user", "content": "Then?"}],
]


@pytest.fixture(scope="module")
def hf_dir(stories_path, tmp_path_factory):
    """stories260K's tokenizer with a tokenizer_config.json per template."""
    dirs = {}
    for name, template in ALL.items():
        d = tmp_path_factory.mktemp(name)
        shutil.copy(stories_path / "tokenizer.json", d / "tokenizer.json")
        config = json.loads((stories_path / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        dirs[name] = d
    return dirs


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_and_token_ids_equal_transformers(hf_dir, name, conv, add_generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_dir[name])
    messages = CONVERSATIONS[conv]
    found = read_chat_template(hf_dir[name])
    ours = chat_template.render(found.template, messages, bos_token=found.bos_token, eos_token=found.eos_token,
                                add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs, f"{name}: rendered text differs from transformers"
    # What the scheduler does with add_special_tokens=false.
    ids = Tokenizer.from_file(str(hf_dir[name] / "tokenizer.json")).encode(ours, add_special_tokens=False).ids
    hf_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    hf_ids = hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids
    assert ids == hf_ids, f"{name}: prompt token ids differ from apply_chat_template(tokenize=True)"
    if name == "llama3":
        assert ids.count(1) == 1, "exactly one BOS: the template's, none added by the tokenizer"


def test_raise_exception_in_a_template_is_a_template_error():
    with pytest.raises(chat_template.TemplateError, match="unknown role tool"):
        chat_template.render(ALL["features"], [{"role": "tool", "content": "x"}], bos_token="<s>", eos_token="</s>")


def test_sandbox_refuses_reaching_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(chat_template.TemplateError):
        chat_template.render(evil, [{"role": "user", "content": "x"}], bos_token="", eos_token="")
    with pytest.raises(chat_template.TemplateError):
        chat_template.render("{% set ns = namespace(_x=1) %}", [], bos_token="", eos_token="")


def test_builtin_models_get_chatml():
    found = load_chat_template("tiny-random")
    assert found.template == CHATML_TEMPLATE and (found.bos_token, found.eos_token) == ("<s>", "</s>")
    text = chat_template.render(found.template, [{"role": "user", "content": "hi"}], bos_token="<s>", eos_token="</s>")
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_sources_and_token_shapes(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
        "bos_token": {"content": "<|begin|>", "lstrip": False, "__type": "AddedToken"},
        "eos_token": "<|end|>",
    }))
    assert read_chat_template(tmp_path) == type(read_chat_template(tmp_path))("D", "<|begin|>", "<|end|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None}))
    (tmp_path / "chat_template.jinja").write_text("J")
    found = read_chat_template(tmp_path)
    assert (found.template, found.bos_token, found.eos_token) == ("J", "", "")


def test_a_checkpoint_without_tokenizer_config_has_no_template(tmp_path):
    found = read_chat_template(tmp_path)
    assert (found.template, found.bos_token, found.eos_token) == ("", "", "")

"""Chat templates render as transformers' apply_chat_template renders them, in a sandbox."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvmux.daemon.engine import BadPrompt, Engine, EngineOptions
from kvmux.daemon.model import (
    ChatTemplateError,
    ModelFormatError,
    load_chat_template,
    load_model,
)
from kvmux.daemon.model.chat import find_chat_template, special_token_strings

# Chat templates as real models ship them in tokenizer_config.json.
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ZEPHYR = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
    "{% endfor %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
TEMPLATES = {"qwen2": QWEN2, "zephyr": ZEPHYR, "llama3": LLAMA3, "mistral": MISTRAL}
# What each template takes from the tokenizer config, and how it opens the reply.
SPECIAL_USED = {"qwen2": "You are terse", "zephyr": "</s>", "llama3": "<s>", "mistral": "<s>"}
GENERATION_PROMPT: dict[str, str | None] = {
    "qwen2": "<|im_start|>assistant\n",
    "zephyr": "<|assistant|>\n",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": None,  # its prompt ends with [/INST] either way
}

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  Name a colour.  "},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": 'And a "fruit" <b>?</b> — é'},
]
ALTERNATING = [m for m in CHAT if m["role"] != "system"]


def model_folder(tmp_path: Path, tiny_model: Path, template: str | list[Any] | None) -> Path:
    """The tiny model, ``template`` in its tokenizer_config.json, bos as an AddedToken dict."""
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny_model.iterdir():
        if f.name != "chat_template.jinja":
            (folder / f.name).symlink_to(f)
    config: dict[str, Any] = {
        "bos_token": {"content": "<s>", "special": True, "__type": "AddedToken"},
        "eos_token": "</s>",
        "pad_token": "<pad>",
    }
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def hf_tokenizer(folder: Path) -> Any:
    transformers = pytest.importorskip(
        "transformers", reason="needs the [genai] extra: transformers is not importable"
    )
    # transformers reads the same tokenizer_config.json: template, bos/eos and all.
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))


def hf_ids(out: Any) -> list[int]:
    ids = out["input_ids"] if not isinstance(out, list) else out
    return [int(i) for i in ids]


@pytest.mark.genai
@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_renders_and_tokenizes_as_transformers(
    tmp_path: Path, tiny_model: Path, name: str, generation_prompt: bool
) -> None:
    folder = model_folder(tmp_path, tiny_model, TEMPLATES[name])
    ours = load_chat_template(folder)
    assert ours is not None
    tok = hf_tokenizer(folder)
    chat = ALTERNATING if name == "mistral" else CHAT
    theirs = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
    rendered = ours.render(chat, add_generation_prompt=generation_prompt)
    assert rendered == theirs
    assert SPECIAL_USED[name] in rendered
    opener = GENERATION_PROMPT[name]
    if opener is not None:
        assert rendered.endswith(opener) == generation_prompt
    # Tokenized without adding special tokens again, as transformers does for a chat.
    engine = Engine(folder, EngineOptions(intra_op_threads=1))
    expected = hf_ids(
        tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=generation_prompt)
    )
    assert engine.encode(rendered) == expected
    if generation_prompt:
        assert engine.render_chat(chat) == rendered


@pytest.mark.genai
def test_raise_exception_carries_the_templates_message(tmp_path: Path, tiny_model: Path) -> None:
    folder = model_folder(tmp_path, tiny_model, MISTRAL)
    ours = load_chat_template(folder)
    assert ours is not None
    tok = hf_tokenizer(folder)
    with pytest.raises(Exception, match="roles must alternate") as theirs:
        tok.apply_chat_template(CHAT, tokenize=False)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ours.render(CHAT)
    assert "alternate" in str(theirs.value)


def test_bos_and_eos_strings_come_from_tokenizer_config() -> None:
    assert special_token_strings(
        {
            "bos_token": {"content": "<|begin|>", "lstrip": False},
            "eos_token": "<|end|>",
            "unk_token": None,
            "chat_template": "x",
        }
    ) == {"bos_token": "<|begin|>", "eos_token": "<|end|>"}


def test_template_sources_in_order(tmp_path: Path, tiny_model: Path) -> None:
    listed = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT {{ messages[0]['content'] }}"},
    ]
    folder = model_folder(tmp_path, tiny_model, listed)
    found = find_chat_template(folder)
    assert found is not None and found.text.startswith("DEFAULT")
    ours = load_chat_template(folder)
    assert ours is not None and ours.render([{"role": "user", "content": "x"}]) == "DEFAULT x"
    # chat_template.jinja beside the tokenizer wins over tokenizer_config.json ...
    (folder / "chat_template.jinja").write_text("BESIDE", encoding="utf-8")
    found = find_chat_template(folder)
    assert found is not None and found.text == "BESIDE"
    # ... and the configured file over both.
    configured = tmp_path / "mine.jinja"
    configured.write_text("MINE {{ eos_token }}", encoding="utf-8")
    ours = load_chat_template(folder, configured)
    assert ours is not None and ours.render([{"role": "user", "content": "x"}]) == "MINE </s>"
    with pytest.raises(ModelFormatError, match=r"model\.chat_template"):
        load_chat_template(folder, tmp_path / "missing.jinja")


def test_a_template_that_does_not_compile_is_refused_at_load(
    tmp_path: Path, tiny_model: Path
) -> None:
    folder = model_folder(tmp_path, tiny_model, "{% for m in messages %}")
    with pytest.raises(ModelFormatError, match="does not compile"):
        load_chat_template(folder)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{% set ns = namespace(_x=1) %}{{ ns._x }}",
        "{{ cycler.__init__.__globals__.os }}",
    ],
)
def test_the_sandbox_refuses_internals(tmp_path: Path, tiny_model: Path, template: str) -> None:
    folder = model_folder(tmp_path, tiny_model, template)
    ours = load_chat_template(folder)
    assert ours is not None
    with pytest.raises(ChatTemplateError, match=r"unsafe|underscore"):
        ours.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
        ("{{ messages[5]['content'] }}", "no element 5"),
    ],
)
def test_a_template_that_fails_on_its_input_is_a_chat_error(
    tmp_path: Path, tiny_model: Path, template: str, needle: str
) -> None:
    ours = load_chat_template(model_folder(tmp_path, tiny_model, template))
    assert ours is not None
    with pytest.raises(ChatTemplateError, match=needle):
        ours.render([{"role": "user", "content": "x"}])


def test_internals_a_template_cannot_reach_render_as_nothing(
    tmp_path: Path, tiny_model: Path
) -> None:
    # One unsafe step is Jinja's Undefined (empty), as under transformers: nothing leaks.
    template = "[{{ messages[0]['content'].format.__self__.__class__ }}]"
    ours = load_chat_template(model_folder(tmp_path, tiny_model, template))
    assert ours is not None
    assert ours.render([{"role": "user", "content": "x"}]) == "[]"


def test_message_content_is_data(tmp_path: Path, tiny_model: Path) -> None:
    ours = load_chat_template(model_folder(tmp_path, tiny_model, "{{ messages[0]['content'] }}"))
    assert ours is not None
    content = "{{ ''.__class__.__mro__ }}{% raise %}"
    assert ours.render([{"role": "user", "content": content}]) == content


def test_the_builtin_template(tiny_model: Path) -> None:
    engine = Engine(tiny_model, EngineOptions(intra_op_threads=1))
    rendered = engine.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert rendered == "<s><|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert engine.encode(rendered)[0] == engine.spec.bos_token_id
    with pytest.raises(BadPrompt, match="unknown role robot"):
        engine.render_chat([{"role": "robot", "content": "x"}])


def test_a_model_without_a_template_names_the_fix(tmp_path: Path, tiny_model: Path) -> None:
    engine = Engine(model_folder(tmp_path, tiny_model, None), EngineOptions(intra_op_threads=1))
    assert engine.chat_template is None
    with pytest.raises(BadPrompt, match=re.escape('model.chat_template = "FILE"')):
        engine.render_chat([{"role": "user", "content": "x"}])


def test_model_info_names_the_template(tmp_path: Path, tiny_model: Path) -> None:
    assert "chat template:     " + str(tiny_model / "chat_template.jinja") in (
        load_model(tiny_model).describe()
    )
    bare = load_model(model_folder(tmp_path, tiny_model, None))
    assert bare.chat_template is None and "model.chat_template" in bare.describe()

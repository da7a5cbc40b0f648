"""Chat templates render exactly like transformers' apply_chat_template: the real Qwen3 and SmolLM2
templates over several conversations, and the jinja2 features templates rely on."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest

from kafila.engine.chat_template import ChatTemplateError, render
from kafila.engine.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "one-user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [SYSTEM, {"role": "user", "content": "Name a prime."}],
    "multi-turn": [
        SYSTEM,
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"},
    ],
    "unicode": [
        {"role": "user", "content": "Übersetze: «東京は大きい» 🚀 — ok? ﷽ 𝔘𝔫𝔦"},
        {"role": "assistant", "content": "Tokyo ist groß. 👍🏽"},
        {"role": "user", "content": "Merci !\n\n\ttab\u00a0nbsp"},
    ],
    "thinking-history": [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>\nsimple\n</think>\n\n2"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add again"},
    ],
    "tool-calls": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": '{"temp_c": 21}'},
    ],
    "none-content": [{"role": "user", "content": "hi", "name": None}],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Current weather in a city (°C)",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _reference(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder)


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir: Path) -> tuple[Tokenizer, Any]:
    return Tokenizer.from_folder(qwen3_tokenizer_dir), _reference(qwen3_tokenizer_dir)


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> tuple[Tokenizer, Any]:
    return Tokenizer.from_folder(smollm2_path), _reference(smollm2_path)


def _assert_same(ours: Tokenizer, ref: Any, messages: list[dict[str, Any]], **kw: Any) -> str:
    for add in (True, False):
        want = ref.apply_chat_template(messages, add_generation_prompt=add, tokenize=False, **kw)
        got = ours.render_chat(messages, add, **kw)
        assert got == want
        want_ids = ref.apply_chat_template(
            messages, add_generation_prompt=add, tokenize=True, return_dict=False, **kw
        )
        assert ours.encode_chat(messages, add, **kw) == list(want_ids)
    return got


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, True, False])
def test_qwen3_renders_and_encodes_like_transformers(
    qwen3: tuple[Tokenizer, Any], name: str, thinking: bool | None
) -> None:
    kw = {} if thinking is None else {"enable_thinking": thinking}
    text = _assert_same(*qwen3, CONVERSATIONS[name], **kw)
    assert text.startswith("<|im_start|>")


def test_qwen3_with_tools_like_transformers(qwen3: tuple[Tokenizer, Any]) -> None:
    ours, ref = qwen3
    for messages in (CONVERSATIONS["tool-calls"], CONVERSATIONS["system"]):
        want = ref.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        got = ours.render_chat(messages, True, tools=TOOLS)
        assert got == want
        assert "°C" in got  # tojson keeps non-ASCII, as transformers' override does


def test_qwen3_enable_thinking_false_closes_the_think_block(qwen3: tuple[Tokenizer, Any]) -> None:
    text = qwen3[0].render_chat(CONVERSATIONS["one-user"], True, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("name", ["one-user", "system", "multi-turn", "unicode"])
def test_smollm2_renders_and_encodes_like_transformers(smollm2: tuple[Tokenizer, Any], name: str) -> None:
    _assert_same(*smollm2, CONVERSATIONS[name])


def test_smollm2_renders_chatml(smollm2: tuple[Tokenizer, Any]) -> None:
    text = smollm2[0].render_chat(CONVERSATIONS["one-user"], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# --- jinja2 semantics against transformers' own renderer on small templates ---------------------

TEMPLATES = {
    "trim-lstrip": "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n"
    "    {% endif %}\n{% endfor %}",
    "loopcontrols": "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}"
    "{{ m.content }}{% if loop.index0 == 2 %}{% break %}{% endif %}{% endfor %}",
    "tojson": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}"
    "|{{ tools | tojson }}",
    "specials": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}{{ custom | default('-') }}",
    "namespace-dict": "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    "{{ ns.n }}{{ dict(a=1) | tojson }}{{ messages[-1].get('reasoning_content', 'none') }}",
    "generation-tag": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "reasoning-alias": "{% for m in messages %}{{ m.thinking | default('') }}/"
    "{{ m.reasoning_content | default('') }};"
    "{% endfor %}",
}
MESSAGES = [
    {"role": "user", "content": 'a <b> & "c" é'},
    {"role": "assistant", "content": "x", "reasoning": "because"},
    {"role": "user", "content": "z"},
    {"role": "assistant", "content": "w"},
]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_semantics_match_transformers_renderer(name: str) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    for add in (True, False):
        for kw in ({}, {"custom": "K", "bos_token": "<s>", "eos_token": "</s>"}):
            want = render_jinja_template(
                conversations=[MESSAGES],
                tools=TOOLS,
                chat_template=TEMPLATES[name],
                add_generation_prompt=add,
                **kw,
            )[0][0]
            extra = {k: v for k, v in kw.items() if k not in ("bos_token", "eos_token")}
            got = render(
                TEMPLATES[name],
                MESSAGES,
                add,
                bos_token=kw.get("bos_token"),
                eos_token=kw.get("eos_token"),
                tools=TOOLS,
                **extra,
            )
            assert got == want


def test_raise_exception_is_a_clear_error() -> None:
    template = (
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        render(template, [{"role": "assistant", "content": "hi"}])


def test_sandbox_refuses_python_internals() -> None:
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        render("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", [{"role": "user"}])
    with pytest.raises(ChatTemplateError, match="_x"):
        render("{% set ns = namespace() %}{% set ns._x = 1 %}", [{"role": "user"}])
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        render("{{ messages.append(1) }}", [{"role": "user"}])  # immutable sandbox


def test_strftime_now_and_bad_input() -> None:
    year = str(datetime.datetime.now().year)
    assert render("{{ strftime_now('%Y') }}", [{"role": "user", "content": ""}]) == year
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        render("x", [])
    with pytest.raises(ChatTemplateError, match="message 1 is a str"):
        render("x", [{"role": "user"}, "hello"])  # type: ignore[list-item]
    with pytest.raises(ChatTemplateError, match="does not parse: line 1"):
        render("{% for m in messages %}", [{"role": "user"}])

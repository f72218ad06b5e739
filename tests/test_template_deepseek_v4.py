"""models/templates/deepseek_v4.jinja renders, through core.tokenizer, exactly what DeepSeek V4's
own encoder (encoding/encoding_dsv4.py of the release) renders: the expected texts and the
encoder call that made each are in tests/templates/deepseek_v4_expected.json (written by
tests/templates/make_deepseek_v4_expected.py; sources in tests/templates/README.md)."""
from __future__ import annotations

import copy
import json
import os

import pytest

pytest.importorskip("tokenizers")

from core.tokenizer import ChatTokenizer  # noqa: E402
from tests.test_tokenizer import _write_dir  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")
TEMPLATE = os.path.join(ROOT, "models", "templates", "deepseek_v4.jinja")
with open(os.path.join(ROOT, "tests", "templates", "deepseek_v4_expected.json"), encoding="utf-8") as f:
    CASES = {case["name"]: case for case in json.load(f)["cases"]}
PLAIN = CASES["plain"]["messages"]
TOOL_CHAT = CASES["tools_chat"]["messages"]


@pytest.fixture(scope="module")
def template_dir(tmp_path_factory):
    with open(TEMPLATE, encoding="utf-8") as f:
        return _write_dir(tmp_path_factory.mktemp("dsv4"), f.read())


@pytest.fixture(scope="module")
def tok(template_dir):
    return ChatTokenizer.from_dir(template_dir)


@pytest.mark.parametrize("name", sorted(CASES))
def test_renders_as_the_release_encoder(tok, name):
    case = CASES[name]
    assert tok.apply_chat_template(copy.deepcopy(case["messages"]), **case["variables"]) == case["expected"]


@pytest.fixture(scope="module")
def hf(template_dir):
    return pytest.importorskip("transformers").AutoTokenizer.from_pretrained(template_dir)


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_renders_the_same(hf, name):
    case = CASES[name]
    got = hf.apply_chat_template(copy.deepcopy(case["messages"]), tokenize=False, **case["variables"])
    assert got == case["expected"]


def test_reads_tools_and_opens_think(tok):
    """What the server relies on: the template reads `tools` (else tools are refused) and a
    thinking prompt ends inside an open think block."""
    assert tok.template_uses("tools")
    assert tok.apply_chat_template(PLAIN, thinking=True).endswith("<｜Assistant｜><think>")
    assert tok.apply_chat_template(PLAIN).endswith("<｜Assistant｜></think>")


@pytest.mark.parametrize("messages, variables, why", [
    (PLAIN, {"thinking": True, "reasoning_effort": "low"}, "reasoning_effort"),
    ([{"role": "developer", "content": "x"}], {}, "unsupported role"),
    ([PLAIN[1], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "meteo", "arguments": "{\"città\": \"Roma\"}"}}]}],
     {}, "arguments must be an object"),
])
def test_refuses_what_it_cannot_render(tok, messages, variables, why):
    with pytest.raises(ValueError, match=why):
        tok.apply_chat_template(copy.deepcopy(messages), **variables)


def test_tool_calls_accept_calls_without_function_wrapper(tok):
    wrapped = TOOL_CHAT[:3]
    bare = copy.deepcopy(wrapped)
    bare[2]["tool_calls"] = [call["function"] for call in bare[2]["tool_calls"]]
    assert tok.apply_chat_template(bare) == tok.apply_chat_template(copy.deepcopy(wrapped))


def _hub_with_tokenizer(tmp_path, keep_template: bool):
    import shutil

    from tests.conftest import COMMITTED, tokenizer_files
    src = tmp_path / "hub"
    shutil.copytree(COMMITTED / "dsv4-a" / "hub", src)
    tokenizer_files(src)
    if not keep_template:        # the release: a tokenizer, no Jinja template (a Python encoder)
        cfg = json.loads((src / "tokenizer_config.json").read_text())
        del cfg["chat_template"]
        (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize("keep_template", [False, True])
def test_convert_gives_a_release_without_a_template_ours(tmp_path, keep_template):
    from colibri_tui.cli import main as coli
    out = tmp_path / "out"
    assert coli(["convert", str(_hub_with_tokenizer(tmp_path, keep_template)), str(out)]) == 0
    text = ChatTokenizer.from_dir(str(out)).apply_chat_template([{"role": "user", "content": "Ciao"}],
                                                               add_generation_prompt=True)
    if keep_template:            # the release's own template wins
        assert not (out / "chat_template.jinja").exists() and "<|im_start|>user" in text
    else:
        with open(TEMPLATE, encoding="utf-8") as f:
            assert (out / "chat_template.jinja").read_text(encoding="utf-8") == f.read()
        assert text.endswith("<｜User｜>Ciao<｜Assistant｜></think>")

"""core.tokenizer against real (locally trained) byte-level BPE tokenizers and transformers' rendering."""
from __future__ import annotations

import json
import os

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from core.tokenizer import ChatTokenizer, StreamDecoder  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]

CORPUS = [
    "Hello world, this is a small corpus for a byte-level BPE tokenizer.",
    "You are a helpful assistant. How can I help you today?",
    "Ciao! Perché la città è così bella? Però non è più caro del caffè.",
    "Questo è un test: àèéìòù ÀÈÉÌÒÙ, l'università più antica.",
    "我喜欢学习中文。你好，世界！今天天气很好。",
    "The weather is nice 🌞🌈 and the pizza 🍕 is great 👍🏽.",
    "def f(x):\n    return x * 2  # code too\n",
]

QWEN_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first)"
    " or (message.role == \"assistant\") %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Uses bos_token/eos_token variables, non-dash block tags (trim_blocks / lstrip_blocks matter),
# loop controls and a namespace.
BOS_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% continue %}
    {% endif %}
    {% set ns.n = ns.n + 1 %}
    <|im_start|>{{ message['role'] }} {{ ns.n }}
{{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

RAISE_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "Ciao, come stai?"}],
    [
        {"role": "system", "content": "Sei un assistente utile. 你好！"},
        {"role": "user", "content": "Perché il cielo è blu? 🌈"},
    ],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help you today? 👍🏽"},
        {"role": "user", "content": "  我喜欢学习中文  "},
    ],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "def f(x):\n    return x"},
        {"role": "assistant", "content": "ok", "tool_calls": None},
        {"role": "system", "content": "late system message"},
        {"role": "user", "content": "ancora"},
    ],
]


def _train_tokenizer(post_bos: bool = False) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if post_bos:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _write_dir(path, template=None, post_bos=False, extra_config=None) -> str:
    path = str(path)
    os.makedirs(path, exist_ok=True)
    _train_tokenizer(post_bos).save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>" if post_bos else None,
        # one token as an AddedToken dict, as many Hub configs have
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True},
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "model_max_length": 4096,
    }
    if template is not None:
        config["chat_template"] = template
    config.update(extra_config or {})
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return _write_dir(tmp_path_factory.mktemp("qwen"), QWEN_TEMPLATE)


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory):
    return _write_dir(tmp_path_factory.mktemp("bos"), BOS_TEMPLATE, post_bos=True)


def _hf_ids(out):
    """transformers 5 returns a BatchEncoding/dict for tokenize=True; 4.x a list."""
    if isinstance(out, list):
        return [int(i) for i in out]
    ids = out["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


# ---- basic tokenizer ----


def test_encode_decode_roundtrip(qwen_dir):
    tok = ChatTokenizer.from_dir(qwen_dir)
    raw = Tokenizer.from_file(os.path.join(qwen_dir, "tokenizer.json"))
    for text in CORPUS + ["<|im_start|>user\nciao<|im_end|>", "unseen 🦄 ñ"]:
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    ids = tok.encode("<|im_start|>ciao<|im_end|>")
    assert tok.decode(ids) == "ciao"
    assert tok.token_to_id("<|im_end|>") == raw.token_to_id("<|im_end|>")
    assert tok.token_to_id("<|no such token|>") is None
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == raw.token_to_id("<|im_end|>")
    assert tok.pad_token_id == raw.token_to_id("<|endoftext|>")
    assert tok.bos_token_id is None
    assert "unk_token" not in tok.special_tokens


def test_eos_absent_without_config(tmp_path):
    _train_tokenizer().save(str(tmp_path / "tokenizer.json"))
    tok = ChatTokenizer.from_dir(tmp_path)
    assert tok.eos_token_id is None
    assert not tok.has_chat_template


# ---- chat templates vs transformers ----


@pytest.mark.parametrize("which", ["qwen", "bos"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(which, add_generation_prompt, qwen_dir, bos_dir):
    transformers = pytest.importorskip("transformers")
    path = qwen_dir if which == "qwen" else bos_dir
    hf = transformers.AutoTokenizer.from_pretrained(path)
    tok = ChatTokenizer.from_dir(path)
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        got = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert got == expected
        hf_ids = _hf_ids(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt))
        assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == hf_ids


def test_bos_template_does_not_double_bos(bos_dir):
    tok = ChatTokenizer.from_dir(bos_dir)
    bos = tok.token_to_id("<s>")
    assert tok.bos_token_id == bos
    assert tok.encode("ciao")[0] == bos  # the post-processor adds BOS to plain text
    ids = tok.encode_chat(CONVERSATIONS[0])
    assert ids[0] == bos and ids[1] != bos


def test_tools_render_matches_transformers(qwen_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    tok = ChatTokenizer.from_dir(qwen_dir)
    tools = [{
        "type": "function",
        "function": {
            "name": "meteo",
            "description": "Che tempo fa a <città> & dintorni? 🌞",
            "parameters": {"type": "object", "properties": {"città": {"type": "string"}}, "required": ["città"]},
        },
    }]
    messages = CONVERSATIONS[1]
    expected = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    got = tok.apply_chat_template(messages, tools=tools)
    assert got == expected
    assert '"città"' in got and "<città> & dintorni" in got  # tojson: no ASCII / HTML escaping


def test_template_list_form_uses_default(tmp_path):
    templates = [
        {"name": "tool_use", "template": "TOOLS{{ messages[0]['content'] }}"},
        {"name": "default", "template": "DEFAULT{{ messages[0]['content'] }}"},
    ]
    tok = ChatTokenizer.from_dir(_write_dir(tmp_path, templates))
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "DEFAULTx"
    assert tok.apply_chat_template(msgs, tools=[{"name": "t"}]) == "TOOLSx"
    assert tok.apply_chat_template(msgs, chat_template="tool_use") == "TOOLSx"


def test_template_kwargs_and_special_token_variables(qwen_dir):
    tok = ChatTokenizer.from_dir(qwen_dir)
    msgs = [{"role": "user", "content": "x"}]
    tpl = "{{ eos_token }}|{{ pad_token }}|{{ enable_thinking }}|{{ tools is none }}|{{ strftime_now('%Y') | length }}"
    assert tok.apply_chat_template(msgs, chat_template=tpl, enable_thinking=False) == "<|im_end|>|<|endoftext|>|False|True|4"


# ---- template sources ----


def test_chat_template_jinja_file_preferred(tmp_path):
    path = _write_dir(tmp_path, QWEN_TEMPLATE)
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write("FROM-JINJA {% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<gen>{% endif %}")
    with open(os.path.join(path, "chat_template.json"), "w", encoding="utf-8") as f:
        json.dump({"chat_template": "FROM-JSON"}, f)
    msgs = [{"role": "user", "content": "ciao"}]
    tok = ChatTokenizer.from_dir(path)
    assert tok.apply_chat_template(msgs) == "FROM-JINJA [user]ciao<gen>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "FROM-JINJA [user]ciao"

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == "FROM-JINJA [user]ciao<gen>"


def test_chat_template_json_file(tmp_path):
    path = _write_dir(tmp_path, QWEN_TEMPLATE)
    with open(os.path.join(path, "chat_template.json"), "w", encoding="utf-8") as f:
        json.dump({"chat_template": "FROM-JSON {{ messages | length }}"}, f)
    tok = ChatTokenizer.from_dir(path)
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "FROM-JSON 1"


def test_plain_fallback_without_template(tmp_path):
    path = _write_dir(tmp_path, template=None)
    tok = ChatTokenizer.from_dir(path)
    assert not tok.has_chat_template and tok.chat_template is None
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Ciao 🌞"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "Perché?"},
    ]
    text = tok.apply_chat_template(msgs)
    assert text == "System: Be brief.\nUser: Ciao 🌞\nAssistant: Hello\nUser: Perché?\nAssistant:"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("User: Perché?\n")
    assert tok.encode_chat(msgs) == tok.encode(text, add_special_tokens=True)
    assert tok.decode(tok.encode_chat(msgs)) == text


# ---- errors ----


def test_raise_exception_becomes_value_error(tmp_path):
    tok = ChatTokenizer.from_dir(_write_dir(tmp_path, RAISE_TEMPLATE))
    assert tok.apply_chat_template([{"role": "user", "content": "a"}], add_generation_prompt=False) == "user: a\n"
    with pytest.raises(ValueError, match="Only user and assistant roles are supported!") as info:
        tok.apply_chat_template([{"role": "system", "content": "a"}])
    assert "\n" not in str(info.value)


def test_template_syntax_and_runtime_errors(qwen_dir):
    tok = ChatTokenizer.from_dir(qwen_dir)
    msgs = [{"role": "user", "content": "a"}]
    with pytest.raises(ValueError):
        tok.apply_chat_template(msgs, chat_template="{% for m in messages %}{{ m }}")  # no endfor
    with pytest.raises(ValueError):
        tok.apply_chat_template(msgs, chat_template="{{ messages[0].content.__class__ }}{{ 1 / 0 }}")
    with pytest.raises(ValueError):
        tok.apply_chat_template([])


# ---- streaming ----


@pytest.mark.parametrize("text", [
    "我喜欢学习中文。你好，世界！",
    "Pizza 🍕 e caffè ☕ 👍🏽🦄 perché sì — 终于!",
    "🦄🦄🦄 ñandú ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
])
def test_stream_decoder_multibyte(qwen_dir, text):
    tok = ChatTokenizer.from_dir(qwen_dir)
    ids = tok.encode(text)
    # the point of the test: some tokens must split a UTF-8 character
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert dec.text == text
    assert dec.flush() == ""


def test_stream_decoder_special_tokens_and_raw_tokenizer(qwen_dir):
    tok = ChatTokenizer.from_dir(qwen_dir)
    ids = tok.encode("<|im_start|>assistant\nCiao 🌞!<|im_end|>")
    dec = tok.stream_decoder()
    out = "".join(dec.push(i) for i in ids) + dec.flush()
    assert out == tok.decode(ids) == "assistant\nCiao 🌞!"
    raw = Tokenizer.from_file(os.path.join(qwen_dir, "tokenizer.json"))
    dec = StreamDecoder(raw, skip_special_tokens=False)
    out = "".join(dec.push(i) for i in ids) + dec.flush()
    assert out == "<|im_start|>assistant\nCiao 🌞!<|im_end|>"


def test_stream_decoder_flushes_incomplete_tail(qwen_dir):
    tok = ChatTokenizer.from_dir(qwen_dir)
    ids = tok.encode("ok 🦄")
    # drop the final byte-token(s) so the emoji is incomplete
    cut = ids[:-1]
    assert tok.decode(cut).endswith("\ufffd")
    dec = StreamDecoder(tok)
    streamed = "".join(dec.push(i) for i in cut)
    assert "\ufffd" not in streamed
    assert streamed + dec.flush() == tok.decode(cut)

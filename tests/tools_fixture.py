"""A tiny model whose chat template has tools (Qwen3's), and whose weights make it call one.

``QWEN3_TEMPLATE`` is the chat template of Qwen3's instruct checkpoints as published on the
Hugging Face hub (``tokenizer_config.json`` -> ``chat_template`` of Qwen/Qwen3-30B-A3B,
Qwen/Qwen3-235B-A22B, Qwen/Qwen3-8B: the same text), copied whole: the tools block in the system
turn, the assistant's ``tool_calls`` as ``<tool_call>`` JSON, "tool" messages as
``<tool_response>`` inside a user turn, reasoning and ``enable_thinking``.

``tool_model(d)`` writes and converts a qwen3_moe checkpoint (bits 16) with a real byte-level BPE
tokenizer trained here, ``<tool_call>`` / ``</tool_call>`` as added (non-special) tokens like
Qwen3's, and weights chosen so that greedy decoding is a fixed chain: every layer's output
projections are ~1e-4 (the residual stream stays the current token's embedding), the embeddings
are near-orthogonal unit vectors, and the head scores token j on the embedding of the token that
precedes it in the chain ``"\\n" -> <tool_call> -> CALL -> </tool_call> -> <|im_end|>``, where CALL
is one added token holding ``\\n{"name": "get_weather", "arguments": {"city": "Rome"}}\\n``. Every
chat prompt of the template ends in ``assistant\\n``, so the model calls get_weather: the real
engine, sampler and detokenizer produce the text the server parses -- no stand-in anywhere.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.conftest import tiny_config, tiny_tensors, write_hf_model

QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for forward_message in messages %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- set message = messages[index] %}
    {%- set current_content = message.content if message.content is not none else '' %}
    {%- set tool_start = '<tool_response>' %}
    {%- set tool_start_length = tool_start|length %}
    {%- set start_of_message = current_content[:tool_start_length] %}
    {%- set tool_end = '</tool_response>' %}
    {%- set tool_end_length = tool_end|length %}
    {%- set start_pos = (current_content|length) - tool_end_length %}
    {%- if start_pos < 0 %}
        {%- set start_pos = 0 %}
    {%- endif %}
    {%- set end_of_message = current_content[start_pos:] %}
    {%- if ns.multi_step_tool and message.role == "user" and not(start_of_message == tool_start and end_of_message == tool_end) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = (message.content.split('</think>')|last).lstrip('\n') %}
                {%- set reasoning_content = (message.content.split('</think>')|first).rstrip('\n') %}
                {%- set reasoning_content = (reasoning_content.split('<think>')|last).lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

CALL_TEXT = '\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
CORPUS = ['hello world, ciao mondo, the quick brown fox. {"name": "get_weather", "arguments": '
          '{"city": "Rome", "unit": "celsius"}} Paris 21 sunny weather tool call response'] * 20


def tool_tokenizer(d: Path) -> int:
    """The byte-level BPE with Qwen3's special and tool tokens and QWEN3_TEMPLATE; its vocab size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    # as in Qwen3's tokenizer.json: added tokens, not special (decoding keeps them)
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False),
                    AddedToken("</tool_call>", special=False, normalized=False),
                    AddedToken(CALL_TEXT, special=False, normalized=False)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3_TEMPLATE,
                                                         "eos_token": "<|im_end|>"}))
    return tok.get_vocab_size()


def tool_model(d: Path) -> Path:
    """The converted container (see the module docstring) in d / "toolcaller"."""
    from tokenizers import Tokenizer

    from core.converter import convert
    from models import validate_config
    src = d / "src"
    src.mkdir(parents=True)
    vocab = tool_tokenizer(src)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tid = tok.token_to_id
    newline = tok.encode("\n", add_special_tokens=False).ids
    assert len(newline) == 1
    chain = [newline[0], tid("<tool_call>"), tid(CALL_TEXT), tid("</tool_call>"), tid("<|im_end|>")]
    cfg = tiny_config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_experts=4)
    t = tiny_tensors(cfg, seed=3)
    rng = np.random.default_rng(7)
    e = rng.standard_normal((vocab, 64))
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    t["model.embed_tokens.weight"] = e.astype(np.float32)
    head = 0.05 * rng.standard_normal((vocab, 64))
    for a, b in zip(chain, chain[1:]):
        head[b] += 4.0 * e[a]
    t["lm_head.weight"] = head.astype(np.float32)
    t["model.norm.weight"] = np.ones(64, np.float32)
    for name in t:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = (1e-4 * rng.standard_normal(t[name].shape)).astype(np.float32)
    write_hf_model(src, cfg, t)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": tid("<|im_end|>")}))
    return convert(src, d / "toolcaller", bits=16, validate_config=validate_config)

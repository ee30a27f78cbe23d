"""A tiny Kimi-K2.5 that thinks and calls a tool, by construction: a real checkpoint whose greedy
output is a chosen script, for tests of the server's tool-call and thinking paths end to end.

- Tokenizer: the tiny Kimi vocabulary plus Kimi's tool-call and thinking markers as special tokens
  (as in Kimi's own tokenizer), and each other piece of the script as one added (non-special)
  token, so the script is a chain of distinct tokens.
- Chat template: ``KIMI_K25_TOOLS_TEMPLATE``, written after Kimi-K2.5's published one: tools
  declared in a ``tool_declare`` system turn, an assistant's calls rendered in the history by
  their ids, tool results as ``## Return of <id>``, thinking kept for the turns after the last
  plain answer, and a generation prompt ending in ``<think>`` (thinking on) or ``<think></think>``
  (``thinking: false``).
- Weights: a successor target (``echo_checkpoints.make_successor_target``) that predicts the next
  script token from the current one; ``<think>`` leads into the reasoning, ``</think>`` into the
  answer, so thinking on gives reasoning + answer and thinking off the answer alone; the script
  ends with ``<|im_end|>`` (EOS).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from eaglet.server.kimi_k2_output import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    REASONING_MARKERS,
    SECTION_BEGIN,
    SECTION_END,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_MARKERS,
)
from eaglet.testing.checkpoints import KIMI_SPECIAL_TOKENS, write_kimi_k25_checkpoint, write_tiny_tokenizer
from eaglet.testing.echo_checkpoints import IMAGE_TOKEN, make_successor_target

VOCAB_SIZE = 512  # enough for a byte-level BPE that encodes every character
FIRST_EXTRA_ID = 200  # the markers and script pieces take ids from here (below the image token)

REASONING = ("The user asks", " about the weather.")
ANSWER = ("Let me check.",)
CALL_ID = "functions.get_weather:0"
CALL_ARGUMENTS = ('{"city": ', '"Zürich \\"Nord\\" {1}"}')
SCRIPT = (
    THINK_OPEN, *REASONING, THINK_CLOSE, *ANSWER,
    SECTION_BEGIN, CALL_BEGIN, CALL_ID, ARGUMENT_BEGIN, *CALL_ARGUMENTS, CALL_END, SECTION_END,
    "<|im_end|>",
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

KIMI_K25_TOOLS_TEMPLATE = r"""
{%- macro render_content(message) -%}
  {%- if message['content'] is string -%}{{ message['content'] }}
  {%- elif message['content'] is not none -%}
    {%- for part in message['content'] -%}
      {%- if part['type'] == 'text' -%}{{ part['text'] }}
      {%- elif part['type'] in ['image', 'image_url'] -%}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- macro render_tool_calls(message) -%}
  <|tool_calls_section_begin|>
  {%- for call in message['tool_calls'] -%}
    <|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>
    {%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}
    {%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}
    <|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}
{%- set ns = namespace(last_answer=-1) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'assistant' and not message.get('tool_calls') -%}{%- set ns.last_answer = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>{%- endif -%}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>
  {%- else -%}<|im_system|>{{ message['role'] }}<|im_middle|>
  {%- endif -%}
  {%- if message['role'] == 'assistant' -%}
    {%- if loop.index0 > ns.last_answer and not (thinking is defined and thinking is false) -%}
      <think>{{ message.get('reasoning_content') or '' }}</think>
    {%- else -%}<think></think>
    {%- endif -%}
    {{ render_content(message) }}
    {%- if message.get('tool_calls') -%}{{ render_tool_calls(message) }}{%- endif -%}
  {%- elif message['role'] == 'tool' -%}## Return of {{ message['tool_call_id'] }}{{ '\n' }}{{ render_content(message) }}
  {%- else -%}{{ render_content(message) }}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>
  {%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}
{%- endif -%}
""".strip()


def write_tool_tokenizer(path: Path, pieces: tuple[str, ...] = (), vocab_size: int = VOCAB_SIZE) -> dict[str, int]:
    """The tiny Kimi tokenizer with the markers (special) and ``pieces`` (plain added tokens), and
    the K2.5-style template; returns the ids of every special token, markers and pieces. At
    ``vocab_size`` 512 its byte-level BPE encodes every character; at 256, printable ASCII only."""
    markers = REASONING_MARKERS + TOOL_CALL_MARKERS
    kimi = set(KIMI_SPECIAL_TOKENS.values())
    plain = [p for p in dict.fromkeys(pieces) if p not in markers and p not in kimi]
    ids = {text: FIRST_EXTRA_ID + i for i, text in enumerate([*markers, *plain])}
    write_tiny_tokenizer(path, vocab_size, chat_style="kimi", extra_special_tokens=ids)
    tokenizer_json = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    for token in tokenizer_json["added_tokens"]:
        ids.setdefault(token["content"], token["id"])
        if token["content"] in plain:
            token["special"] = False
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = KIMI_K25_TOOLS_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


def write_tool_calling_target(path: Path, alpha: float = 0.02, seed: int = 11) -> Path:
    """The scripted Kimi-K2.5 target (see the module docstring), tokenizer included."""
    text = {"vocab_size": VOCAB_SIZE, "max_position_embeddings": 1024}
    write_kimi_k25_checkpoint(path, text, seed=seed, image_token_id=IMAGE_TOKEN)
    ids = write_tool_tokenizer(path, SCRIPT)
    chain = [ids[piece] for piece in SCRIPT]
    make_successor_target(path, dict(itertools.pairwise(chain)), alpha, prefix="language_model.")
    return path

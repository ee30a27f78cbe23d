"""Which output parsers a server runs (``--tool-call-parser``, ``--reasoning-parser``, as vLLM and
SGLang name them), and what one chat request's output is read for.

``"auto"`` turns the ``kimi_k2`` parsers on for Kimi checkpoints (``model_type`` ``kimi_k2`` or
``kimi_k25``). When a marker the request's parsing needs is a special token of the tokenizer, the
engine keeps special tokens in the text (skipping them would delete the markers) and the parser
removes the other special tokens' text itself, when the client asked for them to be skipped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from eaglet.server.kimi_k2_output import THINK_OPEN, OutputFormat

PARSER_SETTINGS = ("auto", "kimi_k2", "none")
KIMI_ARCHITECTURES = ("kimi_k2", "kimi_k25")


def parser_enabled(setting: str, architecture: str) -> bool:
    if setting not in PARSER_SETTINGS:
        raise ValueError(f"unknown output parser {setting!r}; choose one of {', '.join(PARSER_SETTINGS)}")
    if setting == "auto":
        return architecture in KIMI_ARCHITECTURES
    return setting != "none"


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt (its last characters) leaves a thinking section open for the output, as
    Kimi-K2.5's template does with thinking on."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


@dataclass(frozen=True)
class OutputParsing:
    tool_calls: bool
    reasoning: bool
    special_texts: frozenset[str]  # the tokenizer's special tokens, as text

    @classmethod
    def for_server(cls, tokenizer: Any, tool_call_parser: str, reasoning_parser: str, architecture: str) -> OutputParsing:
        specials: frozenset[str] = frozenset()
        if tokenizer is not None:
            specials = frozenset(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
        return cls(parser_enabled(tool_call_parser, architecture), parser_enabled(reasoning_parser, architecture), specials)

    def output_format(
        self, *, parse_tool_calls: bool, max_tool_calls: int | None, prompt_tail: str, skip_special_tokens: bool
    ) -> OutputFormat:
        reasoning = self.reasoning
        output_format = OutputFormat(
            reasoning=reasoning,
            starts_in_reasoning=reasoning and prompt_opens_reasoning(prompt_tail),
            tool_calls=self.tool_calls and parse_tool_calls,
            max_tool_calls=max_tool_calls,
        )
        if skip_special_tokens and self.engine_keeps_special_tokens(output_format):
            return dataclasses.replace(output_format, dropped=self.special_texts)
        return output_format

    def engine_keeps_special_tokens(self, output_format: OutputFormat) -> bool:
        return any(marker in self.special_texts for marker in output_format.markers)

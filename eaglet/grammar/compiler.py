"""Turns a request's ``StructuredOutput`` into an llguidance grammar and a matcher for it.

The llguidance tokenizer is made once per engine from the checkpoint's Hugging Face tokenizer
(about a second for a large vocabulary), on first use. Every end-of-sequence id of the engine is
llguidance's EOS, so the grammar lets any of them end the output once it accepts.
"""

from __future__ import annotations

import threading
from typing import Any

from llguidance import LLMatcher

from eaglet.errors import InvalidRequestError
from eaglet.grammar.lark import JSON_OPTIONS
from eaglet.grammar.matcher import GrammarMatcher
from eaglet.sampling_params import StructuredOutput


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()  # the server checks grammars off the engine's thread

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                if self._hf_tokenizer is None:
                    raise InvalidRequestError("structured output needs a tokenizer; this checkpoint has none")
                import llguidance.hf  # imports transformers: only where a grammar is used

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._ll_tokenizer

    def grammar(self, structured: StructuredOutput) -> str:
        """The llguidance grammar text; raises InvalidRequestError when it does not compile."""
        try:
            if structured.lark is not None:
                text = LLMatcher.grammar_from_lark(structured.lark)
            else:
                schema = structured.json_schema if structured.json_schema is not None else {"type": "object"}
                text = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidRequestError(f"invalid structured output: {exc}") from exc
        error = LLMatcher.validate_grammar(text, self._tokenizer())
        if error:
            what = "grammar" if structured.lark is not None else "JSON schema"
            raise InvalidRequestError(f"invalid {what} for structured output: {error}")
        return text

    def check(self, structured: StructuredOutput) -> None:
        """Raises InvalidRequestError if the structured output cannot be compiled."""
        self.grammar(structured)

    def matcher(self, structured: StructuredOutput, final_token_ids: tuple[int, ...]) -> GrammarMatcher:
        """A fresh grammar state for one request whose output ends at any of ``final_token_ids``."""
        matcher = LLMatcher(self._tokenizer(), self.grammar(structured), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid structured output: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.vocab_size, final_token_ids)

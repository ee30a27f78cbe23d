"""Structured output: a request's grammar (llguidance), compiled once per request from its
``StructuredOutput``, and the token masks it puts on the logits before sampling and at every
speculative draft and verify position. Sits beside ``layers/`` so the engine, the speculative
worker and the request state all import it downward."""

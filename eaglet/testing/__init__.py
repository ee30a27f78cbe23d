"""Inputs made at run time, shared by the tests, the bench and the tools: tiny random checkpoints
in the published DeepSeek-V3 / Kimi-K2.5 / EAGLE-3 layouts, echo targets and drafts whose
acceptance is set by a dial, seeded images, and the demo model's generated task (scenes, docs
continuations, held-out prompts)."""

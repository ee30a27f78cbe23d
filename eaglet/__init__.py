"""eaglet: multimodal MLA/MoE inference with EAGLE-3 speculative decoding."""

from eaglet.api import LLM
from eaglet.executor.request import RequestOutput
from eaglet.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

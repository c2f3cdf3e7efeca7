"""Sid: an LLM inference engine whose deterministic requests are bit-reproducible under any load."""

from sid.entrypoints.llm import LLM
from sid.outputs import CompletionOutput, Logprob, RequestOutput
from sid.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

"""punica: serve hundreds of LoRA fine-tunes of one base LLM as fast as the base model alone."""

from punica.engine.llm import LLM
from punica.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

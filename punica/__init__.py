"""punica: serve hundreds of LoRA fine-tunes of one base LLM as fast as the base model alone.

`LLM` and `SamplingParams` are imported on first use, so that the torch-free parts (the cluster
policy, the scheduler) import without torch.
"""

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from punica.llm import LLM

        return LLM
    if name == "SamplingParams":
        from punica.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'punica' has no attribute {name!r}")

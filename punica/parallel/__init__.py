"""Tensor parallelism on torch.distributed: a transform of the unchanged model, and a launcher."""

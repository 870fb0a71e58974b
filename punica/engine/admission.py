"""What admits a request: its prompt checked once when it is added, and its adapter held while it
runs (the scheduler's acquire and release)."""

from __future__ import annotations

from array import array

from punica.engine.request import Request
from punica.engine.sampling_params import SamplingParams, SamplingParamsError
from punica.lora.manager import AdapterManager


def checked_prompt(prompt: str | list[int], tokenizer, max_model_len: int | None,
                   vocab_size: int | None = None) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt; ValueError if it is empty, too long or out of vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompt token ids")
        text, token_ids = prompt, tokenizer.encode(prompt)
    else:
        text, token_ids = None, list(prompt)
    if not token_ids:
        raise ValueError("the prompt is empty")
    if vocab_size is not None and not ids_in_vocabulary(token_ids, vocab_size):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if max_model_len is not None and len(token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens; this model's context is "
                         f"{max_model_len} tokens, including at least one generated token")
    return text, token_ids


def ids_in_vocabulary(token_ids: list, vocab_size: int) -> bool:
    """Whether every id is an integer in [0, vocab_size) (none is): checked at C speed (a 32k-token
    prompt is checked on the thread that steps the engine, or serves HTTP)."""
    try:
        ids = array("q", token_ids)
    except (TypeError, OverflowError):  # a float, a string, None; an integer past 64 bits
        return False
    return not ids or (min(ids) >= 0 and max(ids) < vocab_size)


def check_lora_scale(params: SamplingParams, adapter: str | None, adapters: AdapterManager) -> None:
    """A SamplingParamsError naming lora_scale when it is not 1 on a request without an adapter (it
    scales an adapter's delta, and a strength the request asked for is never dropped silently) or on
    a DoRA adapter (whose weight norms, computed once per slot, depend on the scale)."""
    if params.lora_scale == 1:
        return
    if adapter is None:
        raise SamplingParamsError("lora_scale", f"lora_scale {params.lora_scale!r} needs an adapter: it scales the "
                                  "adapter's delta, and this request runs on the base model")
    registration = adapters.current.get(adapter)
    if registration is not None and registration.dora:
        raise SamplingParamsError("lora_scale", f"lora_scale {params.lora_scale!r} is not supported on the DoRA "
                                  f"adapter {adapter!r} (only 1: its weight norms are computed for its own scale)")


def adapter_error(adapters: AdapterManager, request: Request) -> str | None:
    """Why the request's adapter cannot serve it: unloaded (perhaps loaded again since: a request
    queued for, or preempted on, one registration never runs on another) or failed to load."""
    if request.adapter is None:
        return None
    if adapters.current.get(request.adapter) is not request.registration:
        return f"adapter {request.adapter!r} was unloaded after this request was queued"
    return adapters.error(request.adapter)


def acquire_adapter(adapters: AdapterManager, request: Request) -> bool:
    """Hold the request's adapter slot (True), or False while the adapter is being loaded (or
    cannot serve it any more: the engine then fails it)."""
    if request.adapter is None:
        return True
    if adapters.current.get(request.adapter) is not request.registration:
        return False
    slot = adapters.acquire(request.adapter, request.queued_residency)
    if slot is None:
        return False
    request.slot = slot
    return True


def adapter_ready(adapters: AdapterManager, request: Request) -> bool:
    """Whether `acquire_adapter` would hold the request's slot now (its adapter is on the GPU)."""
    return request.adapter is None or (adapters.current.get(request.adapter) is request.registration
                                       and adapters.residency(request.adapter) is not None)


def release_adapter(adapters: AdapterManager, request: Request) -> None:
    """Let go of the slot the request holds (it is that of the registration it was admitted on). A
    preempted request goes back to the queue on the residency it held (its next admission is a hit
    unless the adapter leaves the GPU meanwhile)."""
    if request.slot >= 0:
        request.queued_residency = adapters.residency(request.adapter)
        adapters.release(request.slot)
        request.slot = -1

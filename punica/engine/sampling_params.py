"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names).

Every field is range-checked when the object is built, so a request's parameters can never
fail the step that samples it together with other requests (NaN or infinite logits, an
integer overflow in a seed). A bad value raises SamplingParamsError naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# logits / temperature: below MIN_TEMPERATURE it can overflow float32 (1e-38 turns logits of a
# few hundred into inf, and softmax into NaN); at 1e-2 it is 100x the logits, as good as greedy
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
# the penalty divides or multiplies logits: outside these bounds they underflow to 0 or overflow
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_ABS_FREQUENCY_PRESENCE = 2.0  # OpenAI's range for frequency_penalty and presence_penalty
# what torch.Generator.manual_seed accepts
MIN_SEED, SEED_MODULUS = -(1 << 63), 1 << 64
MAX_STOP_STRINGS = MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_LOGIT_BIAS_TOKENS, MAX_ABS_LOGIT_BIAS = 1024, 100.0
MAX_CHOICES = 1024
# a request's lora_scale multiplies its adapter's delta, and so the gain punica.lora.adapter bounds
# (MAX_LORA_GAIN); 10x an adapter's trained strength still leaves that bound's margin
MAX_REQUEST_LORA_SCALE = 10.0
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; `field` is its name (the same as OpenAI's and vLLM's)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def offset_seed(seed: int, offset: int) -> int:
    """seed + offset (offset >= 0), wrapped modulo 2**64 into [-2**63, 2**64) (torch's generators
    keep 64 bits): the seed of choice `offset` of a request. A seed out of that range is returned
    unchanged, for SamplingParams to reject."""
    if not _is_int(seed) or not MIN_SEED <= seed < SEED_MODULUS:
        return seed
    seed += offset
    return seed - SEED_MODULUS if seed >= SEED_MODULUS else seed


def _check_float(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    """A finite number (int or float, not bool) in [low, high], or (low, high] when low_open."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplingParamsError(name, f"{name} must be a finite number, got {value!r}")
    if value < low or (low_open and value == low) or value > high:
        bounds = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise SamplingParamsError(name, f"{name} must be in {bounds}, got {value!r}")


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match (vLLM's StructuredOutputsParams): exactly one of a JSON
    schema (a dict, or its JSON text; stored as JSON text), any JSON object, a regular
    expression, one string of `choice`, or an EBNF grammar (GBNF, root rule `root`). Only the shape
    is checked here; the engine compiles it (punica.engine.structured) and a ValueError names what
    the grammar engine rejects."""
    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError("structured_outputs", "structured_outputs takes exactly one of "
                                      f"{', '.join(CONSTRAINT_KINDS)}; got {', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if not isinstance(self.json_object, bool):
            raise SamplingParamsError("structured_outputs", "structured_outputs.json_object must be a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise SamplingParamsError("structured_outputs", f"structured_outputs.{name} must be a non-empty "
                                          "string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not 0 < len(self.choice) <= MAX_CHOICES or not all(
                    isinstance(c, str) and 0 < len(c) <= MAX_STOP_STRING_CHARS for c in self.choice):
                raise SamplingParamsError("structured_outputs", f"structured_outputs.choice must be 1 to {MAX_CHOICES}"
                                          f" non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))


def _schema_text(schema) -> str:
    """A JSON schema (dict or JSON text) as JSON text (its keys in order: properties are generated in
    the schema's order). Its size and depth are the engine's to limit (punica.engine.constraint)."""
    try:
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, (dict, bool)):
            raise SamplingParamsError("structured_outputs", "structured_outputs.json must be a JSON schema: an "
                                      f"object (or true/false), got {type(schema).__name__}")
        return json.dumps(schema, ensure_ascii=False)
    except json.JSONDecodeError as e:
        raise SamplingParamsError("structured_outputs", f"structured_outputs.json is not valid JSON: {e}") from e
    except RecursionError as e:  # json reads and writes nested values recursively
        raise SamplingParamsError("structured_outputs", "structured_outputs.json nests objects and arrays too "
                                  "deep to be read") from e


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0       # 0 = greedy
    top_k: int = 0                 # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: bool = False         # return the log-probability of each chosen token
    top_logprobs: int = 0          # and of this many most likely tokens at each position
    # None, or the logprob of each prompt token (the first has none) and of this many most likely tokens there
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # token id -> added to its logit
    structured_outputs: StructuredOutputs | None = None
    # the strength of the request's adapter: its delta times this (0 = the base model, 1 = as trained);
    # a request without an adapter must leave it at 1 (Engine.add_request refuses another value)
    lora_scale: float = 1.0

    def __post_init__(self):
        # accept lists and a single stop string for convenience; store tuples (frozen, hashable)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise SamplingParamsError(name, f"{name} must be a list, got {value!r}")
            object.__setattr__(self, name, tuple(value or ()))
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = sorted(bias.items())
        if not isinstance(bias, (list, tuple)) or not all(isinstance(b, (list, tuple)) and len(b) == 2 for b in bias):
            raise SamplingParamsError("logit_bias", "logit_bias must map token ids to numbers")
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))
        self._check()

    def _check(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check_float("temperature", self.temperature, 0, MAX_TEMPERATURE)
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise SamplingParamsError(
                "temperature", f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                f"got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError("top_k", f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        _check_float("top_p", self.top_p, 0, 1, low_open=True)
        _check_float("min_p", self.min_p, 0, 1)
        _check_float("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        for name in ("frequency_penalty", "presence_penalty"):
            _check_float(name, getattr(self, name), -MAX_ABS_FREQUENCY_PRESENCE, MAX_ABS_FREQUENCY_PRESENCE)
        if self.seed is not None and not (_is_int(self.seed) and MIN_SEED <= self.seed < SEED_MODULUS):
            raise SamplingParamsError("seed", f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
                raise SamplingParamsError(
                    "stop", f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got {s!r:.80}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, "
                                                        f"got {len(self.stop_token_ids)}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be non-negative integers")
        for name in ("include_stop_str_in_output", "ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingParamsError("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                                      f"got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and not (
                _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise SamplingParamsError("prompt_logprobs", f"prompt_logprobs must be None or an integer in "
                                                         f"[0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise SamplingParamsError("logit_bias", f"logit_bias sets at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                                                    f"got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not _is_int(token) or token < 0:
                raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids (integers >= 0), "
                                                        f"got {token!r}")
            _check_float("logit_bias", bias, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
        _check_float("lora_scale", self.lora_scale, 0, MAX_REQUEST_LORA_SCALE)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise SamplingParamsError("structured_outputs", "structured_outputs must be a StructuredOutputs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

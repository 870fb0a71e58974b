"""The latency budget in the engine (--max-itl-ratio, punica.engine.step_cost): a long prompt beside a
stream is prefilled in chunks sized to keep the stream's inter-token gaps within the ratio.

Steps run on the tiny CPU model, timed by a virtual clock that each step advances by a known cost
of what it computed (a fixed cost, a cost per row and per prompt token, prompt tokens counted as a
CPU's GEMMs compute them: a step's rows in a block of the runner's row sizes padded to the block's
top, punica.ops.linear): the cost model learns these times as it would a GPU's or a CPU's, and the
test never depends on how fast this machine is. The clock is in place before the engine is made, so
the engine's start-up calibration (punica.engine.calibration) runs in it too, where a test asks.
"""

import pytest

from punica.engine.executor import LocalExecutor
from punica.engine.sampling_params import SamplingParams

BASE_S, ROW_S, PROMPT_TOKEN_S = 0.1, 0.01, 0.001


def computed(step, sizes):
    """The prompt tokens the step's GEMMs compute, with the runner's row sizes `sizes`."""
    rows, decodes = step.num_decodes + step.num_prefill_tokens, step.num_decodes
    return next((top - decodes for start, top in zip(sizes, sizes[1:]) if start < rows <= top),
                step.num_prefill_tokens) if step.num_prefill_tokens else 0


class VirtualTime:
    """A clock that only the engines' steps advance: each executor run adds its step's cost. With
    `calibrate`, an engine made after it runs its start-up calibration steps in this time."""

    def __init__(self, monkeypatch, calibrate=False):
        self.now = 0.0
        run = LocalExecutor.run

        def timed_run(executor, step):
            self.now += BASE_S + ROW_S * step.num_requests + PROMPT_TOKEN_S * computed(step, executor.row_sizes)
            return run(executor, step)

        monkeypatch.setattr(LocalExecutor, "run", timed_run)
        monkeypatch.setattr("punica.engine.core.step_clock", lambda: self.now)
        monkeypatch.setattr("punica.engine.calibration.CALIBRATION_S", 100.0 if calibrate else 0.0)


def stream_beside_a_long_prompt(engine, clock, prompt_len):
    """Stream one request; once it decodes, add a prompt of `prompt_len` tokens. Returns the stream's
    steady gap before the prompt, its gaps while the prompt prefills, the prompt's chunk sizes and
    its tokens."""
    stream = engine.add_request(list(range(5, 15)), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
                                "a")
    stamps, chunks = [], []
    while len(stamps) < 8:
        stamps += [clock.now for out in engine.step() if out.request_id == stream for _ in out.new_token_ids]
    steady = stamps[-1] - stamps[-2]
    long_id = engine.add_request([3 + (7 * i) % 120 for i in range(prompt_len)],
                                 SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), "a")
    arrival, first, tokens = clock.now, None, []
    while engine.has_unfinished():
        outputs = engine.step()
        if first is None and engine.last_step is not None and engine.last_step.num_prefill_tokens:
            chunks.append(engine.last_step.num_prefill_tokens)
        for out in outputs:
            if out.request_id == stream:
                stamps += [clock.now] * len(out.new_token_ids)
            elif out.request_id == long_id:
                tokens += out.new_token_ids
                first = clock.now if first is None else first
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if arrival < b <= first]
    return steady, gaps, chunks, tokens


@pytest.mark.parametrize("calibrated", [False, True])
def test_chunks_keep_the_streams_gaps_within_the_ratio(setup, make_engine, monkeypatch, calibrated):
    """Without the start-up calibration the first chunk comes before the model has seen a chunk
    beside a decode (only the stream's prompt step, 10 tokens alone, tells it what a prompt token
    costs) and may run over; with it, every chunk keeps the ratio."""
    clock = VirtualTime(monkeypatch, calibrate=calibrated)
    engine = make_engine(setup, overlap_steps=False, max_batch_size=4, max_num_batched_tokens=256,
                         max_itl_ratio=2.0)
    assert (engine.scheduler.latency.model.num_observed > 0) == calibrated
    steady, gaps, chunks, tokens = stream_beside_a_long_prompt(engine, clock, 240)
    assert steady == pytest.approx(BASE_S + ROW_S)
    assert len(chunks) >= 3 and sum(chunks) == 240, (gaps, chunks)
    assert all(gap <= 2.0 * steady * 1.001 for gap in gaps[0 if calibrated else 1:]), (gaps, chunks)
    assert max(gaps) <= 3.0 * steady, (gaps, chunks)

    unlimited = make_engine(setup, overlap_steps=False, max_batch_size=4, max_num_batched_tokens=256,
                            max_itl_ratio=0)
    steady_off, gaps_off, chunks_off, tokens_off = stream_beside_a_long_prompt(unlimited, clock, 240)
    assert chunks_off == [240] and max(gaps_off) > 2.5 * steady_off
    assert tokens == tokens_off


def test_a_prompt_alone_fills_the_token_budget(setup, make_engine, monkeypatch):
    VirtualTime(monkeypatch)
    engine = make_engine(setup, overlap_steps=False, max_batch_size=4, max_num_batched_tokens=128,
                         max_itl_ratio=1.5)
    engine.add_request([3 + i % 120 for i in range(200)], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    chunks = []
    while engine.has_unfinished():
        engine.step()
        if engine.last_step is not None and engine.last_step.num_prefill_tokens:
            chunks.append(engine.last_step.num_prefill_tokens)
    assert chunks == [128, 72]

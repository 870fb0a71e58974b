"""The step-time model and the latency budget (punica.engine.step_cost): the fit against known
costs, and the prompt chunk it allows beside decodes. Synthetic step times: no clock."""

import random
from dataclasses import replace

import pytest

from punica.config import EngineConfig
from punica.engine.scheduler_output import SchedulerOutput
from punica.engine.step_cost import FLOOR_HEADROOM, MIN_CHUNK, LatencyBudget, StepCostModel, StepFeatures

TRUE = (0.1, 0.02, 0.002, 1e-6, 2e-5)  # c0, per row, per prompt token, per (query, key) pair, per key read


def cost(features, coefficients=TRUE):
    return sum(c * x for c, x in zip(coefficients, features.vector()))


def step_features(contexts, chunk, position):
    """Decodes at these contexts, and a chunk of `chunk` prompt tokens after `position` cached ones."""
    decodes = StepFeatures.decodes(contexts)
    if not chunk:
        return decodes
    return StepFeatures(decodes.rows + 1, chunk, decodes.attention + chunk * (position + (chunk + 1) / 2),
                        decodes.keys + position + chunk, decodes.rows, position)


def random_steps(n, seed):
    """Decode-only steps and steps with a chunk beside decodes, of varied sizes and contexts."""
    rng = random.Random(seed)
    steps = []
    for _ in range(n):
        contexts = [rng.randint(10, 2000) for _ in range(rng.randint(1, 16))]
        chunk, position = rng.choice([0, 0, 32, 100, 256, 512]), rng.randint(0, 4000)
        steps.append(step_features(contexts, chunk, position))
    return steps


def test_features_of_a_plan_count_rows_prompt_tokens_attention_pairs_and_keys():
    output = SchedulerOutput(step=1, request_ids=("p", "d1", "d2"), num_computed=(100, 7, 30),
                             num_scheduled=(10, 1, 1), num_prefills=1, sampling_rows=(1, 2), preempted_ids=())
    features = StepFeatures.of(output)
    assert features == StepFeatures(3, 10, 10 * (100 + 5.5) + 8 + 31, 110 + 8 + 31, 2, 100)
    assert StepFeatures.decodes([7, 30]) == StepFeatures(2, 0, 8 + 31, 8 + 31, 2)


def test_the_fit_recovers_the_cost_of_each_feature():
    model = StepCostModel()
    for features in random_steps(300, seed=0):
        model.observe(features, cost(features))
    for got, want in zip(model.coefficients, TRUE):
        assert got == pytest.approx(want, rel=1e-3)


def test_steps_of_equal_time_leave_the_prompt_unlimited():
    """What tests/conftest.py's counter clock gives: no chunk limit, whatever the steps were."""
    budget = LatencyBudget(2.0)
    for features in random_steps(50, seed=1):
        budget.observe(features, 1.0)
    coefficients = budget.model.coefficients
    assert coefficients[0] == pytest.approx(1.0) and max(coefficients[1:]) < 1e-9
    assert budget.prompt_tokens([100, 200], 0) >= 1 << 20


def test_a_feature_that_would_cost_negative_time_is_dropped():
    model = StepCostModel()
    for features in random_steps(200, seed=2):  # longer chunks slightly faster: noise, not physics
        model.observe(features, cost(features, (0.1, 0.02, -1e-5, 1e-6, 2e-5)))
    assert model.coefficients[2] == 0.0 and all(c >= 0 for c in model.coefficients)


def test_old_steps_are_forgotten_when_the_hardware_slows_down():
    model = StepCostModel()
    for features in random_steps(300, seed=3):
        model.observe(features, cost(features))
    slower = tuple(2 * c for c in TRUE)
    for features in random_steps(1500, seed=4):
        model.observe(features, cost(features, slower))
    probe = step_features([1000] * 7, 256, 1500)
    assert model.predict(probe) == pytest.approx(cost(probe, slower), rel=0.02)


@pytest.mark.parametrize("position", [0, 3000])
def test_the_chunk_is_the_largest_within_the_ratio(position):
    budget = LatencyBudget(2.0)
    for features in random_steps(300, seed=5):
        budget.observe(features, cost(features))
    contexts = [500] * 8
    chunk = budget.prompt_tokens(contexts, position)

    def step(c):
        return cost(step_features(contexts, c, position))

    decode_only = step(0)
    assert step(chunk) <= 2.0 * decode_only * (1 + 1e-3) and step(chunk + 2) > 2.0 * decode_only
    assert chunk > MIN_CHUNK
    assert budget.prompt_tokens(contexts, position + 20_000) < chunk  # longer context, dearer tokens


def test_a_chunk_falls_below_the_floor_only_where_the_floors_step_passes_the_headroom():
    """A decode-only step of 0.1 s: where no chunk past the floor fits the ratio 2.0 but the floor's
    step fits FLOOR_HEADROOM (1.1) times that bound (0.013 s a prompt token: 7 tokens fit, 8 take
    0.204 s), the chunk is the floor; where a token costs 0.045 s, the most within 0.22 s (2); where
    a token costs a whole second, one token: a prompt always advances. Before any step is seen, the
    floor."""
    assert FLOOR_HEADROOM == 1.1
    assert LatencyBudget(1.5).prompt_tokens([10], 0) == MIN_CHUNK  # nothing seen yet
    for per_token, want in ((0.013, MIN_CHUNK), (0.045, 2), (1.0, 1)):
        budget = LatencyBudget(2.0)
        for features in random_steps(300, seed=6):
            budget.observe(features, cost(features, (0.1, 0.0, per_token, 0.0, 0.0)))
        assert budget.prompt_tokens([10], 0) == want, per_token


def test_the_ratio_is_off_or_over_one():
    with pytest.raises(ValueError, match="max_itl_ratio"):
        EngineConfig(max_itl_ratio=1.0)
    assert EngineConfig(max_itl_ratio=0).max_itl_ratio == 0


def test_chunks_leave_room_for_how_far_steps_run_over_their_prediction():
    """Steps with a chunk take 0.85-1.25x what the features say (a bucket's padding, noise the model
    cannot see): after the first steps, about 1 chunk step in 10 goes over the ratio of the
    decode-only step (the overrun's quantile; sized by the prediction alone, about half would)."""
    rng = random.Random(7)
    budget = LatencyBudget(2.0)
    for features in random_steps(100, seed=8):
        budget.observe(features, cost(features))
    contexts = [800] * 8
    decode_only = cost(StepFeatures.decodes(contexts))
    over = []
    for step in range(200):
        position = (step * 97) % 3000
        chunk = budget.prompt_tokens(contexts, position)
        features = step_features(contexts, chunk, position)
        seconds = cost(features) * rng.uniform(0.85, 1.25)
        budget.observe(features, seconds)
        over.append(seconds > 2.0 * decode_only)
    assert budget.model.overrun > 1.1
    assert sum(over[20:]) <= 0.15 * len(over[20:]), sum(over[20:])


def test_a_short_chunk_after_a_long_context_pays_for_reading_it():
    """Reading the cached context costs the same for any chunk after it: far into a long prompt the
    chunk shrinks to what the room left after that read allows, and the step stays within the ratio."""
    budget = LatencyBudget(2.0)
    reads = (0.1, 0.02, 0.002, 0.0, 4e-5)  # the keys read, not the pairs, cost the attention
    for features in random_steps(300, seed=9):
        budget.observe(features, cost(features, reads))
    contexts = [500] * 8
    decode_only = cost(StepFeatures.decodes(contexts), reads)
    near, far = budget.prompt_tokens(contexts, 0), budget.prompt_tokens(contexts, 6000)
    assert MIN_CHUNK < far < near
    for position, chunk in ((0, near), (6000, far)):
        assert cost(step_features(contexts, chunk, position), reads) <= 2.0 * decode_only * (1 + 1e-3)
        assert cost(step_features(contexts, chunk + 2, position), reads) > 2.0 * decode_only


def test_a_stalled_decode_step_does_not_inflate_the_steady_step():
    """Decode-only steps whose contexts grow by one a step, one of them 3x its time (the host paused):
    the steady prediction stays where the others put it; a run of slow steps moves it."""
    budget = LatencyBudget(2.0)
    contexts = [500] * 8
    for step in range(60):
        features = StepFeatures.decodes([c + step for c in contexts])
        budget.observe(features, cost(features) * (3.0 if step == 59 else 1.0))
    probe = StepFeatures.decodes([c + 100 for c in contexts])
    assert budget.decode_model.predict(probe) == pytest.approx(cost(probe), rel=0.01)
    assert budget.model.predict(probe) == pytest.approx(cost(probe), rel=0.01)
    assert budget.steady(probe) == pytest.approx(cost(probe), rel=0.01)
    for step in range(60, 260):
        features = StepFeatures.decodes([c + step for c in contexts])
        budget.observe(features, 3.0 * cost(features))
    probe = StepFeatures.decodes([c + 300 for c in contexts])
    assert budget.decode_model.predict(probe) == pytest.approx(3.0 * cost(probe), rel=0.1)


def test_the_steady_step_is_what_the_last_decode_only_steps_took():
    """Decode-only steps at one time, then the last few 5% faster (another batch's, or the
    hardware's, pace): the steady step is what those last steps took, not a fit over them all, so
    a chunk beside them stays within the ratio of the decodes' gaps as they were."""
    budget = LatencyBudget(2.0)
    contexts = [500] * 8
    for step in range(200):
        features = StepFeatures.decodes([c + step for c in contexts])
        budget.observe(features, cost(features) * (0.95 if step >= 192 else 1.0))
    now = StepFeatures.decodes([c + 200 for c in contexts])
    assert budget.decode_model.predict(now) > 0.97 * cost(now)
    assert budget.steady(now) == pytest.approx(0.95 * cost(now), rel=0.005)


def test_the_steady_step_follows_the_decodes_contexts_by_what_chunks_taught():
    """Decode-only steps whose time drifts up 4% while their contexts grow by 20 (noise that the
    decode-only fit reads as a cost per key), then chunks at every position, which show that keys
    cost nothing: 2,000 tokens of context later the steady step is still the decodes' time, and the
    chunk stays within the ratio of it."""
    flat = (0.1, 0.02, 0.002, 1e-6, 0.0)
    budget = LatencyBudget(2.0)
    contexts = [500] * 8
    for step in range(20):
        features = StepFeatures.decodes([c + step for c in contexts])
        budget.observe(features, cost(features, flat) * (1 + 0.002 * step))
    rng = random.Random(10)
    for _ in range(100):
        position = rng.randint(0, 8000)
        features = step_features([c + 20 for c in contexts], rng.choice([32, 100, 256]), position)
        budget.observe(features, cost(features, flat))
    later = [c + 2000 for c in contexts]
    decode_only = cost(StepFeatures.decodes(later), flat)
    assert budget.steady(StepFeatures.decodes(later)) == pytest.approx(decode_only, rel=0.05)
    chunk = budget.prompt_tokens(later, 4000)
    assert cost(step_features(later, chunk, 4000), flat) <= 2.0 * decode_only * 1.05


SIZES = (32, 64, 128, 256, 512)  # the prompt tokens of a GPU's CUDA-graph buckets


def bucketed(features, query_tile=1):
    """What a step runs when its prompt tokens are padded to the next of SIZES (none past the last):
    that size's tokens, and its cached context read for the size's query rows (whole tiles of
    `query_tile`)."""
    if not features.prompt_tokens or features.prompt_tokens > SIZES[-1]:
        return features
    size = next(size for size in SIZES if size >= features.prompt_tokens)
    rows = -(-size // query_tile) * query_tile
    return replace(features, prompt_tokens=size,
                   attention=features.attention + (rows - features.prompt_tokens) * features.prefix)


def test_chunks_are_cut_to_what_their_bucket_size_has_room_for():
    """Steps cost their bucket's prompt tokens: the chunk is the most tokens whose step, padded to its
    size, stays within the ratio; no longer chunk does (one past a size costs the next size)."""
    budget = LatencyBudget(2.0, chunk_sizes=SIZES)
    rng = random.Random(11)
    for features in random_steps(300, seed=12):
        features = step_features([500] * 8, rng.randint(1, 700), rng.randint(0, 4000)) if features.prompt_tokens \
            else features
        budget.observe(features, cost(bucketed(features)))
    for contexts, position in (([500] * 8, 0), ([500] * 8, 3000), ([2000] * 16, 0)):
        decode_only = cost(StepFeatures.decodes(contexts))
        chunk = budget.prompt_tokens(contexts, position)

        def step(c):
            return cost(bucketed(step_features(contexts, c, position)))

        assert step(chunk) <= 2.0 * decode_only * (1 + 1e-3), (chunk, contexts, position)
        assert all(step(c) > 2.0 * decode_only for c in range(chunk + 1, 700)), (chunk, contexts, position)


def test_a_chunk_past_a_size_pays_for_the_next_sizes_context_reads():
    """Far into a long prompt, a chunk a few tokens past a size reads the cached context for the next
    size's query rows (the attention kernel's split count is the size's), and a size under the query
    tile for the tile's: the chunk stays at the size below, or fills the next where its room allows;
    every chunk is the most tokens whose step stays within the ratio."""
    tile = 64
    budget = LatencyBudget(2.0, chunk_sizes=SIZES, query_tile=tile)
    assert [budget.attention_rows(size) for size in SIZES] == [64, 64, 128, 256, 512]
    reads = (0.004, 1e-5, 8e-6, 2e-9, 1e-8)  # the cached context's reads dominate far into a prompt
    rng = random.Random(17)
    for _ in range(400):
        contexts = [rng.randint(100, 600) for _ in range(31)]
        features = step_features(contexts, rng.choice([0, rng.randint(1, 600)]), rng.randint(0, 32000))
        budget.observe(features, cost(bucketed(features, tile), reads))
    contexts = [300] * 31
    decode_only = cost(StepFeatures.decodes(contexts), reads)
    chunks = {}
    for position in range(0, 32000, 1000):
        chunk = chunks[position] = budget.prompt_tokens(contexts, position)

        def step(c):
            return cost(bucketed(step_features(contexts, c, position), tile), reads)

        assert step(chunk) <= 2.0 * decode_only * (1 + 1e-3) or chunk == SIZES[0], (chunk, position)
        assert all(step(c) > 2.0 * decode_only for c in range(chunk + 1, 700)), (chunk, position)
    assert {chunks[p] for p in chunks if chunks[p] <= SIZES[-1]} <= set(SIZES)  # whole sizes, none a few past
    assert SIZES[0] in chunks.values() and SIZES[-2] in chunks.values()


def test_chunks_past_the_largest_size_are_not_padded_and_none_is_under_the_smallest():
    """Past the largest size steps run eagerly, computing their own tokens; under the smallest size a
    chunk costs that size whatever it holds, so it takes the size whole."""
    budget = LatencyBudget(2.0, chunk_sizes=SIZES)
    assert budget.padded(129) == 256 and budget.padded(512) == 512 and budget.padded(600) == 600
    for features in random_steps(300, seed=13):
        budget.observe(features, cost(features, (0.1, 0.02, 0.00002, 0.0, 0.0)))  # cheap prompt tokens
    assert budget.prompt_tokens([500] * 8, 0) > SIZES[-1]
    for features in random_steps(300, seed=14):
        budget.observe(features, cost(features, (0.001, 0.0, 1.0, 0.0, 0.0)))  # a prompt token costs a whole second
    assert budget.prompt_tokens([10], 0) == SIZES[0]


ROW_SIZES = (8, 16)  # a CPU's W @ x^T: 9 to 16 rows computed as 16 (punica.ops.linear)


def row_padded(features):
    """What a CPU step runs: its decodes' and prompt tokens' rows in (8, 16] padded to 16."""
    rows = features.num_decodes + features.prompt_tokens
    if features.prompt_tokens and 8 < rows <= 16:
        return replace(features, prompt_tokens=16 - features.num_decodes)
    return features


def test_chunks_whose_rows_fall_in_a_block_take_its_top_or_its_start():
    """Steps cost their rows padded to the block's top (beside 1-7 decodes, a chunk that ends at 9-15
    rows costs what 16 rows cost): the chunk is the most tokens whose padded step stays within the
    ratio; no longer chunk's does."""
    budget = LatencyBudget(2.0, min_chunk=1, row_sizes=ROW_SIZES)
    assert budget.padded(8, num_decodes=1) == 15 and budget.padded(7, num_decodes=1) == 7
    assert budget.padded(20, num_decodes=1) == 20 and budget.padded(3, num_decodes=9) == 7
    rng = random.Random(15)
    coefficients = (0.03, 0.002, 0.004, 1e-6, 2e-6)
    for _ in range(400):
        contexts = [rng.randint(10, 500) for _ in range(rng.randint(1, 7))]
        features = step_features(contexts, rng.choice([0, rng.randint(1, 40)]), rng.randint(0, 4000))
        budget.observe(features, cost(row_padded(features), coefficients))
    seen = set()
    for contexts in ([300], [300] * 3, [300] * 6):
        for position in range(0, 40000, 500):
            decode_only = cost(StepFeatures.decodes(contexts), coefficients)
            chunk = budget.prompt_tokens(contexts, position)

            def step(c):
                return cost(row_padded(step_features(contexts, c, position)), coefficients)

            assert step(chunk) <= 2.0 * decode_only * (1 + 1e-3) or chunk == 1, (chunk, contexts, position)
            assert all(step(c) > 2.0 * decode_only for c in range(chunk + 1, 200)), (chunk, contexts, position)
            rows = len(contexts) + chunk
            seen.add("before" if rows <= 8 else "in" if rows <= 16 else "past")
    assert seen == {"before", "in", "past"}  # chunks before the block, in it and past it


@pytest.mark.parametrize("num_decodes,floor", [(1, 7), (4, 4), (5, 11), (7, 9), (8, MIN_CHUNK), (12, MIN_CHUNK)])
def test_a_floor_whose_rows_fall_in_a_block_moves_to_its_start_or_its_top(num_decodes, floor):
    """With no room for the floor within the ratio (but within its headroom), a chunk of MIN_CHUNK
    tokens beside 1-7 decodes would take 9-15 rows, costing 16: the floor is the block's start where
    that keeps half of it, else its top."""
    budget = LatencyBudget(2.0, row_sizes=ROW_SIZES)
    for features in random_steps(300, seed=16):
        budget.observe(features, cost(features, (0.1, 0.0, 0.013, 0.0, 0.0)))  # 7 prompt tokens fit the ratio
    assert budget.prompt_tokens([100] * num_decodes, 0) == floor

"""`punica serve --workers 2`: the same OpenAI API over two Ray workers."""

import time

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from punica import LLM, SamplingParams
from punica.config import EngineArgs, ModelConfig
from punica.lora.dummy import save_random_adapter
from punica.models.sources import resolve_model_dir
from punica.server.serve import build_state

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # Ray tests share one xdist worker


@pytest.fixture(scope="module")
def cluster_server(adapter_dirs, private_dir, start_server):
    served, loadable = adapter_dirs
    state = build_state(EngineArgs(max_batch_size=4, workers=2), adapters=served)
    state.adapter_dirs = [loadable, private_dir]
    running = start_server(state)
    yield running
    running.stop()


def test_completions_through_two_workers_equal_offline_engine(cluster_server, adapter_dirs):
    client = openai.OpenAI(base_url=cluster_server.url + "/v1", api_key="unused", max_retries=0)
    models = [cluster_server.state.base_model_name, "tenant-0", "tenant-1", "tenant-2"] * 3
    prompts = [f"Item {i}: the weather today" for i in range(len(models))]
    texts = [client.completions.create(model=m, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for m, p in zip(models, prompts)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tenant-1", prompt=prompts[0], max_tokens=6, temperature=0, stream=True))
    llm = LLM(adapters=adapter_dirs[0], max_batch_size=4)
    offline = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0),
                           adapter=[None if m == cluster_server.state.base_model_name else m for m in models])
    assert texts == [o.text for o in offline]
    assert streamed == llm.generate(prompts[0], SamplingParams(max_tokens=6, temperature=0), adapter="tenant-1")[0].text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def served_by_workers(server) -> list[set[str]]:
    return [set(ray.get(actor.adapters.remote())) for actor in server.state.backend.cluster.workers.values()]


def test_adapters_load_and_unload_at_run_time_on_every_worker(cluster_server, adapter_dirs, private_dir):
    served, loadable = adapter_dirs
    http = httpx.Client(base_url=cluster_server.url, timeout=120)
    client = openai.OpenAI(base_url=cluster_server.url + "/v1", api_key="unused", max_retries=0)

    def load(name, path):
        return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})

    def error(response, status):
        assert response.status_code == status, response.text
        return response.json()["error"]["message"]

    broken = private_dir / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{")
    assert "unreadable" in error(load("broken", broken), 400)
    config = ModelConfig.from_dir(resolve_model_dir(None))
    wide = save_random_adapter(private_dir / "wide", config, rank=32, seed=0)  # over the workers' rank 16
    assert "its rank 32 is over this engine's max_lora_rank 16" in error(load("wide", wide), 400)
    assert "already loaded" in error(load("tenant-0", loadable / "extra-1"), 400)
    assert "outside" in error(load("sneaky", served["tenant-0"]), 403)
    assert all(names == set(served) for names in served_by_workers(cluster_server))  # no worker changed

    assert load("extra", loadable / "extra-0").status_code == 200
    assert all(names == {*served, "extra"} for names in served_by_workers(cluster_server))
    assert "extra" in [m.id for m in client.models.list().data]
    prompts = [f"Item {i}: the weather today" for i in range(6)]
    texts = [client.completions.create(model="extra", prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    llm = LLM(adapters={**served, "extra": str(loadable / "extra-0")}, max_batch_size=4)
    offline = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0), adapter="extra")
    assert texts == [o.text for o in offline]
    assert texts != [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))]

    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
    assert all(names == set(served) for names in served_by_workers(cluster_server))
    assert "extra" not in [m.id for m in client.models.list().data]
    assert "does not exist" in error(http.post("/v1/completions", json={"model": "extra", "prompt": "x"}), 404)
    assert "not loaded" in error(http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}), 404)
    r = http.post("/v1/completions", json={"model": "tenant-2", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    http.close()


def test_metrics_count_the_cluster_requests_by_finish_reason(cluster_server):
    with httpx.Client(base_url=cluster_server.url, timeout=120) as http:
        def total(reason: str) -> float:
            for family in text_string_to_metric_families(http.get("/metrics").text):
                for s in family.samples:
                    if s.name == "punica_requests_total" and s.labels == {"adapter": "tenant-1",
                                                                           "finish_reason": reason}:
                        return s.value
            return 0.0

        before = total("length"), total("abort")
        for _ in range(2):
            assert http.post("/v1/completions", json={"model": "tenant-1", "prompt": "Hi",
                                                      "max_tokens": 2}).status_code == 200
        body = {"model": "tenant-1", "prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        deadline = time.monotonic() + 60
        while total("abort") == before[1]:
            assert time.monotonic() < deadline, "the abort was never counted"
            time.sleep(0.05)
        assert (total("length"), total("abort")) == (before[0] + 2, before[1] + 1)


def test_metrics_sum_the_workers_constrained_requests_and_compile_time(cluster_server):
    with httpx.Client(base_url=cluster_server.url, timeout=120) as http:
        def totals() -> tuple[float, float]:
            values = {s.name: s.value for f in text_string_to_metric_families(http.get("/metrics").text)
                      for s in f.samples}
            return values["punica_constrained_requests_total"], values["punica_grammar_compile_seconds_total"]

        constrained, seconds = totals()
        for choices in (["yes", "no"], ["left", "right"]):  # two grammars, one request each
            r = http.post("/v1/completions", json={"model": "tenant-0", "prompt": "Hi", "max_tokens": 3,
                                                   "guided_choice": choices})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] in choices
        now = totals()
        assert now[0] == constrained + 2 and now[1] > seconds


def test_grammars_are_checked_on_the_driver_before_a_worker_sees_them(cluster_server):
    """A grammar the grammar engine refuses, or one over the limits, is a 400 from the driver; a good
    one runs on a worker, which compiles it off its step thread."""
    with httpx.Client(base_url=cluster_server.url, timeout=120) as http:
        def complete(constraint: dict) -> httpx.Response:
            return http.post("/v1/completions", json={"model": "tenant-0", "prompt": "Hi", "max_tokens": 4,
                                                      **constraint})

        refused = complete({"guided_grammar": "root ::= undefined_rule"})
        assert refused.status_code == 400 and "undefined_rule" in refused.json()["error"]["message"]
        schema = {"type": "string"}
        for _ in range(70):
            schema = {"type": "array", "items": schema}
        too_deep = complete({"guided_json": schema})
        assert too_deep.status_code == 400 and "--max-grammar-depth" in too_deep.json()["error"]["message"]
        answered = complete({"guided_regex": "[0-9]{2}"})
        assert answered.status_code == 200 and answered.json()["choices"][0]["text"].isdigit()


def test_adapters_listing_reports_each_worker(cluster_server):
    """Each worker places and evicts adapters on its own: GET /v1/adapters gives its residency per worker."""
    with httpx.Client(base_url=cluster_server.url, timeout=120) as http:
        def admissions() -> int:
            entry = next(a for a in http.get("/v1/adapters").json()["data"] if a["id"] == "tenant-2")
            return sum(w["hits"] + w["misses"] for w in entry["workers"])

        before = admissions()
        for _ in range(3):
            assert http.post("/v1/completions", json={"model": "tenant-2", "prompt": "Hi",
                                                      "max_tokens": 1}).status_code == 200
        listing = http.get("/v1/adapters").json()
        assert admissions() == before + 3
        workers = sorted(cluster_server.state.backend.cluster.workers)
        assert [w["worker"] for w in listing["workers"]] == workers
        assert all(w["gpu_slots"]["total"] == 8 for w in listing["workers"])
        entry = next(a for a in listing["data"] if a["id"] == "tenant-2")
        assert [w["worker"] for w in entry["workers"]] == workers
        assert any(w["tier"] == "gpu" and w["loads"]["gpu"] >= 1 for w in entry["workers"])
        model = next(m for m in http.get("/v1/models").json()["data"] if m["id"] == "tenant-2")
        assert [w["worker"] for w in model["workers"]] == workers
        samples = [s for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples
                   if s.name == "punica_adapter_misses_total" and s.labels["adapter"] == "tenant-2"]
        read = [w["worker"] for w in entry["workers"] if w["tier"] != "disk" or w["loads"]["host"]]
        assert sorted(s.labels["worker"] for s in samples) == [str(w) for w in read]  # a worker that read it

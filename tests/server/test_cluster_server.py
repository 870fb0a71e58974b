"""`punica serve --workers 2`: the same OpenAI API over two Ray workers."""

import openai
import pytest

from conftest import RunningServer
from punica import LLM, SamplingParams
from punica.server.serve import build_state


@pytest.fixture(scope="module")
def cluster_server(adapter_dirs):
    served, _ = adapter_dirs
    state = build_state(adapters=served, max_batch_size=4, workers=2)
    running = RunningServer(state)
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
    with pytest.raises(openai.BadRequestError, match="loading adapters at run time is"):
        client.post("/load_lora_adapter", body={"lora_name": "x", "lora_path": "/tmp"}, cast_to=object)

"""The prefix cache is private (fp32, CPU, tiny model): a request finds only pages that requests of
its own tenant and cache salt computed, so cached_tokens and time to first token say nothing of
other tenants' prompts."""

import pytest

from punica.engine.kv_cache import namespace
from punica.engine.request import Request
from punica.engine.sampling_params import SamplingParams

PROMPT = list(range(5, 29))  # 24 tokens: 6 pages of 4, of which a repeat finds 5 (short of the last token)


def cached_tokens(engine, adapter=None, tenant=None, cache_salt=None, prompt=PROMPT):
    """The prompt tokens the prefix cache held for a request (what the server reports as
    usage.prompt_tokens_details.cached_tokens), run to its end."""
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), adapter,
                                    tenant=tenant, cache_salt=cache_salt)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                result = out
    assert result.finish_reason == "length"
    return result.num_cached_tokens


@pytest.mark.parametrize("adapter", [None, "a"])
def test_a_tenant_never_finds_another_tenants_prompt_in_the_cache_and_finds_its_own(setup, make_engine, adapter):
    engine = make_engine(setup, max_batch_size=4, page_size=4)
    assert cached_tokens(engine, adapter, tenant="A") == 0
    assert cached_tokens(engine, adapter, tenant="A") == 20, "A's own repeat hits the cache"
    assert cached_tokens(engine, adapter, tenant="B") == 0, "B guessing A's exact prompt learns nothing"
    assert cached_tokens(engine, adapter) == 0, "nor a request without a tenant"
    assert cached_tokens(engine, adapter, tenant="B") == 20
    assert cached_tokens(engine, adapter) == 20, "without tenants, requests share as before"


def test_requests_share_cached_pages_only_with_equal_cache_salts(setup, make_engine):
    engine = make_engine(setup, max_batch_size=4, page_size=4)
    assert cached_tokens(engine, tenant="B", cache_salt="s1") == 0
    assert cached_tokens(engine, tenant="B", cache_salt="s1") == 20
    assert cached_tokens(engine, tenant="B", cache_salt="s2") == 0
    assert cached_tokens(engine, tenant="B") == 0, "no salt is a salt of its own"
    assert cached_tokens(engine, tenant="C", cache_salt="s1") == 0, "a salt is not shared across tenants"
    assert cached_tokens(engine, cache_salt="s1") == 0
    assert cached_tokens(engine, cache_salt="s1") == 20


def test_namespaces_differ_by_tenant_and_salt_and_are_as_before_without_either():
    def name(tenant, salt):
        return namespace(Request("r", [1], SamplingParams(), tenant=tenant, cache_salt=salt))

    assert name(None, None) == b"base"
    variants = [(None, None), ("a", None), (None, "a"), ("a", "a"), ("a", "b"), ("b", "a"), ("", None), (None, ""),
                ('a", "b', None), ("a", '", "b'), ("a\0", None), ("base", None)]
    assert len({name(tenant, salt) for tenant, salt in variants}) == len(variants)

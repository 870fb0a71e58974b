"""Adapter residency for routers: the body of GET /v1/adapters (whose entries' fields /v1/models
adds to its adapters), and its Prometheus series.

One engine's listing is its AdapterManager.snapshot, each adapter an entry of `data`. A cluster
has one manager per worker, which place and evict on their own: its listing gives each adapter's
residency per worker (`workers`: the worker's id and the same fields), and each worker's slot and
host-tier totals, as the workers report them when asked.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

RESIDENCY_TIERS = ("gpu", "host", "disk")
LISTING_KEYS = ("id", "object", "path")  # of an entry; the others are the residency fields


def engine_listing(snapshot: dict) -> dict:
    """GET /v1/adapters of one engine, from its AdapterManager.snapshot()."""
    data = [{"id": name, "object": "adapter", **fields} for name, fields in sorted(snapshot["adapters"].items())]
    return {"object": "list", "gpu_slots": snapshot["gpu_slots"], "host_tier": snapshot["host_tier"], "data": data}


def cluster_listing(paths: dict[str, str], snapshots: dict[int, dict | BaseException]) -> dict:
    """GET /v1/adapters of a cluster serving `paths` (name -> directory), from each worker's
    snapshot (by worker id; an exception for a worker that did not answer)."""
    workers, per_adapter = [], {name: [] for name in paths}
    for worker, snapshot in sorted(snapshots.items()):
        if isinstance(snapshot, BaseException):
            workers.append({"worker": worker, "error": f"the worker did not report its adapters: {snapshot}"})
            continue
        workers.append({"worker": worker, "gpu_slots": snapshot["gpu_slots"], "host_tier": snapshot["host_tier"]})
        for name, fields in snapshot["adapters"].items():
            if name in per_adapter:  # an adapter being loaded or unloaded may be on some workers only
                per_adapter[name].append({"worker": worker, **{k: v for k, v in fields.items() if k != "path"}})
    data = [{"id": name, "object": "adapter", "path": paths[name], "workers": per_adapter[name]}
            for name in sorted(paths)]
    return {"object": "list", "workers": workers, "data": data}


class ResidencyCollector:
    """The Prometheus series of the last listing `update` was given (the /metrics handler gives it a
    fresh one before each scrape): per adapter (label `adapter`, and `worker` on a cluster) its
    residency tier, loads, evictions, load seconds, hits and misses; per engine its host tier's bytes.
    An adapter never read (tier disk, nothing loading, no loads) has no series, so the series grow
    with the adapters in use, not with those registered. A name unloaded and loaded again counts
    from 0 (a counter reset)."""

    def __init__(self):
        self.listing: dict = {"data": []}

    def update(self, listing: dict) -> None:
        self.listing = listing

    def collect(self):
        listing = self.listing  # one listing for the whole scrape, whatever `update` does meanwhile
        cluster = "workers" in listing
        names = ["adapter", "worker"] if cluster else ["adapter"]
        tier = GaugeMetricFamily("punica_adapter_tier", "1 for the tier the adapter is in (gpu: a GPU slot, "
                                 "host: the host tier, disk: neither), 0 for the others", labels=[*names, "tier"])
        loads = CounterMetricFamily("punica_adapter_loads", "Loads into a tier (host: read from disk, gpu: "
                                    "copied from the host tier)", labels=[*names, "tier"])
        evictions = CounterMetricFamily("punica_adapter_evictions", "Evictions from a tier (its host row or GPU "
                                        "slot taken for another adapter)", labels=[*names, "tier"])
        seconds = CounterMetricFamily("punica_adapter_load_seconds", "Time from the start of each load into a "
                                      "tier until the engine took it in", labels=[*names, "tier"])
        hits = CounterMetricFamily("punica_adapter_hits", "Requests admitted on the GPU residency of the adapter "
                                   "they were queued on", labels=names)
        misses = CounterMetricFamily("punica_adapter_misses", "Requests admitted after a load of their adapter",
                                     labels=names)
        for labels, fields in _adapters_in_use(listing, cluster):
            for t in RESIDENCY_TIERS:
                tier.add_metric([*labels, t], float(fields["tier"] == t))
            for t, count in fields["loads"].items():
                loads.add_metric([*labels, t], count)
                evictions.add_metric([*labels, t], fields["evictions"][t])
                seconds.add_metric([*labels, t], fields["load_seconds"][t])
            hits.add_metric(labels, fields["hits"])
            misses.add_metric(labels, fields["misses"])
        yield from (tier, loads, evictions, seconds, hits, misses)
        yield from _host_tier(listing, cluster)


def _adapters_in_use(listing: dict, cluster: bool):
    """(label values, residency fields) of each adapter (on each worker) that has left the disk."""
    for entry in listing["data"]:
        for labels, fields in ([([entry["id"], str(w["worker"])], w) for w in entry["workers"]] if cluster
                               else [([entry["id"]], entry)]):
            if fields["tier"] != "disk" or fields["loading"] is not None or any(fields["loads"].values()):
                yield labels, fields


def _host_tier(listing: dict, cluster: bool):
    engines = ([([str(w["worker"])], w["host_tier"]) for w in listing["workers"] if "host_tier" in w]
               if cluster else [([], listing["host_tier"])] if "host_tier" in listing else [])
    names = ["worker"] if cluster else []
    used = GaugeMetricFamily("punica_lora_host_tier_bytes_used", "Bytes of the host tier holding adapters "
                             "(or being read into)", labels=names)
    limit = GaugeMetricFamily("punica_lora_host_tier_bytes_limit", "Bytes of the host tier", labels=names)
    for labels, host in engines:
        used.add_metric(labels, host["bytes_used"])
        limit.add_metric(labels, host["bytes_limit"])
    yield from (used, limit)

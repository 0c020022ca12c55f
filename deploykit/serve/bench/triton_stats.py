"""Triton's per-model inference statistics over one level: a snapshot before, one after, the
difference per model (what ``perf_analyzer`` prints as its server-side breakdown).

A snapshot is Triton's statistics extension as JSON (``GET /v2/models/stats``, or gRPC
``ModelStatistics`` through tritonclient's ``as_json=True``): protobuf's JSON mapping, so 64-bit
counters arrive as strings and zero fields are left out.
"""

from __future__ import annotations

from deploykit._lazy import lazy_import
from deploykit.serve.bench.records import ModelStats

# inference_stats' durations (each ``{"count", "ns"}``) in ModelStats' order
PHASES = ("queue", "compute_input", "compute_infer", "compute_output")


def _key(model: dict) -> tuple[str, str]:
    return model.get("name", ""), model.get("version", "")


def _count(stats: dict, *path: str) -> int:
    for key in path:
        stats = stats.get(key, {})
    return int(stats or 0)


def model_stats_delta(before: dict, after: dict) -> tuple[ModelStats, ...]:
    """Per model that answered requests between the snapshots (``{"model_stats": [...]}``
    each), its request, execution and inference counts and its mean time per request in each
    phase, sorted by model name."""
    earlier = {_key(m): m for m in before.get("model_stats", [])}
    out = []
    for model in after.get("model_stats", []):
        old = earlier.get(_key(model), {})
        requests = _count(model, "inference_stats", "success", "count") - _count(old, "inference_stats", "success", "count")
        if requests <= 0:
            continue
        per_request_ms = {
            f"{phase}_ms": (_count(model, "inference_stats", phase, "ns") - _count(old, "inference_stats", phase, "ns")) / requests / 1e6
            for phase in PHASES
        }
        out.append(
            ModelStats(
                model=model.get("name", ""),
                requests=requests,
                executions=_count(model, "execution_count") - _count(old, "execution_count"),
                inferences=_count(model, "inference_count") - _count(old, "inference_count"),
                **per_request_ms,
            )
        )
    return tuple(sorted(out, key=lambda m: m.model))


def snapshot(grpc_url: str) -> dict:
    """Every model's statistics now (tritonclient over gRPC)."""
    client = lazy_import("tritonclient.grpc").InferenceServerClient(grpc_url)
    return client.get_inference_statistics("", as_json=True)

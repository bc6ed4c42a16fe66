"""Prometheus text parsed as the scraper parses it: `# HELP` lines are not samples."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name (with `_bucket`, `_count`, `_total` suffixes) -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out

"""What an operator's dashboards and a client read is what the docs name: every metric the
router and the pools export, and every field of a response's statistics (`speculative` and
vLLM's `metrics.speculative_decoding`), is named in the docs, and every metric the docs name
is exported (a dashboard built from the docs would read a series nobody writes)."""

import re
from pathlib import Path

from deployments import metrics as metrics_module
from speculative.stats import SpecStats

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a metric name as the docs write it: in backticks, without Ray's `ray_` prefix
DOCUMENTED_METRIC = re.compile(r"`((?:spec_decode|specserve)_\w+)")


def docs_text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def exported_metrics(monkeypatch) -> set[str]:
    """The names RouterMetrics and PoolMetrics give Ray's metric classes (stood in for)."""
    names = set()

    class Metric:
        def __init__(self, name, **_):
            names.add(name)

    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics_module, kind, Metric)
    metrics_module.RouterMetrics()
    metrics_module.PoolMetrics("verifier")
    return names


def test_the_docs_name_every_exported_metric_and_no_other(monkeypatch):
    exported, text = exported_metrics(monkeypatch), docs_text()
    assert set(DOCUMENTED_METRIC.findall(text)) <= exported
    # vLLM's request metrics keep vLLM's names, without a prefix the pattern could find
    named = set(re.findall(r"`(\w+)[`{]", text))  # a name, or a name{its tags}
    assert sorted(exported - named) == []


def test_the_docs_name_every_field_of_a_responses_statistics():
    stats, text = SpecStats(), docs_text()
    fields = [*stats.as_dict(), *stats.vllm_metrics()["speculative_decoding"]]
    assert [name for name in fields if f"`{name}`" not in text] == []

"""The plugin's metrics (``server/metrics.py``) and the Grafana dashboard
that reads them beside vLLM's (``dashboards/vllm-pamer.json``): every panel
queries a metric the plugin or the installed vLLM exports, with the suffix
its type exports, and the file has what Grafana's import reads."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from prometheus_client import Counter, Histogram

from vllm_pamer.server import metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "vllm-pamer.json"
METRIC = re.compile(r"\b(vllm_pamer_[a-z0-9_]+|vllm:[a-z0-9_]+)")
SUFFIXES = {Counter: ("_total",), Histogram: ("_bucket", "_count", "_sum")}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _queried() -> set[str]:
    return {name for p in _dashboard()["panels"] for t in p.get("targets", []) for name in METRIC.findall(t["expr"])}


def _plugin_names() -> set[str]:
    """What the plugin exports: each counter's ``_total``, each histogram's ``_bucket`` / ``_count`` / ``_sum``."""
    names = set()
    for value in vars(metrics).values():
        for kind, suffixes in SUFFIXES.items():
            if isinstance(value, kind):
                names |= {value._name + suffix for suffix in suffixes}
    return names


def _vllm_names() -> set[str]:
    """The metric names in the installed vLLM's Prometheus logger (read as
    text: only the adapters import vLLM)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    text = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    return set(re.findall(r'"(vllm:[a-z0-9_]+)"', text))


def test_every_panel_queries_a_metric_the_plugin_or_vllm_exports():
    queried, plugin, vllm = _queried(), _plugin_names(), _vllm_names()
    assert len(vllm) > 20 and {"vllm_pamer_requests_total", "vllm_pamer_request_wait_seconds_bucket"} <= plugin
    unknown = set()
    for name in queried:
        if name.startswith("vllm:"):
            base = re.sub(r"_(total|bucket|count|sum)$", "", name)
            if base not in vllm and name not in vllm:
                unknown.add(name)
        elif name not in plugin:
            unknown.add(name)
    assert not unknown, f"the dashboard queries metrics nobody exports: {sorted(unknown)}"


def test_every_plugin_metric_has_a_panel():
    families = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in _plugin_names()}
    shown = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in _queried()}
    assert families - shown == set()


def test_the_dashboard_is_what_grafana_imports():
    """The fields Grafana's import reads: a title and uid, a schema version,
    the Prometheus data source as an import input, panels with unique ids on
    the 24-column grid, each query with its own refId."""
    dashboard = _dashboard()
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    [source] = dashboard["__inputs"]
    assert source["type"] == "datasource" and source["pluginId"] == "prometheus"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and all(isinstance(grid[k], int) for k in "hwxy")
        assert (grid["x"], grid["y"]) not in cells
        cells.add((grid["x"], grid["y"]))
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries" and panel["datasource"]["uid"] == "${" + source["name"] + "}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs) and all(t["expr"] for t in panel["targets"])

"""deploy/grafana: the dashboard's shape and the example scrape config, without a stack.

That every metric name it uses is one the server exposes is checked against a live stack in
tests/deploy/test_alerts.py, beside the rules' own check."""

from __future__ import annotations

import json
import re

import yaml

from frontend import metrics as frontend_metrics
from gpu_workers import metrics as worker_metrics
from shmserve import nginx_stats, reaper
from shmserve.config import REPO_ROOT

GRAFANA = REPO_ROOT / "deploy" / "grafana"


def dashboard() -> dict:
    return json.loads((GRAFANA / "shmserve.json").read_text())


def declared_metrics() -> dict[str, set[str]]:
    """Every sample name the code declares (what a scrape can show), with its labels."""
    names = {name: {"program"} for name in ("shmserve_process_resident_memory_bytes",
                                            "shmserve_process_open_fds",
                                            "shmserve_process_max_fds")}  # read at scrape time
    names.update({name: {"volume"} for name in ("shmserve_filesystem_avail_bytes",
                                                "shmserve_filesystem_size_bytes")})
    for module in (frontend_metrics, worker_metrics, reaper, nginx_stats):
        for value in vars(module).values():
            if hasattr(value, "_type") and hasattr(value, "_name"):
                base, labels = value._name, set(value._labelnames)
                names.update({"counter": {f"{base}_total": labels}, "gauge": {base: labels},
                              "histogram": {f"{base}_bucket": labels | {"le"},
                                            f"{base}_sum": labels,
                                            f"{base}_count": labels}}[value._type])
    return names


def test_every_panel_queries_prometheus_with_unique_ids():
    dash = dashboard()
    assert dash["uid"] == "shmserve" and dash["title"] == "shmserve"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"]["type"] == "prometheus", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_the_dashboard_covers_what_operators_ask():
    text = json.dumps(dashboard())
    titles = " ".join(p["title"].lower() for p in dashboard()["panels"])
    for topic in ("throughput", "p50", "p99", "stage", "batch size", "padding", "queue depth",
                  "memory", "by priority"):
        assert topic in titles, topic
    for name in ("shmserve_worker_device_fragmentation_ratio", "shmserve_worker_ready",
                 "shmserve_stage_duration_seconds_bucket",
                 "shmserve_tls_expiry_timestamp_seconds", "shmserve_api_keys_file_refused"):
        assert name in text


def test_the_dashboard_uses_only_declared_metrics():
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"\bshmserve_[a-z0-9_]+", e)}
    declared = set(declared_metrics())
    assert used <= declared, sorted(used - declared)


def test_the_scrape_config_targets_nginx_metrics():
    cfg = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8080"]


def test_every_query_is_filtered_by_instance_and_keeps_hosts_apart():
    """Every pod (host) has a worker 0 and a frontend 0: the dashboard's per-worker and
    per-frontend series keep `instance` apart, and its instance variable filters every
    selector (an outside check found both pods' worker 0 folded into one series)."""
    dash = dashboard()
    (variable,) = [v for v in dash["templating"]["list"] if v["name"] == "instance"]
    assert variable["includeAll"] and variable["multi"]
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for selector in re.findall(r"\bshmserve_[a-z0-9_]+(\{[^}]*\})?", expr):
                assert selector.startswith('{instance=~"$instance"'), expr
            for labels in re.findall(r"by \(([^)]*)\)", expr):
                names = {name.strip() for name in labels.split(",")}
                if names & {"worker", "frontend"}:
                    assert "instance" in names, expr
            if re.search(r"\{\{(worker|frontend|program)\}\}", target.get("legendFormat", "")):
                assert "{{instance}}" in target["legendFormat"], target


def test_latency_panels_show_answered_requests_and_models_the_served_revisions():
    """Under overload the fast 429s are most of a latency histogram's count: a latency panel
    over every status read a p50 of 68 us while served requests took ~150 ms (an outside check
    against a real Prometheus), so every latency quantile of the request histograms selects
    the 2xx; and "models served" lists each worker's revisions at 1 (a hot reload leaves the
    old one's series at 0, which the table listed too)."""
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    latency = [e for e in exprs if re.search(
        r"shmserve_(inference_)?request_duration_seconds_bucket", e)]
    assert latency and all('status=~"2.."' in e for e in latency), latency
    (served,) = [t["expr"] for p in dashboard()["panels"] if p["title"] == "Models served"
                 for t in p["targets"]]
    assert served.replace(" ", "").endswith("==1"), served

"""deploy/grafana/alerts.yml, Prometheus's alerting rules: each parses as PromQL (the grammar
Prometheus's own parser implements, through promql-parser), and names only metrics the server
declares, with only their labels: a rule on a misspelt metric or label selects nothing and never
fires, and nothing says so; and against a live exposition, the suite's tiny stack. And when each
fires: Prometheus's own rule tests (`promtool test rules`, deploy/grafana/alerts_test.yml) on
series written as a deployment's scrapes write them."""

from __future__ import annotations

import re
import shutil
import subprocess

import promql_parser as promql
import pytest
import yaml

from gpu_workers.metrics import DEVICE_ONLY
from shmserve import reaper
from shmserve.config import REPO_ROOT
from tests.deploy.test_grafana import dashboard, declared_metrics

ALERTS = REPO_ROOT / "deploy" / "grafana" / "alerts.yml"
RULE_TESTS = ALERTS.parent / "alerts_test.yml"
# Labels every scraped series has (Prometheus's target labels), and Prometheus's own `up`
TARGET_LABELS = {"instance", "job"}
PROMETHEUS_SERIES = {"up": {"instance", "job"}}
# Series a deployment exposes only with a feature on, checked live where it is (the suite's
# tiny stack has no TLS: tests/e2e/test_mtls.py scrapes the TLS files' dates)
FEATURE_SERIES = set(reaper.TLS_ONLY)


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"]
            for rule in group["rules"]]


def declared_labels() -> dict[str, set[str]]:
    """Every sample name the code declares, with its labels, and Prometheus's `up`; the target
    labels added to each."""
    names = {**declared_metrics(), **PROMETHEUS_SERIES}
    return {name: labels | TARGET_LABELS for name, labels in names.items()}


def selectors(expr) -> list[tuple[promql.VectorSelector, set[str]]]:
    """Each series selector in `expr` (its metric `.name`, its `.matchers.matchers`), with the
    labels of the innermost aggregation around it (`by (...)`)."""
    found = []

    def walk(node, grouping: set[str]) -> None:
        if isinstance(node, promql.VectorSelector):
            found.append((node, grouping))
        elif isinstance(node, promql.MatrixSelector):
            walk(node.vector_selector, grouping)
        elif isinstance(node, promql.AggregateExpr):
            labels = set(node.modifier.labels) if node.modifier is not None else set()
            walk(node.expr, labels)
        elif isinstance(node, promql.BinaryExpr):
            walk(node.lhs, grouping)
            walk(node.rhs, grouping)
        elif isinstance(node, promql.Call):
            for arg in node.args:
                walk(arg, grouping)
        elif isinstance(node, (promql.ParenExpr, promql.UnaryExpr, promql.SubqueryExpr)):
            walk(node.expr, grouping)

    walk(expr, set())
    return found


@pytest.mark.parametrize("rule", rules(), ids=lambda rule: rule["alert"])
def test_each_rule_parses_and_names_only_declared_metrics_and_labels(rule):
    assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
    assert rule["alert"].startswith("Shmserve") and rule["labels"]["severity"] in (
        "critical", "warning")
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    expr = promql.parse(rule["expr"])  # ValueError where it does not parse
    declared = declared_labels()
    found = selectors(expr)
    assert found, rule["expr"]
    for node, grouping in found:
        name, matched = node.name, {m.name for m in node.matchers.matchers}
        assert name in declared, f"{rule['alert']}: no metric {name}"
        unknown = (matched | grouping) - declared[name]
        assert not unknown, f"{rule['alert']}: {name} has no label {sorted(unknown)}"
        # every host's series apart (each has a worker 0): the instance is kept
        assert not grouping or "instance" in grouping, f"{rule['alert']}: by {grouping}"


def test_the_rules_cover_what_takes_a_deployment_down():
    names = {rule["alert"] for rule in rules()}
    assert {"ShmserveDown", "ShmserveNoWorkerReady", "ShmserveCrashLooping",
            "ShmserveCrashingInput", "ShmserveServerErrors", "ShmserveSharedMemoryFull"} <= names
    assert len(names) == len(rules())  # one rule a name


def test_a_rule_on_a_misspelt_metric_or_label_is_caught():
    declared = declared_labels()
    for expr, wrong in (('sum by (instance) (rate(shmserve_request_total[5m]))',
                         "shmserve_request_total"),
                        ('max by (instance, wroker) (shmserve_worker_ready)', "wroker"),
                        ('shmserve_frontend_refused_total{reson="shm_full"}', "reson")):
        (node, grouping), = selectors(promql.parse(expr))
        matched = {m.name for m in node.matchers.matchers}
        assert node.name not in declared or wrong in (matched | grouping) - declared[node.name]
    with pytest.raises(ValueError):
        promql.parse("sum(rate(shmserve_requests_total[5m])")


def test_the_scrape_config_loads_the_rules_beside_it():
    cfg = yaml.safe_load((ALERTS.parent / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml"]
    assert {job["job_name"] for job in cfg["scrape_configs"]} == {"shmserve"}
    assert all('job="shmserve"' in rule["expr"] for rule in rules() if "up{" in rule["expr"])


def test_the_rules_select_series_a_live_stack_exposes(tiny_stack):
    """Every metric a rule names is in a live scrape, and so is every series a rule picks by
    an enumerated label (a reason, an outcome, a volume), with its zero before anything
    happened (a rule's `increase` needs the series to exist before its first count)."""
    from tests.e2e.test_observability import scrape

    assert tiny_stack.post_json("/predict", {"texts": ["for the alerts"]})[0] == 200
    exposed = scrape(tiny_stack)
    for rule in rules():
        for node, _ in selectors(promql.parse(rule["expr"])):
            if node.name in PROMETHEUS_SERIES or node.name in FEATURE_SERIES:
                continue
            assert node.name in exposed, (rule["alert"], node.name)
            for matcher in node.matchers.matchers:
                if matcher.op == promql.MatchOp.Equal and matcher.name in (
                        "reason", "outcome", "volume", "expected"):
                    assert any(labels.get(matcher.name) == matcher.value
                               for labels, _ in exposed[node.name]), (rule["alert"], matcher)


def test_dashboard_refers_only_to_exposed_metrics(tiny_stack):
    """Every metric the Grafana dashboard names is in a live scrape (but the GPU workers'
    gauges and the TLS files' dates, which a plain CPU stack has not)."""
    from tests.e2e.test_observability import scrape

    assert tiny_stack.post_json("/predict", {"texts": ["for the dashboard"]})[0] == 200
    # device gauges: GPU workers only; the TLS files' dates: with TLS on (tests/e2e/test_mtls)
    exposed = set(scrape(tiny_stack)) | set(DEVICE_ONLY) | set(reaper.TLS_ONLY)
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    used = {name for e in exprs for name in re.findall(r"\bshmserve_[a-z0-9_]+", e)}
    assert used and used <= exposed, sorted(used - exposed)


def promtool(*args: str, cwd=None) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    assert tool, "promtool (Prometheus's) is not installed: scripts/install --test installs it"
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules_and_their_templates():
    done = promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0 and f"SUCCESS: {len(rules())} rules found" in done.stdout, (
        done.stdout + done.stderr)


def test_each_alert_fires_when_it_should_in_promtools_rule_tests():
    """promtool's unit tests of the rules (deploy/grafana/alerts_test.yml), run as a user runs
    them: each case holds a rule to what an outside check found against a real Prometheus (a
    crash loop counted from commanded restarts and missed when a worker never got ready, an
    outage's 502s never alerted, a flood of 429s pulling the latency p99 down, clients' short
    deadlines paging), and each firing alert's annotations as rendered."""
    done = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    tested = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in test["alert_rule_test"]}
    assert {"ShmserveCrashLooping", "ShmserveNginxErrors", "ShmserveDown",
            "ShmserveServerErrors", "ShmserveDeadlinesExceeded", "ShmserveLatencyHigh",
            "ShmserveNoWorkerReady", "ShmserveTlsExpiring", "ShmserveTlsExpired",
            "ShmserveApiKeysFileRefused"} <= tested
    assert tested <= {rule["alert"] for rule in rules()}

"""The Grafana dashboard and Prometheus alert rules in configs/ against what a real daemon
exports, docs/operations.md's metrics table against it, the exposition itself, and the JSON
log format."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cachexferd.launch import DaemonProcess

from .helpers import REPO

DASHBOARD = REPO / "configs" / "grafana-dashboard.json"
ALERTS = REPO / "configs" / "prometheus-alerts.yml"
FROM_PROMETHEUS = {"up"}  # series Prometheus itself adds to every scrape target
Spawn = Callable[..., DaemonProcess]


@pytest.fixture
def exposition(spawn_daemon: Spawn) -> str:
    url = spawn_daemon().status()["metrics_url"]
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
    return text


def sample_names(exposition: str) -> set[str]:
    """Every series name the daemon can export, also of families with no series yet."""
    names = set()
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.MULTILINE):
        names.add(family)
        if kind == "histogram":
            names |= {f"{family}_bucket", f"{family}_sum", f"{family}_count"}
    return names


def metric_names(expr: str) -> set[str]:
    """Names used as series selectors in a PromQL expression (a name before { or a range)."""
    return set(re.findall(r"\b((?:cachexferd|process)_[a-z0-9_]+|[a-z_]+(?=\{))", expr)) - {"by", "on"}


def dashboard_exprs() -> Iterator[str]:
    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                yield node["expr"]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    yield from walk(json.loads(DASHBOARD.read_text()))


def alert_exprs() -> list[str]:
    """The expr of each rule (multi-line block scalars included), read without a YAML library."""
    exprs: list[str] = []
    current: list[str] | None = None
    for line in ALERTS.read_text().splitlines():
        if current is not None and (line.startswith(" " * 10) or not line.strip()):
            current.append(line.strip())
            continue
        if current is not None:
            exprs.append(" ".join(current))
            current = None
        if line.strip().startswith("expr:"):
            rest = line.split("expr:", 1)[1].strip()
            current = [] if rest == "|" else None
            if current is None:
                exprs.append(rest)
    return exprs


def test_no_created_series(exposition: str) -> None:
    assert "_created" not in exposition


def test_dashboard_uses_only_exported_metrics(exposition: str) -> None:
    known = sample_names(exposition)
    exprs = list(dashboard_exprs())
    assert len(exprs) >= 15
    used = set().union(*(metric_names(e) for e in exprs))
    assert used - known - FROM_PROMETHEUS == set(), f"not exported by the daemon: {used - known}"
    for family in ("cachexferd_transfer_bytes_total", "cachexferd_command_duration_seconds_bucket",
                   "cachexferd_commands_total", "cachexferd_host_cache_ready_bytes",
                   "cachexferd_storage_errors_total", "cachexferd_attached_device_caches",
                   "cachexferd_batched_commands_total", "cachexferd_grouped_swaps_total"):  # fmt: skip
        assert family in used, f"the dashboard does not show {family}"


def test_operations_doc_lists_every_exported_family_and_no_other(exposition: str) -> None:
    documented = set(
        re.findall(r"^\| `(cachexferd_[a-z0-9_]+)` \|", (REPO / "docs" / "operations.md").read_text(), re.M)
    )
    exported = {f for f in re.findall(r"^# TYPE (\S+) ", exposition, re.M) if f.startswith("cachexferd_")}
    assert len(documented) >= 15
    assert exported - documented == set(), "exported, not in docs/operations.md's metrics table"
    assert documented - exported == set(), "in docs/operations.md's metrics table, not exported"


def test_dashboard_is_importable_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance"} <= names
    graphs = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["title"] for p in graphs}) == len(graphs), "panel titles repeat"
    for panel in graphs:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"] and panel["gridPos"]["w"] > 0


def test_alert_rules_use_only_exported_metrics(exposition: str) -> None:
    exprs = alert_exprs()
    assert len(exprs) == ALERTS.read_text().count("- alert:")
    used = set().union(*(metric_names(e) for e in exprs))
    assert used - sample_names(exposition) - FROM_PROMETHEUS == set()


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        if os.environ.get("CI") == "true":
            raise AssertionError("promtool missing in CI (scripts/install-test-tools.sh installs it)")
        pytest.skip("promtool not installed (scripts/install-test-tools.sh)")
    return tool


def test_promtool_checks_the_rules() -> None:
    result = subprocess.run([_promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# Two rules fed with series over time: they fire when they should, and stay quiet otherwise.
_RULE_TESTS = textwrap.dedent(
    """
    rule_files: [{rules}]
    evaluation_interval: 1m
    tests:
      - interval: 1m
        input_series:
          - series: 'cachexferd_imported_mappings{{instance="gpu0"}}'
            values: '2x10'
          - series: 'cachexferd_attached_device_caches{{instance="gpu0"}}'
            values: '1 1 0x8'
          - series: 'cachexferd_commands_total{{instance="gpu0",op="swap_in",outcome="ok"}}'
            values: '0+60x20'
          - series: 'cachexferd_commands_total{{instance="gpu0",op="swap_in",outcome="id_out_of_range"}}'
            values: '0+30x20'
        alert_rule_test:
          - eval_time: 3m
            alertname: CachexferdMappingsLeft
            exp_alerts: []
          - eval_time: 9m
            alertname: CachexferdMappingsLeft
            exp_alerts:
              - exp_labels: {{severity: critical, instance: gpu0}}
                exp_annotations:
                  summary: "gpu0 still maps 2 device allocations with no cache attached"
                  description: "{mappings}"
          - eval_time: 18m
            alertname: CachexferdCommandErrors
            exp_alerts:
              - exp_labels: {{severity: warning, instance: gpu0}}
                exp_annotations:
                  summary: "33.33% of transfer commands fail on gpu0"
                  description: "{errors}"
    """
)


_MAPPINGS_TEXT = (
    "GPU memory of a detached runner is still mapped by the daemon and cannot be freed. "
    "Restart the daemon (systemctl restart cachexferd@RANK)."
)
_ERRORS_TEXT = (
    "See cachexferd_commands_total by outcome for the error codes, and the daemon's log at debug level for details."
)


def test_promtool_unit_tests_of_two_alerts(tmp_path: Path) -> None:
    tool = _promtool()
    tests = tmp_path / "alerts-test.yml"
    tests.write_text(_RULE_TESTS.format(rules=ALERTS, mappings=_MAPPINGS_TEXT, errors=_ERRORS_TEXT))
    result = subprocess.run([tool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_json_log_format(spawn_daemon: Spawn) -> None:
    daemon = spawn_daemon(settings={"daemon.log_format": "json"})
    assert daemon.stop() == 0
    entries = [json.loads(line) for line in daemon.log_path.read_text().splitlines() if line.strip()]
    assert {"ts", "level", "rank", "pid", "logger", "msg"} <= set(entries[0])
    messages = [e["msg"] for e in entries]
    assert any(m.startswith("effective config: ") for m in messages)
    assert any(" serving on ipc://" in m for m in messages) and messages[-1] == "stopped"

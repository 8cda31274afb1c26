"""docs/operations.md's sidecar example ("Health probes and Kubernetes") against the real
thing: its cachexferd command line parsed by the real CLI and its configuration loaded, its
probes' paths and port checked against that configuration and answered over HTTP by a daemon
started with the same options, its shared volumes against the daemon's runtime directory,
/dev/shm and the vLLM plug-in's endpoint, its memory against the daemon's start-up check."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from cachexferd.backends.cpu import SHM_DIR
from cachexferd.cli import _overrides, build_parser
from cachexferd.config import Config, load_config
from cachexferd.launch import DaemonProcess
from cachexferd.preflight import _DAEMON_OVERHEAD
from cachexferd.units import human_bytes

from .helpers import REPO

DOC = REPO / "docs" / "operations.md"
Spawn = Callable[..., DaemonProcess]
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3, "M": 10**6, "G": 10**9, "": 1}


def manifests() -> list[dict[str, Any]]:
    section = DOC.read_text().split("## Health probes and Kubernetes", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "one YAML example in the section"
    return [doc for doc in yaml.safe_load_all(blocks[0]) if doc]


def pod() -> dict[str, Any]:
    found = [m for m in manifests() if m["kind"] == "Pod"]
    assert len(found) == 1
    spec: dict[str, Any] = found[0]["spec"]
    return spec


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def daemon_config(sidecar: dict[str, Any]) -> tuple[dict[str, Any], Config]:
    """The sidecar's command line through the real parser: its overrides and its config."""
    argv = [str(a) for a in [*sidecar["command"], *sidecar["args"]]]
    assert argv[:2] == ["cachexferd", "serve"], argv
    args = build_parser().parse_args(argv[1:])
    overrides = _overrides(args)
    return overrides, load_config(args.config, overrides, environ={})


def quantity(text: str) -> int:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text)).groups()  # type: ignore[union-attr]
    return int(float(number) * _UNITS[unit])


def mounts(c: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}


def test_the_sidecar_starts_first_and_its_options_are_real() -> None:
    spec = pod()
    sidecar = container(spec, "cachexferd")
    assert sidecar in spec["initContainers"] and sidecar["restartPolicy"] == "Always", "a native sidecar"
    _, config = daemon_config(sidecar)
    assert config.daemon.expect_runner, "readiness waits for the runner"
    assert config.metrics.enabled and config.metrics.host == "0.0.0.0", "the kubelet probes the pod's address"
    assert spec["terminationGracePeriodSeconds"] > config.daemon.drain_timeout_s


def test_the_probes_name_the_daemons_port_and_paths() -> None:
    sidecar = container(pod(), "cachexferd")
    _, config = daemon_config(sidecar)
    probes = {kind: sidecar[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {p["port"] for p in probes.values()} == {config.metrics_port}
    assert [c["containerPort"] for c in sidecar["ports"]] == [config.metrics_port]
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz"


def test_a_daemon_with_the_sidecars_options_answers_its_probes(spawn_daemon: Spawn, short_tmp: Path) -> None:
    """The sidecar's options on a real daemon, with what this machine needs instead of the
    pod's paths and sizes (and loopback instead of every address): its liveness probe passes,
    its readiness probe waits for a runner, as the example expects."""
    sidecar = container(pod(), "cachexferd")
    overrides, _ = daemon_config(sidecar)
    local = {"daemon.runtime_dir", "daemon.rank", "host_cache.capacity", "storage.file.path", "metrics.host"}
    settings = {k: v for k, v in overrides.items() if k not in local}
    settings.update({"storage.file.path": str(short_tmp / "store"), "metrics.host": "127.0.0.1"})
    daemon = spawn_daemon(settings=settings)
    base = daemon.status()["metrics_url"].removesuffix("/metrics")
    answers = {}
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        path = sidecar[kind]["httpGet"]["path"]
        try:
            with urllib.request.urlopen(base + path, timeout=5) as response:
                answers[kind] = (response.status, json.loads(response.read()))
        except urllib.error.HTTPError as exc:
            answers[kind] = (exc.code, json.loads(exc.read()))
    assert answers["startupProbe"][0] == answers["livenessProbe"][0] == 200, answers
    status, body = answers["readinessProbe"]
    assert status == 503 and body["device"] == "detached", "ready only once the runner attached"


def test_the_containers_share_the_socket_directory_and_dev_shm() -> None:
    spec = pod()
    sidecar, vllm = container(spec, "cachexferd"), container(spec, "vllm")
    _, config = daemon_config(sidecar)
    assert spec["shareProcessNamespace"] is True, "the daemon opens the runner's cache through /proc/<pid>/fd"
    volumes = {v["name"]: v for v in spec["volumes"]}
    socket_volume = next(n for n, path in mounts(sidecar).items() if config.runtime_dir.is_relative_to(path))
    assert mounts(vllm)[socket_volume] == mounts(sidecar)[socket_volume], "the same path in both containers"
    shm = [n for n, path in mounts(sidecar).items() if path == SHM_DIR]
    assert shm and mounts(vllm)[shm[0]] == SHM_DIR and volumes[shm[0]]["emptyDir"]["medium"] == "Memory"
    kv_config = next(a for a in vllm["args"] if a.startswith("--kv-transfer-config="))
    plugin = json.loads(kv_config.split("=", 1)[1])
    assert plugin["kv_connector_module_path"] == "cachexferd.integrations.vllm"
    assert "CachexferdConnector" in (REPO / "cachexferd/integrations/vllm/__init__.py").read_text()
    endpoint = plugin["kv_connector_extra_config"]["cachexferd"]["endpoint"]
    assert endpoint.format(rank=config.daemon.rank) == config.endpoint, (endpoint, config.endpoint)


def test_the_storage_path_is_on_a_volume_and_the_gpu_is_shared() -> None:
    spec = pod()
    sidecar, vllm = container(spec, "cachexferd"), container(spec, "vllm")
    _, config = daemon_config(sidecar)
    assert any(config.storage_path.is_relative_to(path) for path in mounts(sidecar).values()), config.storage_path
    claims = {c["name"] for c in sidecar["resources"]["claims"]}
    assert claims == {c["name"] for c in vllm["resources"]["claims"]}, "both containers see the same GPU"
    templates = {m["metadata"]["name"] for m in manifests() if m["kind"] == "ResourceClaimTemplate"}
    assert {c["resourceClaimTemplateName"] for c in spec["resourceClaims"] if c["name"] in claims} <= templates


def test_the_memory_limit_fits_the_host_cache_as_the_start_up_check_demands() -> None:
    sidecar = container(pod(), "cachexferd")
    _, config = daemon_config(sidecar)
    need = config.host_cache.capacity + _DAEMON_OVERHEAD
    for kind in ("requests", "limits"):
        have = quantity(sidecar["resources"][kind]["memory"])
        assert have >= need, f"{kind}.memory {human_bytes(have)} < host cache + overhead {human_bytes(need)}"

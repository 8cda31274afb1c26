"""Config layering (file < env < flags), validation and error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachexferd.config import DEFAULT_METRICS_PORT, ConfigError, describe, load_config, parse_size, settings_markdown

REPO = Path(__file__).resolve().parents[2]


def test_sizes() -> None:
    assert parse_size(4096) == 4096
    assert parse_size("64GiB") == 64 << 30
    assert parse_size("1.5 MB") == 1_500_000
    assert parse_size("512") == 512
    for bad in ("12XB", "-1", "GiB", True, 1.5):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_precedence(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[daemon]\nrank = 1\nlog_level = "debug"\n[host_cache]\ncapacity = "2GiB"\n')
    env = {"CACHEXFERD_DAEMON_RANK": "2", "CACHEXFERD_HOST_CACHE_COPY_THREADS": "3"}
    config = load_config(path, {"daemon.rank": "5"}, env)
    assert config.daemon.rank == 5  # flag beats env beats file
    assert config.daemon.log_level == "debug"
    assert config.host_cache.capacity == 2 << 30
    assert config.host_cache.copy_threads == 3
    assert config.metrics_port == DEFAULT_METRICS_PORT + 5


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"daemon.rnak": 1}, "did you mean 'rank'"),
        ({"deamon.rank": 1}, "did you mean 'daemon'"),
        ({"daemon.rank": "-1"}, "below the minimum"),
        ({"daemon.rank": "one"}, "daemon.rank (from flag daemon.rank)"),
        ({"daemon.backend": "tpu"}, "not one of"),
        ({"daemon.endpoint": "tcp://10.0.0.1:5555"}, "access.curve_secret_key"),
        ({"daemon.endpoint": "udp://x"}, "ipc://PATH"),
        ({"host_cache.capacity": "1KiB"}, "below the minimum"),
        ({"metrics.port": "70000"}, "above the maximum"),
        ({"metrics.enabled": "maybe"}, "expected a bool"),
        ({"norank": 1}, "table.key=value"),
    ],
)
def test_invalid_values_name_key_and_source(overrides: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, {})
    assert needle in str(info.value)


def test_bad_env_and_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="env CACHEXFERD_HOST_CACHE_CAPACITY"):
        load_config(None, None, {"CACHEXFERD_HOST_CACHE_CAPACITY": "lots"})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", None, {})
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon\nrank=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, None, {})
    flat = tmp_path / "flat.toml"
    flat.write_text("rank = 1\n")
    with pytest.raises(ConfigError, match="must be a \\[table\\]"):
        load_config(flat, None, {})


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.toml")))
def test_shipped_configs_load(name: str) -> None:
    config = load_config(REPO / "configs" / name, None, {})
    assert config.host_cache.capacity > 0
    assert config.warnings == (), "the shipped configs use the current names"


def test_each_storage_backend_has_its_own_table_in_every_layer(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[storage]\nbackend = "redis"\n[storage.redis]\nurl = "redis://h:1/0"\n'
                    '[storage.file]\ncapacity = "1GiB"\n')  # fmt: skip
    env = {"CACHEXFERD_STORAGE_MOONCAKE_PROTOCOL": "rdma", "CACHEXFERD_STORAGE_TIMEOUT_S": "2"}
    config = load_config(toml, {"storage.file.path": "/srv/kv"}, env)
    s = config.storage
    assert (s.backend, s.redis.url, s.file.capacity, s.file.path) == ("redis", "redis://h:1/0", 1 << 30, "/srv/kv")
    assert (s.mooncake.protocol, s.timeout_s, config.warnings) == ("rdma", 2.0, ())
    assert config.source("storage.mooncake.protocol") == "env CACHEXFERD_STORAGE_MOONCAKE_PROTOCOL"
    assert config.to_dict()["storage"]["file"]["path"] == "/srv/kv"


def test_the_flat_storage_names_of_earlier_releases_still_read_with_one_warning_each(tmp_path: Path) -> None:
    toml = tmp_path / "old.toml"
    toml.write_text('[storage]\npath = "/srv/kv"\ncapacity = "2GiB"\n')
    env = {"CACHEXFERD_STORAGE_URL": "redis://h:1/0"}
    config = load_config(toml, {"storage.master": "m:1"}, env)
    s = config.storage
    assert (s.file.path, s.file.capacity) == ("/srv/kv", 2 << 30)
    assert (s.redis.url, s.mooncake.master) == ("redis://h:1/0", "m:1")
    assert sorted(config.warnings) == [
        f"storage.capacity (from {toml}) is now storage.file.capacity; it still works, but rename it",
        "storage.master (from flag storage.master) is now storage.mooncake.master; it still works, but rename it",
        f"storage.path (from {toml}) is now storage.file.path; it still works, but rename it",
        "storage.url (from env CACHEXFERD_STORAGE_URL) is now storage.redis.url; it still works, but rename it",
    ]
    with pytest.raises(ConfigError, match=r"storage.file.capacity \(from .*\): expected a size"):
        load_config(None, {"storage.capacity": "lots"}, {})


def test_the_tables_follow_the_backend_registries() -> None:
    from dataclasses import fields

    from cachexferd.backends import COPY_BACKENDS
    from cachexferd.config import TABLES, DaemonConfig, StorageConfig
    from cachexferd.storage import STORAGE_BACKENDS

    assert {f"storage.{name}" for name in STORAGE_BACKENDS} <= set(TABLES)
    subtables = {f.name for f in fields(StorageConfig) if f.metadata.get("table")}
    assert subtables == set(STORAGE_BACKENDS), "a StorageConfig field per registered storage backend"
    assert dict(fields(StorageConfig)[0].metadata)["choices"] == ("none", *STORAGE_BACKENDS)
    assert dict(fields(DaemonConfig)[1].metadata)["choices"] == ("auto", *COPY_BACKENDS)
    assert all(spec.table in ("", *TABLES) for spec in COPY_BACKENDS.values())


def test_every_setting_is_documented() -> None:
    rows = describe()
    assert rows and all(doc for _, _, doc in rows)
    docs = (REPO / "docs" / "operations.md").read_text()
    assert settings_markdown() in docs, "docs/operations.md is stale: run scripts/update-settings-doc.py"

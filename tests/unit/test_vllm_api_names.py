"""The vLLM names the plug-in uses (vllm_names.py) against the sources of every supported vLLM.

The sources come from scripts/fetch-vllm-sources.sh (one wheel per release, without its
dependencies; cached in .vllm-sources/). Without PyPI these tests skip, except in CI
(CI=true), where they fail. Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cachexferd.integrations.vllm import api_check, vllm_names
from cachexferd.integrations.vllm.api_check import SourceTree, describe, differences, override_problems
from cachexferd.integrations.vllm.vllm_names import ABSENT, HANDLED, USES, Handled, Use

ROOT = Path(__file__).resolve().parents[2]
FETCH = ROOT / "scripts" / "fetch-vllm-sources.sh"
PLUGIN = ROOT / "cachexferd" / "integrations" / "vllm"
VLLM_API = PLUGIN / "vllm_api.py"
UNREACHABLE = 75  # fetch-vllm-sources.sh: a wheel could not be downloaded
BASE = "vllm.v1.kv_offload.base"

# The first test that needs the sources fetches them: up to 20 minutes on a slow link.
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def trees() -> dict[str, Path]:
    """Supported series -> its source tree, fetched once per run (a few minutes the first time)."""
    try:
        run = subprocess.run([str(FETCH)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired:
        pytest.fail("scripts/fetch-vllm-sources.sh did not finish in 20 minutes")
    if run.returncode == UNREACHABLE and os.environ.get("CI") != "true":
        pytest.skip(f"vLLM's wheels could not be downloaded (PyPI unreachable?): {run.stderr.strip()[-300:]}")
    assert run.returncode == 0, f"scripts/fetch-vllm-sources.sh failed ({run.returncode}): {run.stderr[-2000:]}"
    found = {SourceTree(Path(line)).version: ROOT / line for line in run.stdout.split()}
    return found


def supported() -> tuple[str, ...]:
    """vllm_api.SUPPORTED, read without importing vllm_api (which imports vLLM)."""
    for node in ast.parse(VLLM_API.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SUPPORTED" for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, tuple)
            return value
    raise AssertionError("no SUPPORTED in vllm_api.py")


@pytest.mark.parametrize("series", supported())
def test_every_name_the_plugin_uses_is_as_written_in_each_supported_vllm(trees: dict[str, Path], series: str) -> None:
    assert series in trees, f"scripts/fetch-vllm-sources.sh fetches no vLLM {series}: add it there"
    found = [d.line() for d in differences(SourceTree(trees[series]))]
    assert found == [], "\n".join(found)


def test_the_check_runs_from_the_command_line_and_fails_on_a_renamed_method(
    trees: dict[str, Path], tmp_path: Path
) -> None:
    good = subprocess.run(
        [sys.executable, "-m", "cachexferd.integrations.vllm.api_check", *map(str, trees.values())],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert good.returncode == 0, good.stdout + good.stderr
    broken = _copy_used_modules(trees["0.33"], tmp_path)
    _edit(broken, BASE, "    def prepare_store(\n", "    def prepare_stores(\n")
    bad = subprocess.run(
        [sys.executable, "-m", "cachexferd.integrations.vllm.api_check", str(broken)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert bad.returncode == 1
    *found, summary = bad.stdout.splitlines()
    assert summary.endswith("2 differences")  # the method, and the list of the class's methods
    assert found[0].startswith(f"vLLM 0.33: {BASE}:OffloadingManager (methods): expected ")
    assert "prepare_stores*" in found[0]
    assert found[1].startswith(f"vLLM 0.33: {BASE}:OffloadingManager.prepare_store (signature): expected ")
    assert found[1].endswith("found 'absent'")


def test_a_changed_signature_or_field_is_a_difference(trees: dict[str, Path], tmp_path: Path) -> None:
    broken = _copy_used_modules(trees["0.32"], tmp_path)
    _edit(broken, BASE, "def lookup(self, key: OffloadKey, req_context", "def lookup(self, key: OffloadKey, *, req_co")
    _edit(broken, BASE, "    transfer_size: int | None = None\n", "    transfer_size: int | None = 0\n")
    _edit(broken, "vllm.v1.worker.utils", "dtype=torch.int8", "dtype=torch.uint8")
    found = {d.use.key: d.found for d in differences(SourceTree(broken))}
    assert found == {
        f"{BASE}:OffloadingManager.lookup signature": "@abstractmethod (self, key, *, req_co)",
        f"{BASE}:TransferResult fields": "job_id, success, transfer_size=0, transfer_time=None",
        "vllm.v1.worker.utils:allocate_kv_cache calls": "torch.zeros(buf_size, dtype=torch.uint8, device=device)",
    }


def test_a_difference_declared_for_one_series_is_one_in_another(trees: dict[str, Path], tmp_path: Path) -> None:
    """0.33's expedited submit_load, shipped under the 0.32 version string, is a difference."""
    mixed = _copy_used_modules(trees["0.32"], tmp_path)
    shutil.copy(_module_file(trees["0.33"], BASE), _module_file(mixed, BASE))
    keys = {d.use.key for d in differences(SourceTree(mixed))}
    assert f"{BASE}:OffloadingWorker.submit_load signature" in keys
    assert f"{BASE}:OffloadingManager.lock signature" in keys


# Without sources -----------------------------------------------------------------------------


def test_every_declared_difference_names_a_manifest_entry_of_a_supported_series() -> None:
    keys = {use.key for use in USES}
    assert set(HANDLED) <= set(supported())
    for series, handled in HANDLED.items():
        assert set(handled) <= keys, f"vLLM {series}: declared for no manifest entry: {set(handled) - keys}"
        assert all(h.how for h in handled.values())


def test_every_name_vllm_api_imports_from_vllm_is_in_the_manifest() -> None:
    imported = {
        f"{node.module}:{alias.name}"
        for node in ast.walk(ast.parse(VLLM_API.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm")
        for alias in node.names
    }
    listed = {use.name for use in USES if use.kind == "binds"}
    assert imported and imported <= listed, f"not in vllm_names.py: {sorted(imported - listed)}"


@pytest.mark.parametrize("series", supported())
def test_the_plugins_overrides_take_every_call_vllm_makes(series: str) -> None:
    assert override_problems(PLUGIN, series) == []


def test_every_plugin_method_that_overrides_vllms_is_in_the_manifest() -> None:
    """A plug-in method named as one its vLLM base class defines has its signature checked."""
    checked = {(use.override, use.qualname.split(".")[-1]) for use in USES if use.override}
    for override, base in [
        (vllm_names.MANAGER_CLASS, "OffloadingManager"),
        (vllm_names.WORKER_CLASS, "OffloadingWorker"),
        (vllm_names.CONNECTOR_CLASS, "OffloadingConnector"),
        ("spec.py:CachexferdOffloadingSpec", "OffloadingSpec"),
    ]:
        file, cls = override.split(":")
        ours = _defined_methods(PLUGIN / file, cls)
        theirs = next(u.value for u in USES if u.kind == "methods" and u.qualname == base)
        shadowed = ours & {m.rstrip("*") for m in theirs.split(", ")}
        assert shadowed and all((override, m) in checked for m in shadowed), (override, shadowed)


def test_an_override_that_would_not_take_vllms_call_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = tmp_path / "plugin"
    shutil.copytree(PLUGIN, plugin, ignore=shutil.ignore_patterns("__pycache__"))
    _edit_file(plugin / "manager.py", "def lookup(self, key: OffloadKey,", "def lookup(self, offload_key: OffloadKey,")
    _edit_file(
        plugin / "manager.py",
        "req_context: ReqContext, success: bool = True)",
        "req_context: ReqContext, success: bool)",
    )
    _edit_file(
        plugin / "spec.py",
        "def get_worker(self, kv_caches: CanonicalKVCaches)",
        "def get_worker(self, kv_caches, rank)",
    )
    problems = [p.split("): ", 1)[1] for p in override_problems(plugin, "0.32")]
    assert problems == [
        "'rank' is not vLLM's and has no default",  # get_worker
        "parameter 1 is 'offload_key', vLLM's is 'key'",  # lookup
        "'offload_key' is not vLLM's and has no default",
        "'success' has no default; vLLM's has one (and may leave it out)",  # complete_store
    ]
    # Without the shim's declared drop, 0.33's expedited keyword is one the worker does not take.
    key = f"{BASE}:OffloadingWorker.submit_load signature"
    without_drop = Handled(HANDLED["0.33"][key].value, "no shim")
    monkeypatch.setitem(HANDLED["0.33"], key, without_drop)
    assert [p.split("): ", 1)[1] for p in override_problems(PLUGIN, "0.33")] == [
        "takes no parameter 'expedited' (position 4)"
    ]


def test_signatures_are_written_with_kinds_and_defaults(tmp_path: Path) -> None:
    source = (
        "import abc\n"
        "class C:\n"
        "    @abc.abstractmethod\n"
        "    def f(self, a, /, b, c=1, *args, d, e=None, **kw) -> int: ...\n"
        "    @property\n"
        "    def lock(self): ...\n"
        "    x: int = 3\n"
        "    def __init__(self):\n"
        "        self.y = 1\n"
    )
    tree = _fake_tree(tmp_path, source)

    def found(qualname: str, kind: str) -> str:
        return describe(tree, Use(f"vllm.m:{qualname}", kind, "", ""))

    assert found("C.f", "signature") == "@abc.abstractmethod (self, a, /, b, c=1, *args, d, e=None, **kw)"
    assert found("C.lock", "signature") == "@property (self)"
    assert found("C.gone", "signature") == ABSENT
    assert found("C", "fields") == "x=3"
    assert found("C.y", "attribute") == "present"
    assert found("C.z", "attribute") == ABSENT
    assert found("C", "methods") == "f*, lock"
    assert describe(tree, Use("vllm.missing:C", "bases", "", "")) == ABSENT


def test_the_version_is_read_as_its_series(tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path, "")
    assert tree.version == "0.99"
    assert api_check.main([str(tmp_path / "vllm")]) == 1  # the fake vllm has none of the names


# Helpers -------------------------------------------------------------------------------------


def _module_file(root: Path, module: str) -> Path:
    base = root.joinpath(*module.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"


def _copy_used_modules(source: Path, dest: Path) -> Path:
    """A copy of the files the manifest reads (and _version.py), to break on purpose."""
    for module in {use.module for use in USES} | {"vllm._version"}:
        src = _module_file(source, module)
        if src.is_file():
            target = dest / src.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, target)
    return dest


def _defined_methods(path: Path, cls: str) -> set[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
    raise AssertionError(f"no class {cls} in {path}")


def _edit(root: Path, module: str, old: str, new: str) -> None:
    _edit_file(_module_file(root, module), old, new)


def _edit_file(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {path}"
    path.write_text(text.replace(old, new))


def _fake_tree(root: Path, module_source: str) -> SourceTree:
    (root / "vllm").mkdir()
    (root / "vllm" / "_version.py").write_text("__version__ = version = '0.99.1'\n")
    (root / "vllm" / "m.py").write_text(module_source)
    return SourceTree(root)

"""The package's layering, read from the source: no module imports from a layer above its own,
nor from another component of its own layer.

protocol, the small shared modules and the backend registries -> client | index | copy
backends | storage backends | metrics (independent of each other) -> daemon -> integrations
(imported by nothing else) -> the commands (cli, demo, bench, status, launch, ...) on top.
Every import that runs counts, also one inside a function: a lazy import still runs upward
when it runs. Imports for the type checker alone (under ``if TYPE_CHECKING:``) do not.
Within integrations, the engine-side parts (integrations.engine) import no engine and no
integration of one; an integration (integrations.vllm) imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cachexferd"

# Components, by module prefix: the first match decides (a prefix ending in "." matches the
# package's modules but not the package itself; "=" marks an exact match).
COMPONENTS: list[tuple[str, str]] = [
    ("cachexferd.protocol", "protocol"),
    *((f"cachexferd.{name}", "shared") for name in ("units", "procs", "zmqio", "config", "setting")),
    *((f"cachexferd.{name}", "shared") for name in ("security", "host_cache", "cuda_tensors", "priority")),
    ("=cachexferd.backends", "registries"),  # the backend tables the configuration reads: no backend code
    ("=cachexferd.storage", "registries"),
    ("cachexferd.client", "client"),
    ("cachexferd.index", "index"),
    ("cachexferd.backends.", "backends"),
    ("cachexferd.storage.", "storage"),  # the storage backends package (storage_servers is a command)
    ("cachexferd.metrics", "metrics"),
    ("cachexferd.daemon", "daemon"),
    ("cachexferd.integrations", "integrations"),
    ("cachexferd.", "commands"),  # cli, demo*, bench, status, launch, preflight, storage_servers, keys_cli
]
# Layers, 0 lowest: a module may import from its own component and from lower layers. The
# components of layer 0 are one pool; those of layer 1 are independent of each other.
LAYER = {"protocol": 0, "shared": 0, "registries": 0, "client": 1, "index": 1, "backends": 1, "storage": 1,
         "metrics": 1, "daemon": 2, "integrations": 3, "commands": 4}  # fmt: skip
NAMES = {0: "protocol/shared", 1: "client/index/backends/storage", 2: "daemon", 3: "integrations", 4: "commands"}

# Imports between two components of one layer that are allowed (importer prefix, imported prefix).
SIDEWAYS: dict[tuple[str, str], str] = {
    ("cachexferd.index", "cachexferd.storage.keys"): "the engine-side index names storage objects with the key "
    "library, which imports nothing but the standard library",
}
# Known violations, each with the reason it is tolerated for now. Keep this short.
KNOWN: dict[tuple[str, str], str] = {
    ("cachexferd.integrations.vllm.bench", "cachexferd.launch"): "the vLLM benchmark is a command kept beside "
    "the plug-in; it starts daemons with the launcher",
    ("cachexferd.backends.cuda", "cachexferd.client.cuda_runner"): "check_runner_tensors, shared by the runner and "
    "the cuda backend, is to move below both",
    ("cachexferd.backends.cuda_ipc", "cachexferd.client.cuda_runner"): "device_uuid, shared by the runner and the "
    "cuda backend, is to move below both",
}


def component(module: str) -> str:
    if module == "cachexferd":
        return "shared"  # the package itself: its version only
    for prefix, name in COMPONENTS:
        if prefix.startswith("="):
            if module == prefix[1:]:
                return name
        elif module == prefix or module.startswith(prefix if prefix.endswith(".") else prefix + "."):
            return name
    raise AssertionError(f"{module} has no component: add it to COMPONENTS")


def layer(module: str) -> int:
    return LAYER[component(module)]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    return imports_in(module_name(path), path.read_text(), path.name == "__init__.py")


def imports_in(name: str, source: str, is_package: bool = False) -> set[str]:
    """Every cachexferd module the code of module ``name`` imports, at any depth."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _running_nodes(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("cachexferd"):
                # `from . import x` and `from .pkg import mod` import submodules, not just names.
                found |= {f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("cachexferd")}
    return found


def _running_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (imports for the type checker only)."""
    nodes: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def _is_module(dotted: str) -> bool:
    relative = Path(*dotted.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def _allowed_sideways(name: str, target: str) -> bool:
    return any(name.startswith(a) and target.startswith(b) for a, b in SIDEWAYS)


def upward_imports(modules: dict[str, set[str]]) -> list[str]:
    """Imports from a higher layer, and (above layer 0) from another component of the same layer."""
    problems = []
    for name, targets in sorted(modules.items()):
        own, mine = layer(name), component(name)
        for target in sorted(targets):
            if (name, target) in KNOWN:
                continue
            theirs = component(target)
            if layer(target) > own:
                problems.append(f"{name} ({NAMES[own]}) imports {target} ({NAMES[layer(target)]})")
            elif own > 0 and layer(target) == own and theirs != mine and not _allowed_sideways(name, target):
                problems.append(f"{name} ({mine}) imports {target} ({theirs}): a sideways import within a layer")
    return problems


def test_no_module_imports_from_a_layer_above() -> None:
    assert upward_imports({module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}) == []


def test_integrations_are_imported_by_nothing_else() -> None:
    outside = [
        f"{module_name(path)} imports {target}"
        for path in PACKAGE.rglob("*.py")
        if not module_name(path).startswith("cachexferd.integrations")
        for target in imports(path)
        if target.startswith("cachexferd.integrations")
    ]
    assert outside == []


# Engine packages the engine-side parts never import (also not lazily): they serve every engine.
ENGINES = ("vllm", "sglang", "tensorrt_llm", "lmdeploy", "text_generation_server")


def test_the_engine_parts_import_no_engine_and_no_engine_integration() -> None:
    """cachexferd.integrations.engine serves any engine: it imports neither an engine nor an
    integration of one (cachexferd.integrations.vllm); the integrations import it."""
    sources = {module_name(p): p.read_text() for p in (PACKAGE / "integrations").rglob("*.py")}
    engine = {name: source for name, source in sources.items() if name.startswith("cachexferd.integrations.engine")}
    assert len(engine) > 5 and engine_part_imports(engine) == []
    vllm = {name: source for name, source in sources.items() if name.startswith("cachexferd.integrations.vllm")}
    assert any(t.startswith("cachexferd.integrations.engine") for n, s in vllm.items() for t in imports_in(n, s)), (
        "the vLLM integration imports the engine parts"
    )
    assert engine_part_imports(vllm) == [], "only the engine parts are held to this"
    probes = {
        "cachexferd.integrations.engine.probe": "from ..vllm.keys import VllmKeyNames\n",
        "cachexferd.integrations.engine.probe2": "def f():\n    import vllm.config\n",
        "cachexferd.integrations.engine.probe3": "def f():\n    from sglang.srt import server_args\n",
        "cachexferd.integrations.engine.probe4": "from cachexferd.integrations.vllm import processes\n",
    }
    assert [p.split(" ")[0] for p in engine_part_imports(probes)] == sorted(probes), "the rule can fail"


def engine_part_imports(sources: dict[str, str]) -> list[str]:
    """Imports of an engine or of an engine's integration by a module of the engine parts."""
    problems = []
    for name, source in sorted(sources.items()):
        if not name.startswith("cachexferd.integrations.engine"):
            continue
        own = imports_in(name, source, name.rpartition(".")[2] == "engine")
        found = {t for t in own if t.startswith("cachexferd.integrations.") and component_of_integration(t) != "engine"}
        for node in _running_nodes(ast.parse(source)):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] in ENGINES}
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in ENGINES:
                found.add(node.module or "")
        problems += [f"{name} imports {target}" for target in sorted(found)]
    return problems


def component_of_integration(module: str) -> str:
    """'engine', 'vllm', ... for cachexferd.integrations.<that>[...]."""
    return module.split(".")[2]


def test_backends_never_import_the_client() -> None:
    """What the runner side and the cuda backend both need (a tensor list's fit to a layout,
    a device's UUID) lives in a shared module below both."""
    modules = {module_name(p): imports(p) for p in (PACKAGE / "backends").rglob("*.py")}
    assert len(modules) > 10 and backend_client_imports(modules) == []
    assert backend_client_imports({"cachexferd.backends.cuda.probe": {"cachexferd.client.cuda_runner"}}) == [
        "cachexferd.backends.cuda.probe imports cachexferd.client.cuda_runner"
    ], "the rule can fail"


def backend_client_imports(modules: dict[str, set[str]]) -> list[str]:
    return [
        f"{name} imports {target}"
        for name, targets in sorted(modules.items())
        if name.startswith("cachexferd.backends")
        for target in sorted(targets)
        if target.startswith("cachexferd.client")
    ]


def test_start_up_checks_use_only_shared_modules() -> None:
    """preflight runs before anything starts: it takes its formatting from units, not from
    another command (status), and needs nothing of the client or the daemon."""
    path = PACKAGE / "preflight.py"
    assert {t for t in imports(path) if layer(t) > 0} == set(), imports(path)


def test_protocol_imports_neither_torch_nor_the_daemon() -> None:
    for path in (PACKAGE / "protocol").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(n == "torch" or n.startswith("torch.") for n in names), path
        assert not any("daemon" in n for n in names), path


def test_the_checker_sees_upward_imports() -> None:
    """The rule can fail: a storage backend importing the launcher (as storage/servers.py did),
    the status command's formatting taken by the start-up checks' peers, a lazy import."""
    probes = {
        "cachexferd.storage.servers": "from ..launch import ManagedProcess\n",
        "cachexferd.client.probe": "def f():\n    from ..daemon.server import Daemon\n",
        "cachexferd.daemon.probe": "from cachexferd import status\n",
    }
    found = upward_imports({name: imports_in(name, source) for name, source in probes.items()})
    assert [p.split(" ")[0] for p in found] == sorted(probes), found


def test_the_checker_sees_sideways_imports_and_registries_that_grow_code() -> None:
    """Client and backends (and the other components of their layer) never import each other;
    the registries the configuration reads stay below everything but the shared modules."""
    probes = {
        "cachexferd.backends.probe": "from ..client.core import EngineClient\n",
        "cachexferd.client.probe2": "from ..backends.cpu import CpuBackend\n",
        "cachexferd.storage.probe": "from ..index.tree import PrefixTree\n",
        "cachexferd.metrics": "from .client import EngineClient\n",
        "cachexferd.storage": "from .file import FileBackend\n",
    }
    packages = {"cachexferd.storage"}
    found = upward_imports({name: imports_in(name, source, name in packages) for name, source in probes.items()})
    assert sorted(p.split(" ")[0] for p in found) == sorted(probes), found
    quiet = {"cachexferd.index.probe": "from ..storage.keys import KeySpace\n",
             "cachexferd.storage.probe": "if TYPE_CHECKING:\n    from ..daemon.server import Daemon\n"}  # fmt: skip
    assert upward_imports({name: imports_in(name, source) for name, source in quiet.items()}) == []


def top_level_imports(source: str) -> set[str]:
    """Modules a source imports when it is imported (not inside functions)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module or "")
    return names


def test_the_cuda_package_imports_torch_and_triton_only_where_it_runs_on_a_gpu() -> None:
    """The driver seam, planning, lanes, methods, the fake driver and the pool import without
    torch or Triton (they run on CPU in the tests and the cuda-fake benchmark); only the
    backend module, which the daemon loads by name on a GPU host, imports torch up front."""
    heavy = {"torch", "triton"}
    found = {}
    for path in (PACKAGE / "backends" / "cuda").glob("*.py"):
        names = {n.split(".")[0] for n in top_level_imports(path.read_text())}
        if names & heavy:
            found[path.name] = sorted(names & heavy)
    assert found == {"backend.py": ["torch"]}, found
    assert top_level_imports("import torch\ndef f():\n    import triton\n") == {"torch"}, "the rule can fail"

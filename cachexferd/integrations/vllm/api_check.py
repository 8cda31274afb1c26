"""Checks the vLLM names the plug-in uses (vllm_names.py) against a vLLM source tree.

    python -m cachexferd.integrations.vllm.api_check SOURCE_TREE [SOURCE_TREE ...]
    python -m cachexferd.integrations.vllm.api_check --dump SOURCE_TREE

A source tree is an installed ``vllm`` package directory, an unpacked wheel, or the directory
holding either. The check reads the sources with Python's ``ast`` and imports nothing (not vLLM,
not torch), so any vLLM version can be checked on any machine. It prints one line per difference
(version, name, what was expected, what was found) and exits 1 on any; a difference the plug-in
handles on purpose is declared per version in vllm_names.py, so only a new one fails. It also
checks that each plug-in method overriding one of vLLM's takes every call that version makes.
``--dump`` prints every name's value as found, to write or update the manifest from.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .vllm_names import ABSENT, HANDLED, USES, Use

PROPERTY_LIKE = ("property", "classmethod", "staticmethod", "abstractmethod")
PLUGIN_DIR = Path(__file__).parent  # whose overrides are checked against each tree's version


@dataclass(frozen=True)
class Difference:
    version: str
    use: Use
    expected: str
    found: str

    def line(self) -> str:
        where = f"vLLM {self.version}: {self.use.name} ({self.use.kind})"
        return f"{where}: expected {self.expected!r}, found {self.found!r}"


class SourceTree:
    """A vLLM source tree, parsed file by file on demand."""

    def __init__(self, path: Path) -> None:
        self.root = path.parent if (path / "_version.py").exists() or path.name == "vllm" else path
        if not (self.root / "vllm").is_dir():
            raise SystemExit(f"api_check: no vllm package under {path}")
        self._parsed: dict[str, ast.Module | None] = {}

    @property
    def version(self) -> str:
        """The release series (major.minor) in vllm/_version.py, e.g. '0.32'."""
        text = (self.root / "vllm" / "_version.py").read_text()
        match = re.search(r"""version\s*=\s*['"](\d+)\.(\d+)""", text)
        if match is None:
            raise SystemExit(f"api_check: no version in {self.root / 'vllm' / '_version.py'}")
        return f"{match.group(1)}.{match.group(2)}"

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._parsed:
            base = self.root.joinpath(*dotted.split("."))
            files = [base.with_suffix(".py"), base / "__init__.py"]
            found = next((f for f in files if f.is_file()), None)
            self._parsed[dotted] = ast.parse(found.read_text(), str(found)) if found else None
        return self._parsed[dotted]


def describe(tree: SourceTree, use: Use) -> str:
    """What the tree says about one manifest entry, as the manifest writes it."""
    module = tree.module(use.module)
    if module is None:
        return ABSENT
    if use.kind == "module":
        return "present"
    if use.kind == "binds":
        return "present" if use.qualname in _bound_names(module) else ABSENT
    node = _find(module, use.qualname.split("."))
    if node is None:
        return ABSENT
    return DESCRIBERS[use.kind](node, use)


def _bound_names(module: ast.Module) -> set[str]:
    """Names a module defines or imports at its top level (what ``from module import x`` finds)."""
    names: set[str] = set()
    for node in module.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _find(scope: ast.Module | ast.ClassDef, path: list[str]) -> ast.AST | None:
    """The class or function ``path`` names (``Class.method``), or the class for an attribute."""
    head, rest = path[0], path[1:]
    for node in scope.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == head:
            if not rest:
                return node
            if isinstance(node, ast.ClassDef):
                return _find(node, rest) or (node if len(rest) == 1 else None)
    return None


def _bases(node: ast.AST, use: Use) -> str:
    if not isinstance(node, ast.ClassDef):
        return f"not a class: {type(node).__name__}"
    return ", ".join(ast.unparse(b) for b in node.bases)


def _signature(node: ast.AST, use: Use) -> str:
    """Parameter names, kinds and defaults (no annotations), after the decorators that change
    how it is called: ``@property (self)``, ``(self, key, *, n=1, **kw)``."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return ABSENT  # an attribute lookup fell back to the class: the method is not there
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parts = [_param(a.arg, d) for a, d in zip(positional, defaults)]
    if args.posonlyargs:
        parts.insert(len(args.posonlyargs), "/")
    if args.vararg:
        parts.append("*" + args.vararg.arg)
    elif args.kwonlyargs:
        parts.append("*")
    parts += [_param(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        parts.append("**" + args.kwarg.arg)
    decorators = [ast.unparse(d) for d in node.decorator_list if ast.unparse(d).split(".")[-1] in PROPERTY_LIKE]
    return " ".join([*(f"@{d}" for d in decorators), f"({', '.join(parts)})"])


def _param(name: str, default: ast.expr | None) -> str:
    return name if default is None else f"{name}={ast.unparse(default)}"


def _fields(node: ast.AST, use: Use) -> str:
    """A dataclass's (or NamedTuple's) fields in order, with defaults: what a constructor call
    by position or keyword depends on."""
    if not isinstance(node, ast.ClassDef):
        return f"not a class: {type(node).__name__}"
    annotated = [item for item in node.body if isinstance(item, ast.AnnAssign)]
    return ", ".join(
        _param(item.target.id, item.value)
        for item in annotated
        if isinstance(item.target, ast.Name) and "ClassVar" not in ast.unparse(item.annotation)
    )


def _attribute(node: ast.AST, use: Use) -> str:
    """Whether a class has the attribute: in its body, as a method or property, or assigned
    to ``self.<name>`` in one of its methods."""
    name = use.qualname.split(".")[-1]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "present"  # a property or method of that name
    if not isinstance(node, ast.ClassDef):
        return ABSENT
    return "present" if name in _class_attributes(node) else ABSENT


def _class_attributes(node: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for item in ast.walk(node):
        if isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            for target in targets:
                if isinstance(target, ast.Name) and item in node.body:
                    names.add(target.id)
                elif isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                    names.add(target.attr)
    return names


def _methods(node: ast.AST, use: Use) -> str:
    """The methods a class defines (sorted), abstract ones marked: a subclass inherits the
    rest, so a new one is a hook to look at, a new abstract one a method to write."""
    if not isinstance(node, ast.ClassDef):
        return f"not a class: {type(node).__name__}"
    out = []
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
            abstract = any(ast.unparse(d).endswith("abstractmethod") for d in item.decorator_list)
            out.append(item.name + ("*" if abstract else ""))
    return ", ".join(sorted(set(out)))


def _calls(node: ast.AST, use: Use) -> str:
    """The calls a function makes to ``use.callee`` (by the callee's last name), as source."""
    found = []
    for item in ast.walk(node):
        if isinstance(item, ast.Call) and ast.unparse(item.func).split(".")[-1] == use.callee:
            found.append(ast.unparse(item))
    return "; ".join(found) if found else ABSENT


DESCRIBERS = {
    "bases": _bases,
    "signature": _signature,
    "fields": _fields,
    "attribute": _attribute,
    "methods": _methods,
    "calls": _calls,
}


def expected(use: Use, version: str) -> str:
    """The manifest's value for ``use`` in ``version``: a declared per-version difference, or
    the value the plug-in was written against."""
    handled = HANDLED.get(version, {}).get(use.key)
    return handled.value if handled is not None else use.value


def differences(tree: SourceTree) -> Iterator[Difference]:
    version = tree.version
    for use in USES:
        found, wanted = describe(tree, use), expected(use, version)
        if found != wanted:
            yield Difference(version, use, wanted, found)


def override_problems(plugin_dir: Path, version: str) -> list[str]:
    """Where a plug-in method that overrides one of vLLM's (``Use.override``) would not take
    every call vLLM ``version`` makes to it, as the manifest has that method's signature."""
    problems = []
    for use in USES:
        if not use.override:
            continue
        file, cls = use.override.split(":")
        method = use.qualname.split(".")[-1]
        where = f"{use.override}.{method} (vLLM {version}: {use.name})"
        node = _find(ast.parse((plugin_dir / file).read_text()), [cls, method])
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            problems.append(f"{where}: the plug-in does not define it")
            continue
        if expected(use, version) == ABSENT:
            continue  # that vLLM has no such method to override
        handled = HANDLED.get(version, {}).get(use.key)
        dropped = handled.drops if handled is not None else ()
        vllm_args = _arguments(expected(use, version))
        problems += [f"{where}: {p}" for p in _incompatible(node.args, vllm_args, dropped)]
    return problems


def _arguments(signature: str) -> ast.arguments:
    """The parameters of a manifest signature such as ``@property (self, a, b=1, *, c)``."""
    function = ast.parse(f"def f{signature[signature.index('(') :]}: pass").body[0]
    assert isinstance(function, ast.FunctionDef)
    return function.args


def _incompatible(ours: ast.arguments, theirs: ast.arguments, dropped: tuple[str, ...]) -> Iterator[str]:
    """How a method with parameters ``ours`` fails to take the calls one with ``theirs`` takes:
    the same positional parameters in the same order, every keyword, a default wherever vLLM
    may leave one out, and defaults for the parameters vLLM does not know."""
    our_positional, their_positional = [*ours.posonlyargs, *ours.args], [*theirs.posonlyargs, *theirs.args]
    our_defaults = _with_defaults(ours)
    their_defaults = _with_defaults(theirs)
    for index, param in enumerate(their_positional):
        if param.arg in dropped:
            continue
        if index >= len(our_positional):
            if ours.vararg is None:
                yield f"takes no parameter {param.arg!r} (position {index})"
        elif our_positional[index].arg != param.arg:
            yield f"parameter {index} is {our_positional[index].arg!r}, vLLM's is {param.arg!r}"
    our_names = {a.arg for a in [*our_positional, *ours.kwonlyargs]}
    for param in theirs.kwonlyargs:
        if param.arg not in dropped and param.arg not in our_names and ours.kwarg is None:
            yield f"takes no keyword {param.arg!r}"
    for name in their_defaults - set(dropped):
        if name in our_names and name not in our_defaults:
            yield f"{name!r} has no default; vLLM's has one (and may leave it out)"
    their_names = {a.arg for a in [*their_positional, *theirs.kwonlyargs]}
    for name in our_names - their_names - our_defaults:
        yield f"{name!r} is not vLLM's and has no default"


def _with_defaults(args: ast.arguments) -> set[str]:
    positional = [*args.posonlyargs, *args.args]
    with_default = positional[len(positional) - len(args.defaults) :]
    keyword = [a for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return {a.arg for a in [*with_default, *keyword]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, help="vLLM source trees (package dir or its parent)")
    parser.add_argument("--dump", action="store_true", help="print every name's value as found")
    args = parser.parse_args(argv)
    failed = False
    for path in args.trees:
        tree = SourceTree(path)
        if args.dump:
            for use in USES:
                print(f"{use.key}\t{use.kind}\t{describe(tree, use)}")
            continue
        found = [d.line() for d in differences(tree)]
        found += [f"plug-in: {p}" for p in override_problems(PLUGIN_DIR, tree.version)]
        for line in found:
            print(line)
        print(f"vLLM {tree.version} ({tree.root}): {len(USES)} names checked, {len(found)} differences")
        failed = failed or bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

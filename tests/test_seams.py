"""The written seams hold: one Swarm interface, a light `import peertrain`, no import cycles.

Process-free (the unit tier): the import checks read the source with `ast`, the interface check compares
signatures with `inspect`. The one check that starts an interpreter is `test_import_peertrain_loads_no_daemon`.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from peertrain import swarm as api

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("peer", "protocol", "peertrain", "trainers")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an imported name lives in (`peer.home.Home` -> `peer.home`), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, *, at_import_time: bool) -> tuple[set[str], set[str]]:
    """(project modules, outside top-level packages) that `module` imports when it runs (never what sits
    under `if TYPE_CHECKING`). `at_import_time`: only what runs when it is imported, not inside functions."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: set[str] = set()

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only: never imported at run time
            later = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if not (later and at_import_time):
                if isinstance(child, ast.Import):
                    names.update(a.name for a in child.names)
                elif isinstance(child, ast.ImportFrom):
                    base = ".".join(package[: len(package) - child.level + 1] + [child.module or ""]).strip(".") \
                        if child.level else child.module or ""
                    names.add(base)
                    names.update(f"{base}.{a.name}" for a in child.names)
            visit(child, later)

    visit(ast.parse(path.read_text()), False)
    ours = {m for n in names if (m := _resolve(n)) is not None and m != module}
    outside = {n.split(".")[0] for n in names if _resolve(n) is None}
    return ours, outside


def test_no_import_cycles_between_modules() -> None:
    """Function-local imports count too: hiding a cycle in a function does not remove it."""
    graph = {m: _imports(m, at_import_time=False)[0] for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                cycles.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            strongconnect(v)
    assert not cycles, f"modules that import each other: {cycles}"


def test_import_peertrain_reaches_neither_trio_nor_the_daemon() -> None:
    """What `import peertrain` runs, followed through every module it imports at import time."""
    seen, todo, outside = set(), ["peertrain"], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        ours, theirs = _imports(m, at_import_time=True)
        todo.extend(ours)
        outside |= theirs
    assert "trio" not in outside and "torch" not in outside, sorted(outside)
    assert not {m for m in seen if m.startswith(("peer.daemon", "peer.averaging", "peer.pipeline"))}, sorted(seen)


@pytest.mark.parametrize("handle", ["peer.trainer_host:TrainerSwarm", "peer.attach.client:AttachedSwarm",
                                    "peertrain.distributed:HostRanks"])
def test_every_handle_implements_swarm_with_the_same_signatures(handle: str) -> None:
    import importlib

    module, name = handle.split(":")
    cls = getattr(importlib.import_module(module), name)
    protocols = [api.Swarm, api.HostedSwarm] if name == "TrainerSwarm" else [api.Swarm]
    for proto in protocols:
        for member, want in vars(proto).items():
            if member.startswith("_") or not (callable(want) or isinstance(want, property)):
                continue
            if isinstance(want, property):  # a property, a class attribute or one set in __init__ all serve
                assert hasattr(cls, member) or f"self.{member}" in inspect.getsource(cls), f"{name} has no {member}"
                continue
            got = getattr(cls, member, None)
            assert got is not None, f"{name} lacks Swarm.{member}"
            want_sig, got_sig = inspect.signature(want), inspect.signature(got)
            want_params = [p for p in want_sig.parameters.values()]
            shared = [got_sig.parameters.get(p.name) for p in want_params]
            assert all(shared), f"{name}.{member}{got_sig} lacks parameters of Swarm.{member}{want_sig}"
            for w, g in zip(want_params, shared):
                assert (g.kind, g.default) == (w.kind, w.default), f"{name}.{member}: {g} differs from {w}"
            extra = [p for p in got_sig.parameters.values() if p.name not in want_sig.parameters]
            assert all(p.default is not p.empty or p.kind is p.VAR_KEYWORD for p in extra), \
                f"{name}.{member} requires parameters Swarm.{member} does not have: {extra}"
            # return types: mypy checks they are compatible (tests/swarm_conformance.py, under the mypy test)
        for member in getattr(proto, "__annotations__", {}):
            assert hasattr(cls, member) or f"self.{member}" in inspect.getsource(cls), f"{name} has no {member}"


@pytest.mark.slow
def test_import_peertrain_loads_no_daemon() -> None:
    """The same, observed: a fresh interpreter's modules after `import peertrain`."""
    code = ("import sys, peertrain; heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('trio', 'torch', 'numpy') or m.startswith(('peer.daemon', 'peer.averaging', 'peer.pipeline'))); "
            "print(heavy); sys.exit(1 if heavy else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_mypy_is_clean_on_the_typed_packages() -> None:
    """mypy over protocol/ and peertrain/ (the leaf interface included): settings in pyproject.toml."""
    pytest.importorskip("mypy", reason="mypy is in the test extra: ./dev test installs it")
    out = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_every_schema_message_is_registered_and_none_is_defined_elsewhere() -> None:
    """A Message under protocol/schema that MESSAGES forgets is refused by every peer (and never fuzzed: the
    fuzz tests draw from the registry); one defined outside protocol/schema escapes both, and the review of
    the wire's bounds in one place."""
    import importlib

    from protocol.messages import Message
    from protocol.schema import MESSAGES

    defined = set()
    for module in MODULES:
        if module == "protocol.schema" or module.startswith("protocol.schema."):
            mod = importlib.import_module(module)
            defined |= {c for c in vars(mod).values()
                        if isinstance(c, type) and issubclass(c, Message) and c.__module__ == module}
    assert defined - set(MESSAGES) == set(), "defined under protocol/schema but not in MESSAGES"
    assert set(MESSAGES) - defined == set(), "in MESSAGES but defined outside protocol/schema"
    elsewhere = [f"{module}.{node.name}" for module, path in MODULES.items() if not module.startswith("protocol.")
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                 and any(ast.unparse(b).split(".")[-1] == "Message" for b in node.bases)]
    assert not elsewhere, f"wire messages outside protocol/schema: {elsewhere}"


MSGPACK_OUTSIDE_PROTOCOL = {
    "peer.membership.store": "the peer cache file on disk, not the wire",
    "peer.control": "the local control socket (mode 0600), not the peer wire",
    "peer.attach.wire": "the local attach socket of a training script, not the peer wire",
    "peer.testing.attacks": "an attacker's tool: crafts malformed wire messages the registry would refuse to encode",
}
"""Modules outside protocol/ that may use msgpack, and why: for wire messages none may (a message that
skips the registry skips its bounds too, as view messages once did, msgpack inside msgpack)."""


def test_no_module_outside_protocol_encodes_wire_messages_itself() -> None:
    users = {m for m in MODULES if not m.startswith("protocol") and "msgpack" in _imports(m, at_import_time=False)[1]}
    assert users <= set(MSGPACK_OUTSIDE_PROTOCOL), f"msgpack outside protocol/: {sorted(users - set(MSGPACK_OUTSIDE_PROTOCOL))}"
    assert set(MSGPACK_OUTSIDE_PROTOCOL) <= users, "an allowed module no longer uses msgpack: drop it from the list"

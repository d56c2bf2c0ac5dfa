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


# Test support: attackers (byzantine_trainer, lying_stage) are test code built on a trainer's model and stage
# worker, so they may import trainers/; the daemon, the CLI and the benches name trainers in configs only.
MAY_IMPORT_TRAINERS = ("peer.testing",)


def test_peer_never_imports_a_trainer_but_its_test_support() -> None:
    """The config names the trainer (`[trainer] name`); the daemon runs whatever it names, so no module of peer/
    outside its test support imports trainers/ (function-local imports count)."""
    bad = {m: sorted(t for t in _imports(m, at_import_time=False)[0] if t.split(".")[0] == "trainers")
           for m in MODULES if m.split(".")[0] == "peer" and not m.startswith(MAY_IMPORT_TRAINERS)}
    assert not {m: t for m, t in bad.items() if t}, bad


ATTACK_WORDS = ("byzantine", "lying", "liar", "attack")


def test_no_installed_trainer_holds_an_attack() -> None:
    """Attackers live in peer/testing/ (tests and benches reach them there): no module of trainers/ is named for
    one, none defines the attack library's names, and none imports the test support."""
    named = [m for m in MODULES if m.split(".")[0] == "trainers" and any(w in m.split(".")[-1] for w in ATTACK_WORDS)]
    assert not named, named
    for m in (m for m in MODULES if m.split(".")[0] == "trainers"):
        tree = ast.parse(MODULES[m].read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        assert not defined & {"Liar", "Lying", "craft", "ByzantineOptions"}, (m, defined)
        imported = _imports(m, at_import_time=False)[0]
        assert not {t for t in imported if t.startswith("peer.testing")}, (m, imported)


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


# ---- the behavioural check's own checks (peer/testing/conformance.py; it runs on real daemons in
# tests/test_swarm_conformance.py): a handle that breaks a promise fails it ---------------------------------------

class _Careless:
    """A handle that takes whatever it is given and closes once: the checks below must refuse it."""

    def __init__(self) -> None:
        self.shared: dict[str, dict] = {}
        self.closes = 0

    def share(self, name, tensors, **kw):
        self.shared[name] = tensors

    def average(self, group, *, mode="one"):
        return []

    def close(self) -> None:
        self.closes += 1
        if self.closes > 1:
            raise RuntimeError("closed twice")

    def should_stop(self) -> bool:
        return False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def test_the_conformance_check_fails_a_handle_that_breaks_a_promise() -> None:
    import peer.testing
    from peer.testing import conformance as c

    assert peer.testing.check_swarm is c.check_swarm  # exported, as trio.testing's checks are
    with pytest.raises(AssertionError, match="integer tensors"):
        c._bad_input(_Careless())  # a Swarm only in part: this step needs no more
    with pytest.raises(AssertionError, match="does not implement ClosableSwarm"):
        c.check_closable(_Careless())
    a = c.Outcome("a", "b", True, 0.25, 1.5)
    c.check_pair(a, c.Outcome("b", "a", False, 0.25, 2.5))
    for b in (c.Outcome("b", "a", False, 0.25, 2.6), c.Outcome("b", "a", True, 0.25, 2.5),
              c.Outcome("b", "a", False, 0.3, 2.5), c.Outcome("c", "a", False, 0.25, 2.5)):
        with pytest.raises(AssertionError):
            c.check_pair(a, b)

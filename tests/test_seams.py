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
from peer.testing.pace import scaled

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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60), cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


LEAVES = ("peertrain.swarm", "peertrain.pipeline")  # what a job sees of its daemon: its names and their types


def _every_import(module: str) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import statement of `module`, under TYPE_CHECKING too."""
    out = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append((node.module or "", [a.name for a in node.names]))
    return out


def test_the_leaves_name_nothing_of_the_daemon() -> None:
    """peertrain/swarm.py and peertrain/pipeline.py import the standard library, protocol/ and each other only,
    annotations included: the types crossing between a job and its daemon are the leaves' own."""
    bad = {m: sorted(n for n, _ in _every_import(m) if n.split(".")[0] not in sys.stdlib_module_names
                     and n.split(".")[0] != "protocol" and n not in LEAVES) for m in LEAVES}
    assert not {m: n for m, n in bad.items() if n}, bad


def test_jobs_take_the_pipeline_types_from_the_leaf() -> None:
    """No module of trainers/ or peertrain/ imports from peer/ a name that peertrain/pipeline.py defines."""
    from peertrain import pipeline

    leaf = {n for n, v in vars(pipeline).items() if getattr(v, "__module__", None) == pipeline.__name__}
    bad = {m: sorted(leaf & {x for n, names in _every_import(m) if n.split(".")[0] == "peer" for x in names})
           for m in MODULES if m.split(".")[0] in ("trainers", "peertrain")}
    assert not {m: n for m, n in bad.items() if n}, bad


@pytest.mark.slow
def test_mypy_is_clean_on_the_typed_packages() -> None:
    """mypy over protocol/ and peertrain/ (the leaf interface included): settings in pyproject.toml."""
    pytest.importorskip("mypy", reason="mypy is in the test extra: ./dev test installs it")
    out = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, timeout=scaled(300), cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


# ---- no part writes into another's attributes (peer/services.py) ------------------------------------

PLAIN_DATA = {"stats", "_stats"}
"""Attributes that hold plain counters (a ledger's or a stream's stats) that several parts add to: writing
into them is bookkeeping, not wiring."""
MUTATORS = {"append", "extend", "add", "update", "insert", "setdefault"}


def _chain(node: ast.AST) -> tuple[str, list[str]] | None:
    """`a.b.c` as ("a", ["b", "c"]); a chain on a call's result has the root "<call>"; None otherwise."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return node.id, attrs[::-1]
    if isinstance(node, ast.Call):
        return "<call>", attrs[::-1]
    return None


def _foreign_writes(source: str) -> list[tuple[int, str]]:
    """Writes by a class into objects it was given: in `__init__`, into an attribute of a constructor parameter
    (or of what was taken from one: `m = self.membership = daemon.membership`); in any method, into an attribute
    of such an object kept on self (`self.membership.x = ...`, `self.views.hooks.append(...)`); anywhere, a
    callable hooked into another object's attribute (`x.y = lambda ...`, `x.y = self.method`)."""
    out: list[tuple[int, str]] = []
    for cls in [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]:
        methods = [f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        own_methods = {f.name for f in methods}
        init = next((f for f in methods if f.name == "__init__"), None)
        given_locals: set[str] = set()
        given_attrs: set[str] = set()

        def given(expr: ast.AST) -> bool:
            c = _chain(expr)
            return c is not None and (c[0] in given_locals or (c[0] == "self" and bool(c[1]) and c[1][0] in given_attrs))

        if init is not None:
            given_locals = {a.arg for a in init.args.args[1:] + init.args.kwonlyargs}
            for st in ast.walk(init):
                if isinstance(st, ast.Assign) and given(st.value):
                    for t in st.targets:
                        c = _chain(t)
                        if isinstance(t, ast.Name):
                            given_locals.add(t.id)
                        elif c is not None and c[0] == "self" and len(c[1]) == 1:
                            given_attrs.add(c[1][0])
        for fn in methods:
            def foreign(target: ast.AST) -> bool:
                c = _chain(target)
                if c is None or PLAIN_DATA & set(c[1]):
                    return False
                if c[0] == "self":
                    return len(c[1]) >= 2 and c[1][0] in given_attrs
                return fn is init and c[0] in given_locals and len(c[1]) >= 1

            for st in ast.walk(fn):
                targets: list[ast.expr] = []
                value: ast.AST | None = None
                if isinstance(st, ast.Assign):
                    targets, value = st.targets, st.value
                elif isinstance(st, (ast.AugAssign, ast.AnnAssign)):
                    targets, value = [st.target], st.value
                for t in targets:
                    if not isinstance(t, ast.Attribute):
                        continue
                    c, v = _chain(t), _chain(value) if value is not None else None
                    hook = isinstance(value, ast.Lambda) or (v is not None and bool(v[1]) and (
                        v[0] == "<call>" or (v[0] == "self" and len(v[1]) == 1 and v[1][0] in own_methods)))
                    if foreign(t) or (hook and c is not None and not (c[0] == "self" and len(c[1]) == 1)):
                        out.append((st.lineno, ast.unparse(t)))
                if isinstance(st, ast.Call) and isinstance(st.func, ast.Attribute) and st.func.attr in MUTATORS \
                        and foreign(st.func.value):
                    out.append((st.lineno, ast.unparse(st.func)))
    return out


def test_no_part_of_the_daemon_writes_into_anothers_attributes() -> None:
    """What a service needs of another it asks for (a capability in peer/services.py, a method, a constructor
    argument); it never sets another's hooks (`topology.announce_stage = ...`), where construction order
    decided who owned them."""
    found = [f"{path.relative_to(ROOT)}:{line}: {what}"
             for path in sorted((ROOT / "peer").rglob("*.py")) for line, what in _foreign_writes(path.read_text())]
    assert not found, "writes into another object's attributes:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "class A:\n    def __init__(self, topology):\n        topology.announce = self.announce\n",
    "class A:\n    def __init__(self, daemon):\n        m = self.m = daemon.membership\n        m.views.keep.append(self.f)\n",
    "class A:\n    def __init__(self, daemon):\n        self.m = daemon.membership\n    def run(self):\n        self.m.verified = []\n",
    "class A:\n    def run(self, m):\n        m.keep = lambda p: True\n",
])
def test_the_foreign_write_rule_finds_hook_writes(source: str) -> None:
    assert _foreign_writes(source)


@pytest.mark.parametrize("implementation, protocols", [
    ("peer.membership.view_mode:FullView", ["peer.membership.view_mode:ViewMode"]),
    ("peer.membership.view_driver:ViewDriver", ["peer.membership.view_mode:ViewMode"]),
    ("peer.membership.auto_view:AutoView", ["peer.membership.view_mode:ViewMode"]),
    ("peer.membership.service:Membership", ["peer.membership.dialing:DialPolicy", "peer.membership.reach:Dialing"]),
    ("peer.topology.service:TopologyService", ["peer.services:KeepsSessions", "peer.services:MeasuresLinks",
                                               "peer.services:FollowsViewEdges"]),
    ("peer.nat.service:NatService", ["peer.services:ShapesAddresses", "peer.services:KeepsSessions"]),
    ("peer.pipeline.service:PipelineService", ["peer.services:HasRecordFields", "peer.services:KeepsSessions"]),
    ("peer.averaging.engine:GossipEngine", ["peer.services:HasRecordFields"]),
    ("peer.attach.service:AttachService", ["peer.services:HasRecordFields"]),
    ("peer.trainer_host:TrainerHost", ["peer.services:HasRecordFields"]),
])
def test_each_part_has_the_capabilities_it_is_wired_by(implementation: str, protocols: list[str]) -> None:
    """A capability is found by its methods (`Services.providing`): a misspelt one would drop out silently."""
    import importlib

    def load(spec: str):
        module, name = spec.split(":")
        return getattr(importlib.import_module(module), name)

    cls = load(implementation)
    for proto in map(load, protocols):
        for member, want in vars(proto).items():
            if member.startswith("_") or not callable(want):
                continue
            got = getattr(cls, member, None)
            assert callable(got), f"{cls.__name__} lacks {proto.__name__}.{member}"
            assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), \
                f"{cls.__name__}.{member}{inspect.signature(got)} differs from {proto.__name__}.{member}"
        for member in getattr(proto, "__annotations__", {}):
            assert hasattr(cls, member) or f"self.{member}" in inspect.getsource(cls), f"{cls.__name__} has no {member}"


# ---- the capabilities at work ----------------------------------------------------------------------

class _Part:
    """A service with only what the registry needs (name, run, status) and what each test adds."""

    name = "part"

    async def run(self, *, task_status=None) -> None: ...

    def status(self) -> dict:
        return {}


def test_the_registry_finds_a_capability_added_after_it_was_first_asked() -> None:
    from peer.services import KeepsSessions, Services

    class Keeper(_Part):
        def keeps_session(self, peer_id: str) -> bool:
            return peer_id == "kept"

    services = Services()
    services.add(_Part())
    assert services.providing(KeepsSessions) == []  # asked (and kept) before the keeper is added
    keeper = services.add(Keeper())
    assert services.providing(KeepsSessions) == [keeper]


def test_membership_advertises_and_keeps_what_the_services_say() -> None:
    from peer.membership.service import Membership
    from peer.services import Services
    from peer.session.router import Router
    from peer.session.transport import TransportConfig
    from peer.testing.swarm import swarm_config
    from protocol import identity as ident

    class Nat(_Part):
        def advertise_observed(self) -> bool:
            return False

        def verified_hosts(self) -> list[str]:
            return ["9.9.9.9"]

        def relayed_addresses(self) -> list[str]:
            return [f"8.8.8.8:4001/relay/{'r' * 20}"]

        def dial_relayed(self):
            return None

        def keeps_session(self, peer_id: str) -> bool:
            return peer_id == "relay"

    services = Services()
    cfg = swarm_config(swarm="s", mdns=False, membership={"views": "full"})
    m = Membership(config=cfg, transport=TransportConfig(identity=ident.generate_identity(), swarm="s"),
                   peer_id="me", router=Router(), listen_port=lambda: 4000, services=services)
    m.observed_hosts.append("7.7.7.7")
    assert m.advertised_addresses() == ["7.7.7.7:4000"] and m.advertise_observed() and not m.keeps_session("relay")
    services.add(Nat())  # the services are added after membership is built, as in the daemon
    assert m.advertised_addresses() == ["9.9.9.9:4000", f"8.8.8.8:4001/relay/{'r' * 20}"]  # observed: not advertised
    assert m.keeps_session("relay") and not m.keeps_session("other") and m.dial_relayed() is None


def test_our_topology_record_merges_what_the_services_contribute() -> None:
    from types import SimpleNamespace

    from peer.services import RecordFields, Services
    from peer.topology.service import SHARD_BYTES, TopologyService
    from protocol import identity as ident
    from protocol.schema.pipeline import StageAnnouncement
    from protocol.schema.training import TrainingFigures

    def contributor(fields: RecordFields) -> _Part:
        return type("Contributor", (_Part,), {"record_fields": lambda self: fields})()

    services = Services()
    stage = StageAnnouncement("p", 0, 2, cuts=[1])
    hosted, attached = TrainingFigures(5, 1.0, 0.5, 3.0), TrainingFigures(9, 1.0, 0.5, 3.0)
    for fields in (RecordFields(groups=["b"], shard_bytes=100), RecordFields(stage=stage),
                   RecordFields(training=None), RecordFields(training=hosted),
                   RecordFields(training=attached, groups=["a", "b"], shard_bytes=300)):
        services.add(contributor(fields))  # each its own type, in start order
    topo = object.__new__(TopologyService)  # the parts own_record reads, without a daemon
    topo.identity = ident.generate_identity()
    topo.me, topo.version, topo.links = ident.peer_id_from_public_bytes(ident.public_key_bytes(topo.identity)), 1, {}
    topo.edges = SimpleNamespace(neighbours={})
    topo.daemon = SimpleNamespace(services=services)
    topo._shard_bytes = SHARD_BYTES
    rec = topo.own_record()
    assert (rec.stage, rec.training, rec.groups) == (stage, hosted, ["a", "b"])  # the first stage and figures
    assert topo.shard_bytes == 300


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

"""Each package's import graph against the layer order written in its docstring.

A newcomer reads ``pytest_sky/__init__.py`` (``kube_emulator/__init__.py`` for the
Kubernetes API emulator, ``slurm_testbed/__init__.py`` for the Slurm testbed) to learn which
module may use which; this test keeps that true: no module imports one of a higher layer
(lazily inside a function or under ``TYPE_CHECKING`` included, since both still tie the two
together), no import circle, and no module missing from the list.  Between the plugin and
each piece of test infrastructure the door is one module: the emulator reaches the plugin
only through ``kube_emulator/product.py``, the testbed only through
``slurm_testbed/product.py``, and the plugin imports neither.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Package:
    name: str

    @property
    def root(self) -> Path:
        return REPO / self.name

    def module_name(self, path: Path) -> str:
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    @cached_property
    def modules(self) -> dict[str, Path]:
        return {self.module_name(p): p for p in self.root.rglob("*.py")}

    def short(self, name: str) -> str:
        return name.removeprefix(f"{self.name}.") if name != self.name else name

    def layers(self) -> dict[str, int]:
        """``{module: layer}`` from the numbered list in the package docstring."""
        doc = ast.get_docstring(ast.parse((self.root / "__init__.py").read_text())) or ""
        assert "Layers, lowest first" in doc, f"{self.name}'s docstring lost its layer list"
        out = {}
        for number, names in re.findall(r"^(\d+)\. (.+(?:\n {3}.+)*)$", doc, re.M):  # an item may go on, indented
            for name in " ".join(names.split()).split(":")[0].split(","):
                out[name.strip()] = int(number)
        return out

    def imports(self, name: str, of: str | None = None) -> set[str]:
        """Every module of package ``of`` (this one by default) that ``name`` imports,
        anywhere in its source; for this package, by short name."""
        of = of or self.name
        found = set()
        for node in ast.walk(ast.parse(self.modules[name].read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if _within(a.name, of)}
            elif isinstance(node, ast.ImportFrom) and node.module and _within(node.module, of):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in self.modules else node.module)
        if of != self.name:
            return found
        return {self.short(m) for m in found} - {self.short(name)}

    @cached_property
    def graph(self) -> dict[str, set[str]]:
        return {self.short(m): self.imports(m) for m in self.modules}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


PLUGIN = Package("pytest_sky")
EMULATOR = Package("kube_emulator")
TESTBED = Package("slurm_testbed")
PACKAGES = [
    pytest.param(PLUGIN, id="pytest_sky"),
    pytest.param(EMULATOR, id="kube_emulator"),
    pytest.param(TESTBED, id="slurm_testbed"),
]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_has_a_layer(package: Package) -> None:
    assert sorted(set(package.graph) - set(package.layers())) == []
    assert sorted(set(package.layers()) - set(package.graph)) == [], "the docstring names modules that do not exist"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_imports_from_a_higher_layer(package: Package) -> None:
    layer = package.layers()
    upward = [
        f"{m} (layer {layer[m]}) imports {d} (layer {layer[d]})"
        for m, deps in sorted(package.graph.items())
        for d in sorted(deps)
        if layer[d] > layer[m]
    ]
    assert upward == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package: Package) -> None:
    graph = package.graph
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                circles.append(" -> ".join([*path[path.index(d) :], d]))
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == []


@pytest.mark.parametrize("infrastructure", [EMULATOR, TESTBED], ids=["kube_emulator", "slurm_testbed"])
def test_test_infrastructure_reaches_the_plugin_only_through_its_product_module(infrastructure: Package) -> None:
    """One door: a change inside the plugin breaks the emulator (or testbed) in one visible place."""
    through = {infrastructure.short(m) for m in infrastructure.modules if infrastructure.imports(m, of=PLUGIN.name)}
    assert through == {"product"}


#: What the emulator's judges may take from the product: the node primitive and its terms
#: (and the kernel's capability numbers), never a policy list.  Admission, the reading of a
#: securityContext and a pod's sandbox judge the pods pytest-sky makes: a product bug in what
#: a pod may hold would otherwise be copied into the judge (issue 48).
JUDGE_MAY_USE = {"NodeSpec", "NODE_HOME", "passwd_with_home", "Confinement", "CAPABILITY_BITS"}
JUDGES = ("admission", "runtime", "sandbox")


def test_the_emulators_judges_take_no_policy_from_the_product() -> None:
    for name in JUDGES:
        tree = ast.parse(EMULATOR.modules[f"kube_emulator.{name}"].read_text())
        used = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "product"
        }
        used |= {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "kube_emulator.product"
            for alias in node.names
        }
        assert used <= JUDGE_MAY_USE, f"{name} takes {sorted(used - JUDGE_MAY_USE)} from the product"
    assert "product" not in EMULATOR.graph["admission"]
    assert "pytest_sky.backends.privileges" not in EMULATOR.imports("kube_emulator.product", of=PLUGIN.name)


#: Modules of the kubernetes client the plugin may not import: the websocket machinery behind
#: ``stream`` (the plugin speaks the port-forward protocol itself, ``ssh/kube_stream.py``) and
#: the kubeconfig loader's module, whose globals (``ExecProvider``) it once swapped.
NOT_PUBLIC = ("kubernetes.stream.ws_client", "kubernetes.config.kube_config")


def test_the_plugin_uses_the_kubernetes_client_through_its_public_face_only() -> None:
    """No private attribute or module global of the client is read, set or replaced: nothing
    under a name with a leading underscore, nothing of ``ws_client`` or ``kube_config``."""
    offences = []
    for name, path in PLUGIN.modules.items():
        tree = ast.parse(path.read_text())
        bound: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported = [
                    (a.name, (a.asname or a.name).split(".")[0]) for a in node.names if _within(a.name, "kubernetes")
                ]
            elif isinstance(node, ast.ImportFrom) and node.module and _within(node.module, "kubernetes"):
                imported = [(f"{node.module}.{a.name}", a.asname or a.name) for a in node.names]
            else:
                continue
            for full, local in imported:
                parts = full.split(".")
                if any(part.startswith("_") for part in parts) or any(_within(full, m) for m in NOT_PUBLIC):
                    offences.append(f"{name}: imports {full}")
                bound.add(local)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("__"):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in bound:
                    offences.append(f"{name}:{node.lineno}: {base.id}...{node.attr}")
    assert offences == []


@pytest.mark.parametrize("infrastructure", [EMULATOR, TESTBED], ids=["kube_emulator", "slurm_testbed"])
def test_the_plugin_never_imports_test_infrastructure(infrastructure: Package) -> None:
    assert [m for m in PLUGIN.modules if PLUGIN.imports(m, of=infrastructure.name)] == []


def test_the_checker_sees_an_upward_import() -> None:
    """The graph is read from the source: the package's own doors import the cluster."""
    graph = PLUGIN.graph
    assert "cluster" in graph["pytest_sky"] and "lifecycle" in graph["cluster"]
    assert "protocol" in graph["agent"] and graph["protocol"] == set()
    assert "cluster" in EMULATOR.graph["streams"] and "store" in EMULATOR.graph["kubelet"]


def test_the_package_exports_its_contract_lazily() -> None:
    """``import pytest_sky`` (which pytest does in every run, for the plugin) imports none of
    the cluster machinery; each public name is there on first use."""
    import subprocess
    import sys

    code = (
        "import importlib, sys, pytest_sky\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('pytest_sky'))\n"
        "source = {n: importlib.import_module(m) for n, m in pytest_sky._EXPORTS.items()}\n"
        "print(loaded, all(getattr(pytest_sky, n) is getattr(source[n], n) for n in pytest_sky.__all__))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['pytest_sky'] True"
    import pytest_sky as package

    assert sorted(package.__all__) == sorted(package._EXPORTS)

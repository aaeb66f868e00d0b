"""xscale as a package (pyproject.toml): `pip install .` from the checkout into a fresh venv
gives `import xscale` and the `xscale` command, as a user of their own training script gets them.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, VENV_BIN


def run(*argv: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(word) for word in argv], capture_output=True, text=True,
                          timeout=300, check=False, cwd=cwd)


def test_pip_install_from_the_checkout_gives_the_package_and_its_command(tmp_path: Path):
    """A wheel built from what the images copy (containers/*.def), installed into a venv that
    has none of xscale's dependencies: the package and the command need none of them to start.
    The test venv's setuptools builds it (--no-build-isolation) and --no-deps installs it, so
    the test needs no package index."""
    source = tmp_path / "source"  # pip builds in the source tree: a copy, not the checkout
    shutil.copytree(REPO / "python" / "xscale", source / "python" / "xscale",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", source)
    built = run(VENV_BIN / "python", "-m", "pip", "wheel", "-q", "--no-deps",
                "--no-build-isolation", "-w", tmp_path / "dist", source)
    assert built.returncode == 0, built.stdout + built.stderr
    wheel = next((tmp_path / "dist").glob("xscale-*.whl"))
    venv = tmp_path / "venv"
    made = run(sys.executable, "-m", "venv", venv)
    assert made.returncode == 0, made.stderr
    installed = run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", wheel)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    where = run(venv / "bin" / "python", "-c", "import xscale; print(xscale.__file__)",
                cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    packaged = sorted(path.relative_to(REPO / "python").as_posix()
                      for path in (REPO / "python" / "xscale").rglob("*.py"))
    listed = run(venv / "bin" / "python", "-c", "import importlib.util, sys; print(*(m for m in "
                 "sys.argv[1:] if importlib.util.find_spec(m) is None))",
                 *(name[:-len(".py")].replace("/", ".").removesuffix(".__init__")
                   for name in packaged), cwd=tmp_path)
    assert listed.stdout.strip() == "", f"modules missing from the wheel: {listed.stdout}"
    help_text = run(venv / "bin" / "xscale", "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "report" in help_text.stdout and "goodput-model" in help_text.stdout
    model = run(venv / "bin" / "xscale", "goodput-model", "--nodes", "64", "--runs", "1")
    assert model.returncode == 0 and "0 spares:" in model.stdout, model.stderr


def package_imports() -> dict[str, set[str]]:
    """Every module of python/xscale and the xscale modules it imports, anywhere in it (an
    import inside a function counts: it would hide a circle, not remove it)."""
    root = REPO / "python" / "xscale"
    files = {".".join(("xscale", *path.relative_to(root).with_suffix("").parts))
             .removesuffix(".__init__"): path for path in root.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "xscale":
                for alias in node.names:  # `from xscale.recovery import link`: the submodule
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in files else node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "xscale"}
        graph[module] = found - {module}
    return graph


def architecture_layers() -> dict[str, int]:
    """Each module's layer, from docs/ARCHITECTURE.md's "Layers of the package" block: one line
    a layer, bottom first, `N name: module module ...`."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("<!-- layers -->")[1]
    layers = {}
    for line in block.strip().strip("`").strip().splitlines():
        number, _, modules = line.partition(":")
        for module in modules.split():
            layers["xscale" if module == "xscale" else f"xscale.{module}"] = int(
                number.split()[0])
    return layers


def test_the_package_imports_one_way_down_its_layers():
    """No module imports one of a higher layer than its own (docs/ARCHITECTURE.md), and no
    modules import each other in a circle: a maintainer adding to one layer reads only the
    layers below. Every module has its layer."""
    graph, layers = package_imports(), architecture_layers()
    assert sorted(graph) == sorted(layers), "modules and docs/ARCHITECTURE.md's layers differ"
    upward = [f"{module} (layer {layers[module]}) imports {target} (layer {layers[target]})"
              for module, targets in graph.items() for target in targets
              if layers[target] > layers[module]]
    assert upward == []
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"an import circle: {' -> '.join((*path, module))}"
        if module not in done:
            for target in graph[module]:
                visit(target, (*path, module))
            done.add(module)

    for module in graph:
        visit(module, ())


def test_a_circle_or_an_upward_import_fails_the_layer_test(monkeypatch):
    """The check above can fail: dist importing the loop is named, and a circle is found."""
    graph = package_imports()
    monkeypatch.setitem(graph, "xscale.dist", graph["xscale.dist"] | {"xscale.runtime"})
    monkeypatch.setattr(sys.modules[__name__], "package_imports", lambda: graph)
    with pytest.raises(AssertionError, match="xscale.dist .layer 3. imports xscale.runtime"):
        test_the_package_imports_one_way_down_its_layers()
    monkeypatch.setitem(graph, "xscale.dist", graph["xscale.dist"] - {"xscale.runtime"}
                        | {"xscale.reductions"})
    layers = architecture_layers()
    monkeypatch.setattr(sys.modules[__name__], "architecture_layers",
                        lambda: {**layers, "xscale.dist": layers["xscale.reductions"]})
    with pytest.raises(AssertionError, match="an import circle"):
        test_the_package_imports_one_way_down_its_layers()


def test_the_command_names_an_unknown_subcommand_in_one_line():
    proc = run(VENV_BIN / "xscale", "reprot")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("xscale: error: no command 'reprot' "
                           "(one of: report, goodput-model, settings)\n")


PUBLIC_MODULES = ("hf", "ds", "vision")
TRAINERS = sorted((REPO / "python").glob("*.py"))


def xscale_names_used(path: Path) -> set[str]:
    """Every `xscale.NAME`, `from xscale import NAME` and `from xscale.MODULE import NAME` in
    PATH, plus MODULE.NAME for the public modules it imports ("hf.XscaleTrainer")."""
    tree = ast.parse(path.read_text())
    modules = {"xscale"}
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "xscale":
            used |= {alias.name for alias in node.names}
            modules |= {alias.name for alias in node.names if alias.name in PUBLIC_MODULES}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xscale."):
            used |= {f"{node.module[7:]}.{alias.name}" for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in modules:
            prefix = "" if node.value.id == "xscale" else f"{node.value.id}."
            used.add(prefix + node.attr)
    return used


@pytest.mark.parametrize("path", TRAINERS, ids=lambda path: path.name)
def test_the_trainers_use_only_the_public_api(path: Path):
    """The four trainers are the examples of the API: what they use of xscale is public,
    documented and in xscale.__all__ or a public module, with no leading underscore."""
    import importlib

    import xscale

    used = xscale_names_used(path)
    assert used, f"{path.name} uses nothing of xscale"
    for name in sorted(used):
        if name in PUBLIC_MODULES:  # `from xscale import hf`
            assert importlib.import_module(f"xscale.{name}").__doc__, name
            continue
        module, _, attribute = name.rpartition(".")
        owner = importlib.import_module(f"xscale.{module}") if module else xscale
        assert module in PUBLIC_MODULES or name in xscale.__all__, \
            f"{path.name} uses xscale.{name}, which is not public"
        assert not attribute.startswith("_"), name
        assert getattr(owner, attribute).__doc__, f"xscale.{name} has no docstring"


def test_every_public_name_has_a_docstring_and_importing_xscale_loads_none_of_them():
    code = ("import sys, xscale; loaded = [m for m in sys.modules if m.startswith('xscale.')]; "
            "print(loaded); assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, capture_output=True)
    import xscale

    for name in xscale.__all__:
        assert getattr(xscale, name).__doc__, f"xscale.{name} has no docstring"

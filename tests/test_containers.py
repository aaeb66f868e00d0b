"""containers/: the definition files copy what exists, the cotainr environment parses and names
xscale's packages, and build.sh picks a real builder or fails with one line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

CONTAINERS = REPO / "containers"
DEF_FILES = sorted(CONTAINERS.glob("*.def"))
BUILD_SH = CONTAINERS / "build.sh"
# What the trainers import beyond torch/torchvision (python/, requirements.txt).
NEEDED = {"deepspeed", "transformers", "accelerate", "datasets", "tokenizers", "py-spy"}


def sections(def_file: Path) -> dict[str, list[str]]:
    """The header ('' key) and every %section of a definition file, as stripped lines (a line
    continued with a backslash joined to the next)."""
    found: dict[str, list[str]] = {"": []}
    current = ""
    for raw in def_file.read_text().replace("\\\n", " ").splitlines():
        line = raw.strip()
        if line.startswith("%"):
            current = line.split()[0][1:]
            found[current] = []
        elif line and not line.startswith("#"):
            found[current].append(line)
    return found


def header(def_file: Path) -> dict[str, str]:
    pairs = (line.split(":", 1) for line in sections(def_file)[""])
    return {key.strip().lower(): value.strip() for key, value in pairs}


def test_there_are_lumi_and_nvidia_definitions():
    assert {path.name for path in DEF_FILES} >= {"lumi-pytorch.def", "nvidia-pytorch.def"}


@pytest.mark.parametrize("def_file", DEF_FILES, ids=lambda p: p.name)
def test_files_sources_exist_and_populate_runscripts(def_file):
    files = sections(def_file).get("files", [])
    pairs = [line.split() for line in files]
    assert pairs, f"{def_file.name} has no %files"
    for pair in pairs:
        assert len(pair) == 2, pair
        assert (REPO / pair[0]).exists(), f"{def_file.name}: %files source {pair[0]} is missing"
    destinations = dict(pairs)
    assert destinations.get("runscripts") == "/runscripts"
    assert destinations.get("python") == "/opt/xscale/python"
    # The entrypoints the templates call must be among what is copied.
    for entry in ("run.sh", "run-profile.sh", "lib/entrypoint.sh"):
        assert (REPO / "runscripts" / entry).is_file()


@pytest.mark.parametrize("def_file", DEF_FILES, ids=lambda p: p.name)
def test_definitions_install_the_trainers_packages_and_xscale_itself(def_file):
    parts = sections(def_file)
    post = " ".join(parts.get("post", []))
    installed = set(re.findall(r"[A-Za-z][\w-]*", " ".join(
        line for line in parts.get("post", []) if line.startswith("pip install")
    )))
    assert NEEDED <= installed, NEEDED - installed
    # DeepSpeed is source-only: an isolated build would pull a second (CUDA) torch.
    assert re.search(r"pip install[^;]*--no-build-isolation[^;]*deepspeed", post)
    # xscale as a package, from the pyproject.toml copied beside python/; nothing on PYTHONPATH.
    files = dict(line.split() for line in parts["files"])
    assert files.get("pyproject.toml") == "/opt/xscale/pyproject.toml"
    assert any(line.startswith("pip install") and line.split()[-1] == "/opt/xscale"
               for line in parts["post"])
    assert not any("PYTHONPATH" in line for line in parts.get("environment", []))


def test_lumi_definition_extends_the_workshop_image_in_its_conda_environment():
    lumi = CONTAINERS / "lumi-pytorch.def"
    head = header(lumi)
    assert head["bootstrap"] == "localimage"
    assert head["from"] == (
        "/appl/local/containers/sif-images/"
        "lumi-pytorch-rocm-6.2.4-python-3.12-pytorch-v2.7.1.sif"
    )
    post = sections(lumi)["post"]
    activate = post.index("$WITH_CONDA")
    assert activate < min(i for i, line in enumerate(post) if line.startswith("pip install"))


def test_nvidia_definition_starts_from_ngc():
    head = header(CONTAINERS / "nvidia-pytorch.def")
    assert head["bootstrap"] == "docker"
    assert head["from"].startswith("nvcr.io/nvidia/pytorch:")


def test_cotainr_environment_parses_and_names_the_packages():
    path = CONTAINERS / "lumi-cotainr.yml"
    env = yaml.safe_load(path.read_text())
    assert env["name"]
    deps = env["dependencies"]
    conda = {dep.split("=")[0] for dep in deps if isinstance(dep, str)}
    assert {"python", "pip"} <= conda
    pip = next(dep["pip"] for dep in deps if isinstance(dep, dict))
    names = {re.split(r"[=<>\[ ]", item)[0] for item in pip if not item.startswith("-")}
    assert {"torch", "torchvision"} | NEEDED <= names
    # ROCm wheels, not PyPI's CUDA ones.
    assert any("download.pytorch.org/whl/rocm" in item for item in pip)
    assert all("+rocm" in item for item in pip if item.split("==")[0] in {"torch", "torchvision"})


def run_build(work: Path, path_dirs: list[Path], *args: str, as_user: bool = False):
    env = {"PATH": os.pathsep.join(str(p) for p in path_dirs), "HOME": str(work),
           "OUT_DIR": str(work / "out")}
    return subprocess.run(
        [*(unprivileged() if as_user else []), "bash", str(BUILD_SH), *args], env=env,
        capture_output=True, text=True, timeout=30, check=False,
    )


def unprivileged() -> list[str]:
    """A prefix that runs the command as an ordinary user (nobody) when the tests run as root:
    the builder's flags differ for root, and LUMI users are not root."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is needed to run build.sh as a normal user")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture
def work() -> Iterator[Path]:
    """A scratch directory an unprivileged user can write to (pytest's tmp_path is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="xscale-build-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def system_dirs() -> list[Path]:
    """A PATH with the basic tools but no singularity/apptainer (and not the test shim)."""
    return [Path("/usr/bin"), Path("/bin")]


def fake_tool(directory: Path, name: str, version: str) -> Path:
    """An executable NAME that answers --version and otherwise logs its cwd and argv."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    tool = directory / name
    log = directory / f"{name}.log"
    tool.write_text(
        "#!/bin/bash\n"
        f'if [[ $1 == --version ]]; then echo "{version}"; exit 0; fi\n'
        f'printf "%s\\n" "$PWD" "$@" > "{log}"\n'
    )
    tool.chmod(0o755)
    log.touch(mode=0o666)
    log.chmod(0o666)
    return log


def test_build_without_singularity_or_apptainer_is_one_line_and_exit_2(work):
    for tool in ("singularity", "apptainer"):
        assert not any((d / tool).exists() for d in system_dirs()), f"{tool} is installed here"
    proc = run_build(work, system_dirs())
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("build.sh: error: ")
    assert "singularity" in lines[0] and "apptainer" in lines[0]


def test_build_ignores_the_test_shim(work):
    proc = run_build(work, [REPO / "tests" / "shim", *system_dirs()])
    assert proc.returncode == 2
    assert "neither singularity nor apptainer" in proc.stderr


def test_build_as_a_user_runs_apptainer_from_the_repository_root_with_fakeroot(work):
    log = fake_tool(work / "bin", "apptainer", "apptainer version 1.3.4")
    proc = run_build(work, [work / "bin", *system_dirs()], "nvidia", as_user=True)
    assert proc.returncode == 0, proc.stderr
    cwd, *argv = log.read_text().splitlines()
    assert Path(cwd) == REPO  # %files paths are relative to where the build runs
    assert argv == ["build", "--fakeroot", str(work / "out" / "xscale-nvidia.sif"),
                    "containers/nvidia-pytorch.def"]


def test_build_as_a_user_goes_through_proot_when_it_is_on_path(work):
    # LUMI: no fakeroot; SingularityCE builds unprivileged once proot is found.
    log = fake_tool(work / "bin", "singularity", "singularity-ce version 4.1.5")
    fake_tool(work / "bin", "proot", "proot 5.4.0")
    proc = run_build(work, [work / "bin", *system_dirs()], "lumi", as_user=True)
    assert proc.returncode == 0, proc.stderr
    _, *argv = log.read_text().splitlines()
    assert argv == ["build", str(work / "out" / "xscale-lumi.sif"), "containers/lumi-pytorch.def"]


def test_build_rejects_an_unknown_target(work):
    proc = run_build(work, system_dirs(), "frontier")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "unknown target 'frontier'" in proc.stderr


# --- one software stack: constraints.txt --------------------------------------------------------

CONSTRAINTS = REPO / "constraints.txt"
IMAGE_CONSTRAINTS = "/opt/xscale/constraints.txt"


def pins(lines: list[str]) -> dict[str, str]:
    """NAME -> VERSION for every NAME==VERSION requirement line (comments and options skipped)."""
    found = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==", 1)
            found[name.strip().lower()] = version.strip()
    return found


def constraint_pins() -> dict[str, str]:
    return pins(CONSTRAINTS.read_text().splitlines())


def test_constraints_pin_what_the_trainers_need_and_leave_torch_to_each_image():
    pinned = constraint_pins()
    assert NEEDED <= set(pinned), NEEDED - set(pinned)
    # A torch constraint the image's ROCm/CUDA build does not meet would make pip replace it.
    assert not {"torch", "torchvision"} & set(pinned)


@pytest.mark.parametrize("def_file", DEF_FILES, ids=lambda p: p.name)
def test_images_install_the_constrained_versions(def_file):
    parts = sections(def_file)
    files = dict(line.split() for line in parts["files"])
    assert files.get("constraints.txt") == IMAGE_CONSTRAINTS
    installs = [line for line in parts["post"] if line.startswith("pip install")]
    assert installs
    for line in installs:
        assert f"-c {IMAGE_CONSTRAINTS}" in line, line
        assert "==" not in line, f"a version outside constraints.txt: {line}"


def test_requirements_take_their_versions_from_the_constraints():
    for name in ("requirements.txt", "requirements-deepspeed.txt"):
        lines = (REPO / name).read_text().splitlines()
        assert "-c constraints.txt" in lines, name
        # Only the venv's own CPU torch is pinned outside constraints.txt.
        assert set(pins(lines)) <= {"torch", "torchvision"}, name


def test_cotainr_environment_repeats_the_constraints():
    env = yaml.safe_load((CONSTRAINTS.parent / "containers" / "lumi-cotainr.yml").read_text())
    pip = next(dep["pip"] for dep in env["dependencies"] if isinstance(dep, dict))
    pinned = {name: version for name, version in pins(pip).items()
              if name not in {"torch", "torchvision"}}
    assert pinned and all(constraint_pins().get(name) == version
                          for name, version in pinned.items()), pinned


def test_the_test_venv_is_the_constrained_stack():
    """The unit tests run against the versions the images get (constraints.txt): every pin is
    installed, at its version. `make setup` reinstalls only when a requirements file changes, so
    a stale venv, or a pin added without its requirement, shows up here."""
    from importlib import metadata

    def installed(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    wrong = {name: (installed(name), version) for name, version in constraint_pins().items()
             if installed(name) != version}
    assert wrong == {}, f"installed vs pinned: {wrong}"

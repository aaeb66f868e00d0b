"""The environment tests/bench/shared_opens.sh stages: the installed distributions a rank of
tests/bench/ddp_step.py imports (torch and what it pulls in), every file of each as pip recorded
it, linked (or copied, across file systems) into DEST/site-packages. Prints its size.

    python tests/bench/torch_env.py DEST

The distributions are found by running the step itself, in this process, as a group of one, and
mapping every module loaded from site-packages to the distribution that installed it.
"""

import os
import shutil
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import ddp_step
import torch.distributed as dist


def imported_top_levels(site_packages: Path) -> set[str]:
    """Top-level names (package or module) of every loaded module that lives in site-packages."""
    names = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and Path(path).is_relative_to(site_packages):
            names.add(Path(path).relative_to(site_packages).parts[0].removesuffix(".py"))
    return names


def distributions_of(top_levels: set[str]) -> set[str]:
    owners = metadata.packages_distributions()
    return {dist_name for name in top_levels for dist_name in owners.get(name, [])}


def link_tree(distribution: str, dest: Path) -> tuple[int, int]:
    """Every file pip recorded for the distribution, under dest; (files, bytes)."""
    files = size = 0
    for record in metadata.distribution(distribution).files or []:
        source = Path(record.locate())
        if ".." in record.parts or not source.is_file():
            continue  # a script in the venv's bin/, or a .pyc pip did not write (--no-compile)
        target = dest / record
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)
        files += 1
        size += source.stat().st_size
    return files, size


def main() -> None:
    dest = Path(sys.argv[1]) / "site-packages"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ddp_step.one_step()
    dist.destroy_process_group()
    site_packages = Path(sysconfig.get_paths()["purelib"])
    names = sorted(distributions_of(imported_top_levels(site_packages)))
    shutil.rmtree(dest, ignore_errors=True)
    totals = [link_tree(name, dest) for name in names]
    files, size = sum(t[0] for t in totals), sum(t[1] for t in totals)
    print(f"{len(names)} distributions ({', '.join(names)}): {files} files, {size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()

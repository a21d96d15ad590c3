"""The engine's sub-packages import one way: loop -> spec -> runtime -> kernels.

Each probe imports every module of a layer in a fresh interpreter and lists
the metrale modules that came with it, so a stray import (the runtime reaching
for the loop, the loop for a benchmark) fails here rather than as a cycle
later.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import metrale.engine

ENGINE_DIR = Path(metrale.engine.__file__).parent


def modules_of(package: str) -> list[str]:
    """``package`` and every module in its folder, by dotted name."""
    folder = ENGINE_DIR.joinpath(*package.split(".")[2:])
    return [package] + [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(folder)])]


def loaded_after_importing(modules: list[str]) -> set[str]:
    probe = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print('\\n'.join(m for m in sys.modules if m.startswith(('metrale', 'typer', 'rich'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return set(done.stdout.split())


def under(loaded: set[str], *packages: str) -> set[str]:
    return {m for m in loaded if any(m == p or m.startswith(p + ".") for p in packages)}


def test_the_runtime_loads_none_of_the_loop_spec_bench_train_or_loader() -> None:
    loaded = loaded_after_importing(modules_of("metrale.engine.runtime"))
    # Two leaves of the loader that import only the standard library: where
    # files live (home) and what is wrong with a damaged one (file_checks).
    leaves = {"metrale.engine.load.home", "metrale.engine.load.file_checks"}
    allowed = {"metrale", "metrale.engine", "metrale.engine.load", *leaves}
    outside = {
        m
        for m in loaded
        if not m.startswith(("metrale.engine.runtime", "metrale.engine.kernels"))
        and m not in allowed
    }
    assert outside == set()


def test_the_kernels_load_nothing_of_the_runtime() -> None:
    loaded = loaded_after_importing(modules_of("metrale.engine.kernels"))
    assert under(loaded, "metrale.engine.runtime", "metrale.engine.spec") == set()


def test_the_loop_and_its_draft_sources_load_no_bench_train_or_cli_module() -> None:
    loop = [
        "metrale.engine.engine",
        *modules_of("metrale.engine.step"),
        *modules_of("metrale.engine.spec"),
    ]
    loaded = loaded_after_importing([*loop, *modules_of("metrale.engine.load")])
    assert under(loaded, "metrale.engine.bench", "metrale.engine.train", "metrale.cli") == set()
    assert under(loaded, "typer", "rich") == set()


def test_no_engine_module_imports_typer_or_rich() -> None:
    every = [
        m
        for package in ("bench", "kernels", "load", "runtime", "spec", "step", "train")
        for m in modules_of(f"metrale.engine.{package}")
    ]
    top = [
        f"metrale.engine.{m.name}" for m in pkgutil.iter_modules([str(ENGINE_DIR)]) if not m.ispkg
    ]
    loaded = loaded_after_importing([*top, *every])
    assert under(loaded, "typer", "rich", "metrale.cli") == set()


def test_importing_the_engine_package_resolves_its_public_names_lazily() -> None:
    loaded = loaded_after_importing(["metrale.engine"])
    assert loaded & {"metrale.engine.engine", "metrale.engine.load.loader"} == set()
    for name in metrale.engine.__all__:
        assert getattr(metrale.engine, name) is not None

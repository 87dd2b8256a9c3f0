"""Data flows one way: resources import nothing of the engine above them, and the scheduler and
the model runner share `mstar.engine.batch` instead of importing each other.

Above the resources, the sampler may read two leaf value modules of the engine (the request's
`SamplingParams`, the `TokenLogprob` it hands back); they import nothing of `mstar.engine`, so
no import path leads from them back to a resource.

Read from the source with `ast` (every `import` and `from ... import`, at any depth, type-only
ones included), so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "engine_pod" / "mstar" / "engine"
LEAVES = ("mstar.engine.outputs", "mstar.engine.sampling_params")


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, absolute names (the package uses no relative imports)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}: relative import; the layering check reads names")
            module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _engine_imports(path: Path) -> set[str]:
    return {m for m in _imports(path) if m == "mstar.engine" or m.startswith("mstar.engine.")}


def test_the_reader_sees_imports_at_any_depth(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from mstar.engine.scheduler import Scheduler\n")
    assert "mstar.engine.scheduler" in _engine_imports(src)
    src.write_text("from . import x\n")
    with pytest.raises(AssertionError, match="relative import"):
        _imports(src)


def _above_resources(name: str) -> bool:
    inside = (*LEAVES, "mstar.engine.resources")
    return not any(name == m or name.startswith(m + ".") for m in inside)


def test_resources_import_nothing_above_them() -> None:
    files = sorted((ENGINE / "resources").rglob("*.py"))
    assert len(files) > 20  # the walk found the package
    upward = {
        f"{path.relative_to(ENGINE)}: {name}"
        for path in files
        for name in _engine_imports(path)
        if _above_resources(name)
    }
    assert not upward
    assert _above_resources("mstar.engine.cuda_graphs")  # what the resources imported before


@pytest.mark.parametrize("leaf", LEAVES)
def test_the_leaf_modules_import_nothing_of_the_engine(leaf: str) -> None:
    assert not _engine_imports(ENGINE / (leaf.rsplit(".", 1)[1] + ".py"))


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [("scheduler.py", "mstar.engine.model_runner"), ("model_runner.py", "mstar.engine.scheduler")],
)
def test_scheduler_and_model_runner_do_not_import_each_other(module: str, forbidden: str) -> None:
    names = _engine_imports(ENGINE / module)
    assert "mstar.engine.batch" in {n.rsplit(".", 1)[0] for n in names} | names
    assert not {n for n in names if n == forbidden or n.startswith(forbidden + ".")}

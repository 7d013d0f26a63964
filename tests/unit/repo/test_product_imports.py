"""The product never imports the harness: no module outside ``testing/``, ``demo/`` and ``device_check/`` (the
commands that run the harness: ``mbx demo`` / ``mbx bench`` and the GPU check) imports ``testing`` or ``demo``.

Read from the source (every import statement, those inside functions included), so that an import on a rarely
run path is caught as surely as one at the top of a module. The one exception is the command line's lazy import
of ``demo`` for the ``mbx demo`` / ``mbx bench`` commands themselves.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit]

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = "megatron_bridge_ext"
HARNESS = ("testing", "demo")
HARNESS_USERS = ("device_check",)
"""Packages that run the harness and are not the product: the GPU check measures the tiny model."""
DEMO_COMMANDS = ("cli",)
"""Packages whose functions may import ``demo`` (the commands that run it), never ``testing``."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module an ``from ... import`` names, relative levels resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(path: Path) -> list[tuple[str, int, bool]]:
    """Every module ``path`` imports, as (dotted name, line, inside a function); ``from A import b`` gives ``A.b``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module, is_package = _module_name(path), path.name == "__init__.py"
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(child) for child in ast.walk(node) if child is not node)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno, id(node) in in_function) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, is_package)
            out += [(f"{source}.{alias.name}", node.lineno, id(node) in in_function) for alias in node.names]
    return out


def _harness_part(name: str) -> str | None:
    """``testing`` or ``demo`` when ``name`` is that package of ours or inside it."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == PACKAGE and parts[1] in HARNESS:
        return parts[1]
    return None


def product_files() -> list[Path]:
    return sorted(p for p in (ROOT / PACKAGE).rglob("*.py")
                  if p.relative_to(ROOT / PACKAGE).parts[0] not in HARNESS + HARNESS_USERS)


def offenders(files: list[Path]) -> list[str]:
    """``file:line imports name`` for every import of the harness from the product, the allowed one aside."""
    found = []
    for path in files:
        top = path.relative_to(ROOT / PACKAGE).parts[0]
        for name, line, in_function in imported_modules(path):
            part = _harness_part(name)
            if part is None or (part == "demo" and in_function and top in DEMO_COMMANDS):
                continue
            found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return found


def test_no_product_module_imports_the_harness():
    files = product_files()
    assert any(p.name == "config.py" for p in files) and not any("testing" in p.parts for p in files)
    problems = offenders(files)
    assert not problems, "the product imports the harness:\n" + "\n".join(problems)


def test_the_check_sees_every_spelling_of_an_import(tmp_path, monkeypatch):
    """Top-level, function-level, relative and ``from package import module``; the cli exception only in functions."""
    package = tmp_path / PACKAGE
    (package / "estimate").mkdir(parents=True)
    (package / "cli").mkdir()
    sources = {
        "estimate/a.py": "from megatron_bridge_ext.testing import tiny_model\n",
        "estimate/b.py": "def f():\n    import megatron_bridge_ext.demo.train\n",
        "estimate/c.py": "def f():\n    from ..testing.tiny_model import TinyGPTShape\n",
        "estimate/d.py": "from megatron_bridge_ext import demo\n",
        "cli/e.py": "def f():\n    from megatron_bridge_ext.demo import train\n",
        "cli/f.py": "from megatron_bridge_ext.demo import bench\n",
        "cli/g.py": "def f():\n    from megatron_bridge_ext.testing import variants\n",
        "estimate/h.py": "from megatron_bridge_ext.estimate import report\nimport megatron_bridge_ext.testing_notes\n",
    }
    for name, text in sources.items():
        (package / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    flagged = {line.split(":")[0].split("/", 1)[1] for line in offenders(sorted(package.rglob("*.py")))}
    assert flagged == {"estimate/a.py", "estimate/b.py", "estimate/c.py", "estimate/d.py", "cli/f.py", "cli/g.py"}

"""The documentation: the site builds strictly, every path it names exists, the layout page lists every module.

README.md and docs/ name modules and files (``megatron_bridge_ext/peft/sp_lora.py``,
``megatron_bridge_ext.levers.recompute.attention.attention_kind_from_config``, ``tests/...``, ``scripts/...``,
``benchmarks/...``); when a module moves, the page that names it must follow, and these tests say
which page and which name.
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = "megatron_bridge_ext"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LAYOUT = ROOT / "docs" / "layout.md"

pytestmark = pytest.mark.unit

# A path under one of the tree's roots, not inside a longer path or URL; braces as in a shell (a{1,2}).
PATH = re.compile(r"(?<![\w./-])((?:megatron_bridge_ext|tests|scripts|benchmarks)/(?:[\w.*/-]|\{[\w.,-]*\})*)")
DOTTED = re.compile(r"(?<![\w./-])(megatron_bridge_ext(?:\.[A-Za-z_]\w*)+)")
README_LINK = re.compile(r"\]\((docs/[^)#\s]*)(?:#([^)\s]*))?\)")


def _expand(path: str) -> list[str]:
    """The paths a shell's brace expansion gives (``tp{1,2,4}.json`` -> three names)."""
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    return [p for alt in match.group(1).split(",") for p in _expand(path[:match.start()] + alt + path[match.end():])]


def missing_path(reference: str, root: Path = ROOT) -> list[str]:
    """The expansions of ``reference`` that name nothing in the tree (a glob, or a ``--save`` prefix, must match)."""
    out = []
    for path in _expand(reference.rstrip(".")):
        target = root / path
        if "*" in path:
            found = glob.glob(str(target))
        else:
            found = target.exists() or glob.glob(str(target) + ".*")
        if not found:
            out.append(path)
    return out


def _defines(source: str, name: str) -> bool:
    """Whether a module's source defines or exports ``name`` (def, class, assignment, import, lazy-export string)."""
    patterns = (rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", rf"^{name}\s*[:=]",
                rf"^\s*(?:from\s+\S+\s+)?import\s[^\n]*\b{name}\b", rf"^\s+{name},", rf"[\"']{name}[\"']")
    return any(re.search(p, source, re.M) for p in patterns)


def missing_dotted(reference: str, root: Path = ROOT) -> str | None:
    """Why the dotted ``reference`` names nothing (None when it names a module, or a name its module defines)."""
    parts = reference.split(".")
    here = root / parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if (here / part / "__init__.py").exists():
            here = here / part
        elif (here / f"{part}.py").exists():
            module = here / f"{part}.py"
            if i + 1 < len(parts) and not _defines(module.read_text(), parts[i + 1]):
                return f"{'.'.join(parts[:i + 1])} defines no {parts[i + 1]}"
            return None
        else:
            init = here / "__init__.py"
            if _defines(init.read_text(), part):
                return None
            return f"{'.'.join(parts[:i])} has no module or name {part}"
    return None


def _references(pattern: re.Pattern) -> list[tuple[str, str]]:
    return sorted({(page.relative_to(ROOT).as_posix(), m) for page in PAGES for m in pattern.findall(page.read_text())})


def test_every_path_the_docs_name_exists():
    refs = _references(PATH)
    assert len(refs) > 50  # the pattern finds the pages' paths at all
    problems = [f"{page}: {path}" for page, ref in refs for path in missing_path(ref)]
    assert problems == []


def test_every_dotted_name_the_docs_use_exists():
    refs = _references(DOTTED)
    assert len(refs) > 10
    problems = [f"{page}: {ref}: {why}" for page, ref in refs if (why := missing_dotted(ref))]
    assert problems == []


def _anchors(page: Path) -> set[str]:
    """The anchors mkdocs gives the page's headings (Python-Markdown's toc slugs)."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_readmes_links_into_docs_exist():
    """mkdocs checks the pages' own links; the README lies outside the site, so its links are checked here."""
    links = README_LINK.findall((ROOT / "README.md").read_text())
    assert len(links) > 10 and any(anchor for _, anchor in links)
    problems = [f"{link}#{anchor}" if (ROOT / link).is_file() else link for link, anchor in links
                if not (ROOT / link).is_file() or (anchor and anchor not in _anchors(ROOT / link))]
    assert problems == []


def test_the_reference_checks_catch_what_is_not_there():
    assert missing_path("megatron_bridge_ext/levers/lora_input/sp_lora.py") == []
    assert missing_path("megatron_bridge_ext/peft/no_such_module.py") == ["megatron_bridge_ext/peft/no_such_module.py"]
    assert missing_path("scripts/{setup_env,no_such_script}.sh") == ["scripts/no_such_script.sh"]
    assert missing_path("benchmarks/*-no-such-run.json") == ["benchmarks/*-no-such-run.json"]
    assert missing_dotted("megatron_bridge_ext.levers.recompute.attention.attention_kind_from_config") is None
    assert missing_dotted("megatron_bridge_ext.peft.LoRA") is None  # a lazy export of the package
    assert missing_dotted("megatron_bridge_ext.levers.recompute.attention.no_such_function") == (
        "megatron_bridge_ext.levers.recompute.attention defines no no_such_function")
    assert missing_dotted("megatron_bridge_ext.no_such_module.x") == (
        "megatron_bridge_ext has no module or name no_such_module")
    assert "decision-order" in _anchors(ROOT / "docs" / "tools" / "diagnose.md")
    assert "no-such-section" not in _anchors(ROOT / "docs" / "tools" / "diagnose.md")
    found = PATH.findall("see `tests/unit/test_docs.py`, https://host/tests/x and tests/data/, grid-tp{1,2}.json")
    assert found == ["tests/unit/test_docs.py", "tests/data/"]


def _listed_modules() -> list[str]:
    return re.findall(rf"^- `({PACKAGE}/[\w/]+\.py)`: \S", LAYOUT.read_text(), re.M)


def test_the_layout_page_lists_every_module_once_and_nothing_else():
    listed = _listed_modules()
    present = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / PACKAGE).rglob("*.py")
                     if "__pycache__" not in p.parts)
    assert len(listed) == len(set(listed)), "listed twice: " + str(sorted({m for m in listed if listed.count(m) > 1}))
    assert sorted(set(present) - set(listed)) == [], "modules the layout page does not list"
    assert sorted(set(listed) - set(present)) == [], "the layout page lists modules that do not exist"


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:] + "\n(install mkdocs: pip install -r requirements/docs.txt)"
    assert (tmp_path / "site" / "levers" / "lora-input" / "index.html").is_file()


def test_a_broken_anchor_fails_the_strict_build(tmp_path):
    """The site's configuration turns a link to a missing anchor into an error, not a warning that passes."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + "\n[broken](levers/allocator.md#no-such-section)\n")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "-f", str(tmp_path / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "does not contain an anchor '#no-such-section'" in done.stderr

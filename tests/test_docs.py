"""The docs as reference: sizes, one BENCHMARKS.md section per benchmark script, headings without commit
hashes or issue numbers, no reference to a repository file that does not exist, no measurements in code
comments. Pure text checks on the files as they are in the working tree: fast, no imports of the package.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *DOCS]
#: Top-level folders whose files the pages name by path.
ROOTS = ("cpcompile", "benchmarks", "docs", "tests", "examples")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (a ``#`` line inside a fence is a comment, not a heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _headings(path: Path) -> list[str]:
    return [line for line in _prose(_text(path)) if re.match(r"#{1,6} ", line)]


def test_benchmarks_md_size():
    size = len((REPO / "BENCHMARKS.md").read_bytes())
    assert size <= 40 * 1024, f"BENCHMARKS.md is {size} bytes, over 40 KB: trim what a script prints, not history"


def test_readme_size():
    size = len((REPO / "README.md").read_bytes())
    assert size <= 15 * 1024, f"README.md is {size} bytes, over 15 KB: move detail to docs/guide.md"


def test_benchmarks_md_one_section_per_script():
    scripts = []
    for heading in _headings(REPO / "BENCHMARKS.md"):
        if not heading.startswith("## "):
            continue
        named = re.findall(r"\((benchmarks/[\w.-]+)", heading)
        assert len(named) == 1, f"BENCHMARKS.md section {heading!r} names no benchmark script as '(benchmarks/x.py)'"
        assert (REPO / named[0]).is_file(), f"BENCHMARKS.md section {heading!r}: {named[0]} does not exist"
        scripts.append(named[0])
    repeated = sorted({s for s in scripts if scripts.count(s) > 1})
    assert not repeated, f"BENCHMARKS.md holds several sections of {repeated}: one per script, its latest run"
    assert scripts, "BENCHMARKS.md has no '## ' section"


HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
ISSUE = re.compile(r"\bissues?\s*#?\d+|#\d+\b", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_headings_without_commits_issues_or_dates(path):
    bad = [h for h in _headings(path) if HASH.search(h) or ISSUE.search(h) or DATE.search(h)]
    assert not bad, f"{path.name}: headings name a commit, an issue or a date (say what is true, not when): {bad}"


def _expand(token: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py`` (one brace group)."""
    found = re.search(r"\{([^{}]*)\}", token)
    if not found:
        return [token]
    return [token[: found.start()] + part + token[found.end() :] for part in found.group(1).split(",")]


PATH = re.compile(rf"(?<![\w./$-])((?:{'|'.join(ROOTS)})/[\w./{{}},-]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MODULE = re.compile(r"`[^`]*?\b(cpcompile(?:\.\w+)+)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.lstrip("#").strip().lower()).replace(" ", "-") for h in _headings(page)}


def _missing_paths(path: Path) -> list[str]:
    text = _text(path)
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z+.-]*:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        page = (path.parent / file) if file else path
        if not page.exists():
            missing.append(f"link {target}")
        elif anchor and page.suffix == ".md" and anchor not in _anchors(page):
            missing.append(f"link {target} (no such heading)")
    for span in re.findall(r"`([^`\n]+)`", text):
        for token in PATH.findall(span):
            token = token.rstrip(".,:;")
            if any(c in token for c in "*<>") or token.endswith(("/...", "...")):
                continue  # a pattern, not a file
            for one in _expand(token):
                if not (REPO / one).exists():
                    missing.append(f"`{one}`")
    return missing


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_reference_to_a_missing_file(path):
    missing = _missing_paths(path)
    assert not missing, f"{path.relative_to(REPO)} names files the repository does not contain: {missing}"


def _names_in(module: Path) -> str:
    return _text(module / "__init__.py") if module.is_dir() else _text(module.with_suffix(".py"))


def _missing_module(dotted: str) -> str | None:
    """Where ``cpcompile.a.b.name`` stops resolving: every part a module (file or package) up to the last
    module, then one name the module's text defines or imports (attributes of that name are not checked)."""
    parts = dotted.split(".")
    here = REPO / parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if (here / part).is_dir() or (here / f"{part}.py").is_file():
            here = here / part
            continue
        if re.search(rf"\b{re.escape(part)}\b", _names_in(here)):
            return None
        return ".".join(parts[: i + 1])
    return None


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_module_names_resolve(path):
    missing = sorted({m for d in MODULE.findall(_text(path)) if (m := _missing_module(d))})
    assert not missing, f"{path.relative_to(REPO)} names modules or names that do not exist: {missing}"


FIGURE = re.compile(
    r"\d(?:[\d.,]*\d)?(?:\s*(?:-|to)\s*\d(?:[\d.,]*\d)?)?\s*(?:ms|us|µs|s/step|TFLOP/s|GB/s|tokens?/s)\b"
    r"|\d(?:[\d.,]*\d)?(?:\s*-\s*\d(?:[\d.,]*\d)?)?\s*%"
)


def _comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    out.append((body[0].lineno, body[0].value.value))
    return out


def _measurements_in_code() -> list[str]:
    hits = []
    for file in sorted((REPO / "cpcompile").rglob("*.py")):
        for line, text in _comments_and_docstrings(_text(file)):
            for found in FIGURE.finditer(text):
                hits.append(f"{file.relative_to(REPO)}:{line}: {found.group(0)!r}")
    return hits


def test_no_measurements_in_code_comments():
    hits = _measurements_in_code()
    assert not hits, "code comments quote measurements (they belong in BENCHMARKS.md or docs/):\n" + "\n".join(hits)

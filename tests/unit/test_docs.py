"""The README, ARCHITECTURE.md and docs/*.md: every relative link lands on a file and heading; the README stays short.

Anchors follow GitHub's heading slugs: the heading's text lowercased, every character that is not a letter, a
mark, a digit, `_`, a space or `-` dropped, each space made a hyphen, and `-1`, `-2`, ... after a repeat.
"""

from __future__ import annotations

import pathlib
import re
import sys
import unicodedata
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 300

# .ci/run runs the second line of the README's first code block; the first trains. Both stay byte for byte.
TRAIN = (
    "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/dora sft --config examples/arithmetic.toml"
    " && .venv/bin/dora run --config examples/arithmetic.toml"
)
TEST = (
    "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 uv && .venv/bin/uv pip install -q -p .venv"
    " --compile-bytecode --excludes .ci/cpu-excludes.txt -e '.[dev,vllm]' && .venv/bin/python -m mypy"
    " && .venv/bin/python -m pytest -q -n logical -m 'not slow'"
)

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_ID = re.compile(r"<a\s[^>]*\b(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
        elif fence is not None and m and m.group(1).startswith(fence):
            fence = None
        elif fence is None:
            out.append((n, line))
    return out


def code_spans(line: str) -> list[tuple[int, int]]:
    """[start, end) of each inline code span: a run of backticks up to the next run of the same length."""
    spans, i = [], 0
    while (m := re.compile(r"`+").search(line, i)) is not None:
        close = re.compile(rf"(?<!`){m.group()}(?!`)").search(line, m.end())
        if close is None:
            i = m.end()
            continue
        spans.append((m.start(), close.end()))
        i = close.end()
    return spans


def slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    cat = unicodedata.category  # letters, marks, digits and connector punctuation (`_`) stay
    kept = "".join(c for c in text if c in " -" or cat(c)[0] in "LMN" or cat(c) == "Pc")
    return kept.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text()):
        out.update(HTML_ID.findall(line))
        if (m := HEADING.match(line)) is None:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link outside code, inline or a reference definition."""
    out = []
    for n, line in prose_lines(path.read_text()):
        if m := DEFINITION.match(line):
            out.append((n, m.group(1)))
            continue
        spans = code_spans(line)
        out += [(n, m.group(1)) for m in LINK.finditer(line) if not any(a <= m.start() < b for a, b in spans)]
    return out


def broken(path: pathlib.Path) -> list[str]:
    problems = []
    for n, target in links(path):
        where = f"{path.relative_to(ROOT)}:{n}: ({target})"
        if not target or SCHEME.match(target) or target.startswith("//"):
            continue  # an absolute URL is not the repository's to check
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / urllib.parse.unquote(file_part)).resolve() if file_part else path
        if not dest.is_relative_to(ROOT):
            problems.append(f"{where} leaves the repository")
        elif not dest.exists():
            problems.append(f"{where} names no file")
        elif anchor and dest.suffix != ".md":
            problems.append(f"{where} has an anchor into a file that is not markdown")
        elif anchor and urllib.parse.unquote(anchor) not in anchors(dest):
            problems.append(f"{where} names no heading of {dest.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands_on_a_file_and_a_heading(page):
    assert broken(page) == []


def test_every_page_in_docs_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README) if t.partition("#")[0]}
    assert [p.name for p in PAGES[2:] if p.resolve() not in linked] == []


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move detail to docs/ and keep it to {MAX_README_LINES}"


def test_the_readme_opens_with_the_two_commands():
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert all(not line.strip() or line.startswith("# ") for line in lines[:start]), "only the title comes before them"
    fences, first = 0, []  # as .ci/run reads it: awk '/^```/{n++; next} n==1' README.md
    for line in lines:
        if line.startswith("```"):
            fences += 1
        elif fences == 1:
            first.append(line)
    assert first == [TRAIN, TEST]


@pytest.mark.parametrize(
    ("heading", "expected"),
    [("Simulating clusters: `dora sim`", "simulating-clusters-dora-sim"),
     ("The paper's table, simulated", "the-papers-table-simulated"),
     ("The data plane at scale: the broker, 1,024 workers, weights per GB",
      "the-data-plane-at-scale-the-broker-1024-workers-weights-per-gb"),
     ("Modes: sync, one_step, partial, dora", "modes-sync-one_step-partial-dora"),
     ("`bench/gpu.py` on an H100", "benchgpupy-on-an-h100"),
     ("64 → 128 GPUs", "64--128-gpus"),
     ("See [the guide](docs/x.md) — **now**", "see-the-guide--now")],
)  # fmt: skip
def test_slugs_follow_github(heading, expected):
    assert slug(heading) == expected


def test_the_checker_finds_broken_links_and_skips_code(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Top\n\n## Top\n\n```\n# not a heading\n[x](nowhere.md)\n```\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#top-1) [ok](#here) `[code](nowhere.md)` [web](https://example.org/x)\n\n# Here\n\n"
        "[bad file](missing.md) [bad anchor](a.md#not-a-heading) [fenced](a.md#not-a-heading-1)\n"
    )
    assert [p.split(": ")[1] for p in broken(page)] == [
        "(missing.md) names no file", "(a.md#not-a-heading) names no heading of a.md",
        "(a.md#not-a-heading-1) names no heading of a.md",
    ]  # fmt: skip


CITED = re.compile(r"(?<![\w/.-])(docs/[\w-]+\.md|[A-Z][A-Z_]+\.md)(#[\w-]+)?(\s*(?:§|section\s+\d))?")
"""A project document named in code: ``README.md``, ``ARCHITECTURE.md``, ``docs/metrics.md``, with a heading's anchor
(``docs/gpus.md#placement-...``) or a section number after it. (Lower-case bare names are files code writes.)"""
SOURCES = [p for top in ("dora", "tests", "bench", "examples", ".ci") for p in sorted((ROOT / top).rglob("*"))
           if p.suffix in (".py", ".toml", ".sh", "") and p.is_file() and "__pycache__" not in p.parts
           and p != pathlib.Path(__file__).resolve()]  # fmt: skip


def cited(path: pathlib.Path) -> list[str]:
    """Every document ``path`` names that the repository lacks, or whose section (``#anchor``) it lacks."""
    problems = []
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return []
    for n, line in enumerate(text.splitlines(), 1):
        for m in CITED.finditer(line):
            name, anchor = m.group(1), (m.group(2) or "")[1:]
            found = next((d for d in (ROOT / name, ROOT / "docs" / name) if d.is_file()), None)
            where = f"{path.relative_to(ROOT)}:{n}"
            if found is None:
                problems.append(f"{where} names {name}, which the repository does not hold")
            elif anchor and anchor not in anchors(found):
                problems.append(f"{where} names {name}#{anchor}, a section {name} does not have")
            elif m.group(3):
                problems.append(f"{where} cites {name} by a section number; name the heading (#anchor)")
    return problems


def test_every_document_the_code_cites_is_in_the_repository_with_its_section():
    """Code, tests, benches and examples cite the design by document and heading (``docs/how-it-works.md#...``):
    each must exist here, so a reader can follow it."""
    assert [p for path in SOURCES for p in cited(path)] == []

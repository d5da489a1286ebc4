"""The docs a newcomer reads: a short README, no link or cited file that is not in the repository, the
facts cited by section, and the generated pages (docs/make.md, docs/benchmarks.md) current."""

import re
from pathlib import Path

from conftest import REPO

from stages.tools import docs

README_MAX_LINES = 150
# A repository path as the code and docs cite it: a top-level folder, then a file name with a suffix.
CITED_PATH = re.compile(
    r"(?<![\w./$<{*-])((?:docs|stages|tests|templates|ci|docker)/[\w./-]*"
    r"\.(?:md|py|toml|json|j2|sh|ya?ml|lock|in|txt|safetensors|Dockerfile))(?![\w-])"
)
# "owner/repo path/in/it": a path inside another repository, which this one need not have.
OTHER_REPO = re.compile(r"[\w.-]+/[\w.-]+ $")
CODE_SPAN = re.compile(r"`([^`]+)`")
FACTS_CITATION = re.compile(r"docs/facts\.md §(\d\w*)")


def _code_files() -> list[Path]:
    files = [REPO / "Makefile", *REPO.glob("stages/**/*.py"), *REPO.glob("stages/core/presets/*.toml")]
    files += [*REPO.glob("tests/**/*.py"), *REPO.glob("templates/*"), *REPO.glob("ci/*.sh")]
    files += [*REPO.glob("ci/*.yml"), *REPO.glob("docker/**/*.sh"), *REPO.glob("docker/**/*.py")]
    files += [*REPO.glob("docker/*.Dockerfile")]
    # This file's own examples of dangling links and paths are fixtures, not citations.
    return sorted(p for p in files if "__pycache__" not in p.parts and p != Path(__file__))


def cited_paths(text: str, code_spans_only: bool) -> list[tuple[int, str]]:
    """(line, path) for every repository path the text cites; in markdown only those in code spans
    (a link's target is the link check's)."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        pieces = CODE_SPAN.findall(line) if code_spans_only else [line]
        for piece in pieces:
            for m in CITED_PATH.finditer(piece):
                if not OTHER_REPO.search(piece[: m.start()]):
                    found.append((lineno, m.group(1)))
    return found


def test_readme_is_a_landing_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    for command in ("make demo", "make test", "make bundle", "make verify", "make push", "make run"):
        assert command in "\n".join(lines), f"README.md lacks `{command}`"


def test_every_docs_link_resolves():
    assert docs.dangling_links(docs.markdown_files()) == []


def test_a_dangling_link_is_named(tmp_path):
    (tmp_path / "docs").mkdir()
    page = "# A page\n\n## Two words\n\n[self](#two-words) [up](../README.md)\n"
    (tmp_path / "docs" / "page.md").write_text(page)
    (tmp_path / "README.md").write_text(
        "# Top\n\n[ok](docs/page.md#two-words) [gone](docs/missing.md)\n"
        "[bad anchor](docs/page.md#three-words) [web](https://example.com/x.md)\n"
        "```\n[in code](nowhere.md)\n```\n"
    )
    bad = docs.dangling_links(docs.markdown_files(tmp_path), repo=tmp_path)
    assert bad == [
        "README.md:3: docs/missing.md (no such file)",
        "README.md:4: docs/page.md#three-words (no heading #three-words in docs/page.md)",
    ]


def test_slugs_follow_github():
    assert docs.slug("2. Hexagon v69 / Snapdragon 8 Gen 1 (read; no device here)") == (
        "2-hexagon-v69--snapdragon-8-gen-1-read-no-device-here"
    )
    assert docs.slug("Quality of 4-bit weights") == "quality-of-4-bit-weights"
    assert docs.slug("The `make plan` [output](x.md)") == "the-make-plan-output"


def test_every_cited_path_exists():
    missing = []
    for path in _code_files():
        for lineno, cited in cited_paths(path.read_text(errors="replace"), code_spans_only=False):
            if not (REPO / cited).exists():
                missing.append(f"{path.relative_to(REPO)}:{lineno}: {cited}")
    for path in docs.markdown_files():
        for lineno, cited in cited_paths(path.read_text(), code_spans_only=True):
            if not (REPO / cited).exists():
                missing.append(f"{path.relative_to(REPO)}:{lineno}: {cited}")
    assert not missing, "cited files that are not in the repository:\n" + "\n".join(missing)


def test_a_missing_cited_path_is_found():
    assert cited_paths("see stages/nowhere.py and docs/stages/quantize.md", code_spans_only=False) == [
        (1, "stages/nowhere.py"),
        (1, "docs/stages/quantize.md"),
    ]
    # Another repository's file, and a path that is a pattern, are not this repository's files.
    text = "(avisre/gemma4-snapdragon-npu docs/CHALLENGES.md) stages/core/presets/$(P).toml"
    assert cited_paths(text, code_spans_only=False) == []


def test_facts_are_cited_from_the_repository_by_section():
    """The facts live in docs/facts.md; a citation names one of its sections."""
    sections = {m.group(1) for m in re.finditer(r"^## (\w+)\. ", (REPO / "docs/facts.md").read_text(), re.M)}
    assert {"1", "2", "3", "4", "4b", "5"} <= sections
    wrong = []
    for path in [*_code_files(), *docs.markdown_files()]:
        text = path.read_text(errors="replace")
        if "FACTS.md" in text:
            wrong.append(f"{path.relative_to(REPO)}: names FACTS.md, which is not in the repository")
        wrong += [
            f"{path.relative_to(REPO)}: docs/facts.md has no §{s}"
            for s in FACTS_CITATION.findall(text)
            if s not in sections
        ]
    assert not wrong, "\n".join(wrong)


def test_generated_pages_are_current():
    assert docs.stale_pages() == [], "run `make docs` and commit the pages it rewrites"

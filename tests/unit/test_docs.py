"""The README and docs/*.md: every relative link and image resolves to a file in the
repository, every ``#anchor`` into a markdown file names one of its headings (GitHub's
slugs), and the README stays a front page (at most 250 lines). No network."""

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target), the target up to an optional "title"
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_LINK = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"", re.IGNORECASE)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def prose_lines(text):
    """The lines outside fenced code blocks, with their numbers."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def links(text):
    """(line number, target) of every link and image outside code."""
    for number, line in prose_lines(text):
        line = INLINE_CODE.sub("", line)
        for pattern in (INLINE_LINK, REFERENCE_DEF, HTML_LINK):
            for match in pattern.finditer(line):
                yield number, match.group(1)


def slug(heading):
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    """Every anchor a markdown file has: its headings' slugs (numbered when repeated)."""
    seen = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page):
    """'line: target (why)' for each relative link of ``page`` that does not resolve."""
    broken = []
    for number, target in links(page.read_text(encoding="utf-8")):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part.split("?", 1)[0])
        if path_part.startswith("/"):
            resolved = ROOT / path_part.lstrip("/")
        else:
            resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{number}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{number}: {target} (no heading #{anchor} in {resolved.name})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = broken_links(page)
    assert not broken, "broken links in " + page.name + ":\n" + "\n".join(broken)


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, at most {README_MAX_LINES}"


def test_slugs_follow_github():
    assert slug("Scaling model to 256 ranks") == "scaling-model-to-256-ranks"
    assert slug("The demo (`make demo`)") == "the-demo-make-demo"
    assert slug("An emulated cluster: 4 ranks, shaped links") == (
        "an-emulated-cluster-4-ranks-shaped-links"
    )
    assert slug("Quickstart: TensorFlow 2 / Keras 3") == "quickstart-tensorflow-2--keras-3"


def test_a_broken_link_is_caught(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n", encoding="utf-8")
    page.write_text(
        "[ok](there.md#a-heading) [gone](missing.md) [bad anchor](there.md#nope)\n"
        "![figure](missing.png) [web](https://example.com/x.md)\n"
        "```\n[in code](missing-too.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page) == [
        "1: missing.md (no such file)",
        "1: there.md#nope (no heading #nope in there.md)",
        "2: missing.png (no such file)",
    ]

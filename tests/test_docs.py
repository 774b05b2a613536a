"""The documentation holds together: README stays a first page, and every relative link in README
and docs/ leads to a file, and to a heading where it names one. Text only: nothing compiles."""

import pathlib
import re
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def prose_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    out, fence = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and m and m.group(1)[0] == fence[0] and \
                len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)):]:
            fence = None
        elif fence is None:
            out.append((number, line))
    return out


def slug(text: str) -> str:
    """GitHub's anchor for a heading: the rendered text (code spans and links as their text,
    emphasis markers dropped), lower-cased, punctuation and symbols removed except ``-`` and
    ``_``, each space a ``-``."""
    text = INLINE_CODE.sub(lambda m: m.group(2).strip(), text)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)
    keep = lambda c: c in "-_ " or unicodedata.category(c)[0] in "LMN"
    return "".join(c for c in text.lower() if keep(c)).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """Every heading anchor of a Markdown file; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path):
        if m := HEADING.match(line):
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: pathlib.Path) -> list[tuple[int, str]]:
    """The relative link targets of a Markdown file (not web addresses), with their lines."""
    out = []
    for number, line in prose_lines(path):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            target = m.group(1)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
                out.append((number, target))
    return out


def test_slug_follows_github():
    assert slug("The four stages") == "the-four-stages"
    assert slug("Int8 collectives (ZeRO++, opt-in)") == "int8-collectives-zero-opt-in"
    assert slug("Remat policies (ZeRO-R's activation memory)") == \
        "remat-policies-zero-rs-activation-memory"
    assert slug("Prefetch: zero_jax runs the layer loop") == "prefetch-zero_jax-runs-the-layer-loop"
    assert slug("`train.py` at a *glance*") == "trainpy-at-a-glance"
    assert slug("Hierarchical ZeRO (分层ZeRO)") == "hierarchical-zero-分层zero"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for number, target in links(page):
        where, _, anchor = target.partition("#")
        dest = (page.parent / where).resolve() if where else page
        if not dest.exists():
            broken.append(f"{number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{number}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_docs_exist_and_are_linked_from_readme():
    assert len(PAGES) > 1
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README)}
    for sub in ("getting-started.md", "guides/your-model.md", "reference/config.md"):
        assert (ROOT / "docs" / sub).resolve() in linked, sub


def test_readme_is_a_first_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"
    first = re.search(r"```\w*\n(.*?)```", README.read_text(), re.S)
    assert first, "README.md has no code block"
    commands = first.group(1)
    assert re.search(r"pip install -e \. .*train\.py --stage 3", commands), commands
    assert re.search(r"pip install -e '\.\[test\]' .*pytest -n 2 tests", commands), commands


def test_getting_started_runs_the_virtualenvs_python():
    """Right after README's commands (a .venv, nothing activated), a bare ``python`` is the
    system's, without jax: the first run names the virtualenv's."""
    page = (ROOT / "docs" / "getting-started.md").read_text()
    first_run = page.split("## The first run", 1)[1]
    command = re.search(r"```bash\n(.*?)\n", first_run).group(1)
    assert command.startswith(".venv/bin/python train.py"), command


def test_every_page_is_short_enough_to_read():
    """A page is read, not searched: every page under docs/ at most 25 KB, testing.md 10 KB
    (run logs and dated before/after figures live in docs/benchmarks/history/)."""
    sizes = {p.relative_to(ROOT): p.stat().st_size for p in (ROOT / "docs").rglob("*.md")}
    over = {str(p): n for p, n in sizes.items() if n > 25_000}
    assert not over, f"pages over 25 KB: {over}"
    assert sizes[pathlib.Path("docs/testing.md")] <= 10_000, sizes[pathlib.Path("docs/testing.md")]


def test_testing_md_says_what_every_test_file_proves():
    page = (ROOT / "docs" / "testing.md").read_text()
    missing = [p.name for p in sorted((ROOT / "tests").glob("test_*.py"))
               if f"`{p.name}`" not in page]
    assert not missing, f"docs/testing.md does not name {missing}"


def test_the_site_builds_without_a_warning(tmp_path):
    """mkdocs --strict over mkdocs.yml: a broken link or anchor between pages, a page left out
    of the nav, or a docstring the API reference cannot render fails the build."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "reference" / "api" / "index.html").exists()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    import zero_jax

    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    missing = [n for n in zero_jax.__all__
               if f'id="zero_jax.{n}"' not in api and f"`zero_jax.{n}`" not in page]
    assert not missing, f"the API reference lacks {missing}"


def test_design_md_maps_every_module():
    page = (ROOT / "docs" / "design.md").read_text()
    blocks = [p for p in (ROOT / "zero_jax" / "blocks").glob("*.py") if p.name != "__init__.py"]
    missing = [p.name for p in sorted([*(ROOT / "zero_jax").glob("*.py"), *blocks])
               if f"`{p.name}`" not in page]
    assert not missing, f"docs/design.md's module map lacks {missing}"

"""The documentation's sources agree with the code, checked without building the site.

The API reference (``docs/api.rst``) lists exactly the names of ``sharexec.__all__``, each
once; every page named in a toctree exists; every example has the title sphinx-gallery
needs; every ``>>>`` example of a page runs and prints what the page says. ``nox -s docs``
builds the site itself, with warnings as errors.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sharexec

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# Made by the build (sphinx-gallery), so not in the source tree.
GENERATED = {"auto_examples/index"}


def directive_bodies(text: str, directive: str) -> list[list[str]]:
    """The content lines of each ``.. directive::`` block of reST, options left out."""
    blocks: list[list[str]] = []
    body: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(f".. {directive}::"):
            body = []
            blocks.append(body)
        elif body is not None and line and not line[0].isspace():
            body = None  # the block ended at the first unindented line
        elif body is not None and line.strip() and not line.strip().startswith(":"):
            body.append(line.strip())
    return blocks


def reference_names() -> list[str]:
    """The names the API reference lists, in its order."""
    text = (DOCS / "api.rst").read_text(encoding="utf-8")
    assert re.search(r"^\.\. currentmodule:: sharexec$", text, re.MULTILINE)
    return [
        entry.split()[0].lstrip("~")
        for body in directive_bodies(text, "autosummary")
        for entry in body
    ]


def test_reference_lists_exactly_the_public_names():
    listed = reference_names()
    missing = sorted(set(sharexec.__all__) - set(listed))
    extra = sorted(set(listed) - set(sharexec.__all__))
    assert not missing, f"in sharexec.__all__ but not in docs/api.rst: {missing}"
    assert not extra, f"in docs/api.rst but not in sharexec.__all__: {extra}"


def test_reference_lists_each_name_once():
    listed = reference_names()
    assert len(listed) == len(set(listed)), sorted({n for n in listed if listed.count(n) > 1})


def test_directive_parser():
    text = (
        "Title\n=====\n\n.. autosummary::\n   :toctree: generated/\n\n   a\n   ~b\n\n"
        "Next\n----\n\n.. autosummary::\n\n   c\n\nprose\n   indented prose\n"
    )
    assert directive_bodies(text, "autosummary") == [["a", "~b"], ["c"]]


def toctree_entries(page: Path) -> list[str]:
    """The documents named in the MyST toctrees of a Markdown page, relative to docs/.

    An entry is a document's name, or a title with the name in angle brackets.
    """
    entries = []
    for block in re.findall(r"^```\{toctree\}\n(.*?)^```", page.read_text(), re.S | re.M):
        for line in block.splitlines():
            line = line.strip()
            if line and not line.startswith(":"):
                target = re.fullmatch(r"(?:.*<(.+)>|(.+))", line)
                assert target
                parent = page.parent.relative_to(DOCS)
                entries.append((parent / (target[1] or target[2])).as_posix())
    return entries


@pytest.mark.parametrize("page", ["index.md", "migration/index.md"])
def test_toctree_pages_exist(page):
    entries = toctree_entries(DOCS / page)
    assert entries
    for entry in entries:
        if entry in GENERATED:
            continue
        sources = [DOCS / f"{entry}{suffix}" for suffix in (".md", ".rst")]
        assert any(p.is_file() for p in sources), f"{page} names {entry}, which has no source"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_has_a_gallery_title(path):
    # sphinx-gallery makes each example a page titled by its docstring's reST heading.
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    assert docstring, f"{path.name} has no docstring"
    title, _, underline = docstring.partition("\n\n")[0].partition("\n")
    assert title.strip() and re.fullmatch(r"=+", underline.strip()), (
        f"{path.name}: the docstring must open with a title underlined with '='"
    )
    assert len(underline.strip()) >= len(title.strip()), f"{path.name}: underline too short"


DOCTEST_PAGES = sorted(p for p in DOCS.rglob("*.md") if ">>> " in p.read_text(encoding="utf-8"))


def test_some_pages_have_doctests():
    assert DOCS / "how-it-works.md" in DOCTEST_PAGES  # the worked example of statistics()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", DOCTEST_PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_doctests_of_the_docs_pass(page, no_leaks):
    """Every ``>>>`` example of a page runs, in a fresh interpreter (counts of segments
    and of calls are the process's own), and prints what the page says it prints."""
    code = (
        "import doctest, sys\n"
        f"result = doctest.testfile({str(page)!r}, module_relative=False)\n"
        "print(result.attempted, result.failed)\n"
        "sys.exit(1 if result.failed or not result.attempted else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_readme_states_the_constants_as_the_code_has_them():
    from sharexec import _config, _demo

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert _config.DEFAULT_MIN_SHARE_BYTES == 256 << 10 and "from 256 KiB" in readme
    assert _config.WARM_BYTES == 1 << 30 and "at most 1 GiB" in readme
    assert f"freed after {_config.WARM_IDLE_SECONDS:g} s unused" in readme
    peak = _demo._gib(_demo.peak_bytes(_demo.DEFAULT_SIZE_MB))
    assert f"about {peak} of memory at its peak" in readme
    assert f"({_demo.PEAK_FACTOR:g} times the array" in readme


def test_the_pool_takes_at_most_a_quarter_of_shared_memory(monkeypatch):
    import shutil

    from sharexec import _warm

    usage = shutil.disk_usage(_warm._segments.SHM_FOLDER)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(total=64_000_000))
    monkeypatch.setattr(_warm._segments, "anonymous_supported", lambda: False)
    assert _warm.pool_limit() == 16_000_000  # Docker's default /dev/shm: 16 MB
    # Where segments may be anonymous, the memory they count against (a container's).
    monkeypatch.setattr(_warm._segments, "anonymous_supported", lambda: True)
    monkeypatch.setattr(_warm._segments, "memory_limit", lambda: 2_000_000_000)
    assert _warm.pool_limit() == 500_000_000


def test_every_benchmark_figure_comes_from_the_committed_run():
    """The figures of every page are rendered by bench/render.py from the results file
    each block names (docs/bench-results.json: one run of bench/run.py;
    docs/bench-torch-results.json: one of bench/torch_bench.py), and agree with it: they
    cannot drift apart."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import render
    finally:
        sys.path.remove(str(ROOT / "bench"))
    run = render.load()
    assert run.rows, "docs/bench-results.json holds no measurement"
    for page in render.PAGES:
        text = page.read_text(encoding="utf-8")
        names = {m["name"] for m in render.BLOCK.finditer(text)}
        assert names, f"{page.relative_to(ROOT)} has no rendered block"
        assert names <= set(render.BLOCKS), names - set(render.BLOCKS)
    assert render.load_torch().record["wall"], "docs/bench-torch-results.json is empty"
    assert render.stale() == [], "run python bench/render.py"


def test_the_cluster_figures_come_from_the_committed_run():
    """The figures of "Scaling out" are rendered from docs/cluster-bench.json (one run of
    bench/cluster_bench.py) by ``bench/cluster_bench.py --render``, and agree with it."""
    pytest.importorskip("psutil", reason="bench/cluster_bench.py imports bench/measure.py")
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import cluster_bench
    finally:
        sys.path.remove(str(ROOT / "bench"))
    run = cluster_bench.load()
    assert {row["system"] for row in run["rows"]} == set(cluster_bench.SYSTEMS)
    page = (DOCS / "scaling-out.md").read_text(encoding="utf-8")
    assert page == cluster_bench.rendered_page(run), "run python bench/cluster_bench.py --render"


def test_the_docs_stand_alone():
    """No page refers to what is not in the repository (the project's design contract)."""
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        for pattern in (r"DESIGN\.md", r"design contract", r"\bD[1-9]\b"):
            assert not re.search(pattern, text), f"{page.relative_to(DOCS)}: {pattern}"


@pytest.mark.timeout(120)
def test_the_readme_counts_the_slow_tests_it_deselects():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stated = re.search(r"The (\d+)\s+deselected are the slow tests", readme)
    assert stated, "README.md: how many slow tests the default run deselects"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "slow",
            "-p",
            "no:cacheprovider",
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
    )
    collected = re.search(r"(\d+)/\d+ tests collected", out.stdout)
    assert collected, out.stdout + out.stderr
    assert collected[1] == stated[1], "update README.md's count of slow tests"


def test_the_supported_pythons_agree_everywhere():
    """The README's support policy, pyproject.toml (requires-python and classifiers) and
    the matrix of noxfile.py name the same Pythons."""
    import tomllib

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stated = re.search(r"sharexec supports \*\*CPython ([\d., and]+)\*\*", readme)
    assert stated, "README.md: which Pythons sharexec supports"
    in_readme = re.findall(r"3\.\d+", stated[1])
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    classifiers = [
        c.rsplit(" :: ", 1)[1]
        for c in project["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    nox_pythons = re.search(r"^PYTHONS = (\[.*\])$", (ROOT / "noxfile.py").read_text(), re.M)
    assert nox_pythons, "noxfile.py: PYTHONS"
    assert in_readme == classifiers == ast.literal_eval(nox_pythons[1])
    assert project["requires-python"] == f">={in_readme[0]}"


# The trove classifier of each operating system the README may name.
OS_CLASSIFIERS = {
    "Linux": "Operating System :: POSIX :: Linux",
    "macOS": "Operating System :: MacOS",
    "Windows": "Operating System :: Microsoft :: Windows",
}


def test_the_classifiers_claim_only_the_supported_systems():
    """pyproject.toml's operating systems are those the README's support policy names,
    and none of those its "Status" calls untested."""
    import tomllib

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stated = re.search(r"sharexec supports \*\*CPython [\d., and]+\*\* on (\w+)", readme)
    assert stated, "README.md: on which systems sharexec is supported"
    untested = re.search(r"(\w+)\s+and\s+(\w+)\s+are planned but not yet tested", readme)
    assert untested, "README.md: which systems are not tested yet"
    with open(ROOT / "pyproject.toml", "rb") as f:
        classifiers = tomllib.load(f)["project"]["classifiers"]
    systems = {c for c in classifiers if c.startswith("Operating System :: ")}
    assert systems == {OS_CLASSIFIERS[stated[1]]}
    assert not systems & {OS_CLASSIFIERS[name] for name in untested.groups()}


def test_the_version_is_written_once():
    """pyproject.toml takes the version from ``sharexec.__version__`` (hatchling reads
    it), and the installed package's metadata says the same version."""
    import importlib.metadata
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)
    assert "version" not in config["project"], "pyproject.toml: the version is dynamic"
    assert "version" in config["project"]["dynamic"]
    assert config["tool"]["hatch"]["version"]["path"] == "sharexec/__init__.py"
    assert importlib.metadata.version("sharexec") == sharexec.__version__


def test_the_changelog_is_in_the_usual_form():
    """CHANGES.md: "Unreleased" first, then one bullet per change a user can see, citing
    no tracker issue (the repository stands alone)."""
    text = (ROOT / "CHANGES.md").read_text(encoding="utf-8")
    versions = re.findall(r"^## (.+)$", text, re.M)
    assert versions and versions[0] == "Unreleased", versions
    assert not re.search(r"\bissues? \d+", text, re.I), "CHANGES.md cites a tracker issue"
    for line in text.splitlines():
        assert len(line) <= 99, f"CHANGES.md: a line of {len(line)} characters"


def test_ci_runs_every_test_file_that_skips_without_an_extra():
    """.ci/run's step "tests of the extras" lists the test files that skip when an optional
    package is missing (`pytest.importorskip` of one, or a skip that names an extra), so
    that with every extra installed none of their tests is left unrun. Step 1 runs the
    others already, without the extras."""
    script = (ROOT / ".ci" / "run").read_text()
    step = re.search(r'step "tests of the extras" python -m pytest (.*?)\n\n', script, re.S)
    assert step is not None, '.ci/run has no step "tests of the extras"'
    listed = set(re.findall(r"tests/\w+\.py", step.group(1)))
    needs_extra = re.compile(r"importorskip\((?!\s*\"psutil\")|pip install '?sharexec\[")
    skipping = {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if needs_extra.search(path.read_text())
    }
    assert skipping, "no test file skips without an extra: the pattern is out of date"
    assert skipping - listed == set(), "skip without an extra, not in the extras step"
    assert listed - skipping == set(), "in the extras step, skip without no extra"

"""Every figure on a user page has a source. The user pages are the README and docs/*.md; the
records are the reports the tools write (bench/) and the dated entries of docs/measurements/,
which may hold dates, commits and the story of a run. A user page states what is true now and
points to the record a figure comes from.

The rule, per block (a paragraph, a list item with its continuation lines, a heading, or a table
together with the paragraph just above it, its caption), outside fenced code and inline code:

- a block that holds a figure links a record (a link whose target names `bench/` or
  `measurements/`), or says "estimate"/"estimated" (with its basis), or "not recorded";
- no block holds a commit hash, "today", or "as of <date>".

And the record states the figure: each figure of a block that links records is found, with its
value and unit (376 s is 376.0 s; 16 min 8 s is 16 min and 8 s; "| layers | 34 |" states 34
layers), in one of them: in the section its anchor names (up to the next heading of that level),
or in the whole file without an anchor. That part must carry a date or a commit. A record must be
a file in this repository, and an anchor must name one of its headings.

A figure is a number with a unit of time (ms, s, min, h, seconds, minutes, hours), of size (KB to
TB, KiB to TiB), a ratio (1.013x, 12x, 61%), a count of measured things (1596 passed, 32 layers,
29 checks), or a date (2026-11-25). A number after a bound (<=, >=, <, >, "at least", "at most",
"up to", "under", "within", "default", ...) is a limit, a setting or a target, not a figure; so is
a setting quoted in code. Versions, ports and `sha256:` digests have no such unit. A commit
hash is 7 to 40 hex digits with at least one digit and one letter."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
USER_PAGES = [ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]  # docs/measurements/ are the records

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK_TARGET = re.compile(r"\]\(([^)\s]*)[^)]*\)")
HTML_COMMENT = re.compile(r"<!--.*?-->")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+")
# The matrix table is generated from matrix.yaml and the locks (`build.py render`): its counts and
# dates are the locks' own, and test_docs checks that the table is what `render` writes.
GENERATED = re.compile(r"<!-- matrix-table:start.*?<!-- matrix-table:end -->", re.S)

NUMBER = r"(?<![\w.,/:#-])\d[\d,]*(?:\.\d+)?"
BOUND = (r"(?:<=|>=|<|>|≤|≥|\bat least|\bat most|\bup to|\bno more than|\bbelow|\babove|\bunder|\bover"
         r"|\bwithin|\bdefault|\blimit of|\bbudget of|\be\.g\.(?:[^()]*,)?)\s*(?:about\s+)?$")
UNIT = (r"ms|s|sec|min|h|seconds?|minutes?|hours?"
        r"|[KMGT]B|kB|[KMGT]iB"
        r"|x|%")
COUNTED = (r"layers?|passed|failed|skipped|errors|checks?|wheels|runs|failures|tests"
           r"|steps|blobs|files|ranks")
FIGURE = re.compile(rf"({NUMBER})(?:\s?(?:{UNIT})(?![\w])|\s+(?:{COUNTED})\b)|(?<![\w/])20\d\d-\d\d-\d\d(?![\w/])")
# A figure in words: "a few tens of GB", "about two hours", "takes hours". Found for the rule above
# (a record or an estimate), not matched against the record's numbers.
SPELLED = re.compile(r"\b(?:a few|several|some|a couple of|tens of|hundreds of|one|two|three|four|five|six|seven|eight|nine|ten"
                     r"|eleven|twelve|twenty|thirty|forty|fifty|an?)\s+(?:tens of\s+)?(?:hours?|minutes?|days?|[KMGT]i?B)\b"
                     r"|\b(?:takes?|took|taking|lasts?)\s+(?:about\s+)?(?:hours|minutes|days)\b"
                     r"|\((?:about\s+)?(?:hours|minutes|days)\b", re.I)
HASH = re.compile(r"(?<![\w-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
NOTEBOOK = re.compile(r"\btoday(?:'s)?\b|\bas of (?:\d{4}-\d\d-\d\d|\w+ \d{4})", re.I)
RECORD = re.compile(r"(?:^|/)(?:bench|measurements)/")
SOURCED = re.compile(r"\bestimated?\b|\bnot recorded\b", re.I)


def blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) per block, fenced code left out; a table carries its caption."""
    text = GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    out: list[tuple[int, list[str]]] = []
    current: list[str] = []
    start, fenced, caption = 0, False, None

    def close():
        nonlocal current
        if current:
            out.append((start, current))
        current = []

    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            close()
            fenced = not fenced
            continue
        if fenced:
            continue
        table = line.lstrip().startswith("|")
        if not line.strip():
            if current and not current[0].lstrip().startswith("|"):
                caption = (start, current)
            else:
                caption = None
            close()
            continue
        was_table = bool(current) and current[-1].lstrip().startswith("|")
        if current and (LIST_ITEM.match(line) or line.lstrip().startswith("#") or table != was_table):
            close()
        if not current:
            start = number
            if table and caption is not None and out and out[-1] == caption:
                out.pop()  # the caption's lines travel with the table
                start, current = caption[0], list(caption[1])
        current.append(line)
        if line.lstrip().startswith("#"):
            close()
    close()
    return out


def prose(line: str) -> str:
    """The line without inline code, HTML comments and link targets (a link's text stays)."""
    line = HTML_COMMENT.sub(" ", line)
    line = INLINE_CODE.sub(" ", line)
    return LINK_TARGET.sub("]()", line)


def figures(line: str) -> list[str]:
    found = []
    for m in FIGURE.finditer(prose(line)):
        if re.search(BOUND, prose(line)[:m.start()]):
            continue
        found.append(m.group(0))
    return found


def spelled(line: str) -> list[str]:
    """The figures in words of a line, bounds left out as for figures()."""
    return [m.group(0) for m in SPELLED.finditer(prose(line)) if not re.search(BOUND, prose(line)[:m.start()])]


def findings(text: str) -> list[tuple[int, str]]:
    """(line number, what is wrong) for each unsourced figure, commit hash, or dated narrative."""
    found = []
    for start, lines in blocks(text):
        joined = " ".join(lines)
        cited = any(RECORD.search(target) for target in LINK_TARGET.findall(HTML_COMMENT.sub(" ", joined)))
        sourced = cited or bool(SOURCED.search(prose(joined)))
        for offset, line in enumerate(lines):
            words = prose(line)
            for h in HASH.findall(words):
                found.append((start + offset, f"commit hash {h}"))
            for n in NOTEBOOK.findall(words):
                found.append((start + offset, f"dated narrative {n!r}"))
            if not sourced:
                for f in figures(line) + spelled(line):
                    found.append((start + offset, f"figure {f!r} with no record"))
    return found


# --- the checker -------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "The arm64 image took 116 min to build.",                     # time
    "the x86-64 ptxas (52 s) and the aarch64 one under QEMU (226 s)",
    "The suite needs about 90 min, its limit.",
    "cpu_adam alone took 57 s on 2 cores",
    "- **The emulated gate: 283 s** (smoke subset 272 s)",      # a list item
    "The image is 6.50 GB against a floor of 6.47 GB.",          # size
    "the venv adds 207 MB",
    "Emulation costs about 12x.",                                # ratio
    "the size ratio is 1.010x",
    "a node still fetches 61% of the other",
    "the default row's image has 32 layers",                     # counts
    "1596 passed, 16 skipped",
    "It ran on 2026-11-25 and passed.",                         # a date is a figure too
    "| image | size |\n|---|---|\n| (2.7, 12.1) | 6.50 GB |",     # a table with no caption
    "and a few tens of GB of disk",                             # in words
    "its sdist's build takes hours on our 2 cores",
    "the compiles alone take about two hours",
], ids=lambda t: t[:30])
def test_the_checker_flags_a_figure_with_no_record(text):
    assert [what for _, what in findings(text) if what.startswith("figure")]


@pytest.mark.parametrize("text", [
    "The same build took 55 min at commit 1dd1aef.",
    "fixed in 01a9b05",
    "at commit 7825b3d (2026-11-27)",
    "a full hash 539fa10c2e4d8a7b6f0e1d2c3b4a5968778695a4",
], ids=lambda t: t[:30])
def test_the_checker_flags_a_commit_hash(text):
    assert any(what.startswith("commit hash") for _, what in findings(text))


@pytest.mark.parametrize("text", [
    "Today's figures",
    "The amd64 image was not built today.",
    "As of 2026-11-27.",
    "as of November 2026, it works",
])
def test_the_checker_flags_dated_narrative(text):
    assert any(what.startswith("dated narrative") for _, what in findings(text))


@pytest.mark.parametrize("text", [
    "The image is 6.54 GB ([report](../bench/report.md)).",
    "From empty caches it took 56 min 56 s ([ci time](measurements/ci-time.md)).",
    "- 283 s for the gate,\n  as [the record](../bench/arm64.md) shows",  # a list item's continuation
    "About 50 min (estimate: the last run plus the modules added since).",
    "The emulated train build's time: not recorded.",
], ids=lambda t: t[:30])
def test_the_checker_passes_a_figure_with_its_record_or_an_estimate(text):
    assert findings(text) == []


def test_a_table_takes_its_record_from_its_caption():
    text = "From [the report](../bench/report.md):\n\n| measure | result |\n|---|---|\n| size | 1.011x |\n"
    assert findings(text) == []
    assert findings("Some figures:\n\n| measure | result |\n|---|---|\n| size | 1.011x |\n")


@pytest.mark.parametrize("text", [
    "torch 2.7.1 on CUDA 12.1, cuDNN 9.5.1.17, NCCL 2.26.2, Slurm 22.05",   # versions
    "JupyterLab listens on port 8888; `-p 127.0.0.1:2222:2222`",
    "`sha256:55be353fc74a80bc7f3b20e6be50a55a61cd525626f578dcb66a5708e2007d14`",
    "```\nbuilt in 875 s at 1dd1aef\n```",                      # fenced code
    "the step `opsbuild.py ... 705.2s` ends",                   # inline code
    "a layer per wheel of at least 5 MB, up to 40 layers",      # bounds, not figures
    "a target of <= 1.03x and <= 200 ms",
    "the job must end within 120 s; `--keep-storage` (default 40GB); /dev/shm under 1 GiB",
    "a duration, e.g. 24h, 90m or seconds",                    # an example of a value's form
    "x86-64-v3, sm_90, armv8.2-a, e2e, deadbeef, decade, 4460ec",
    "[a heading](performance.md#today-s-figures) read as a link target",
    "<!-- matrix-table:start (build.py render) -->\n| 140 pins unchecked (2026-11-23) |\n<!-- matrix-table:end -->",
], ids=lambda t: t[:30])
def test_the_checker_passes_what_is_no_figure(text):
    assert findings(text) == []


def test_the_checker_reads_on_after_a_fence():
    assert findings("```\n1 s\n```\nThe build took 875 s.\n") == [(4, "figure '875 s' with no record")]


# --- the docs ----------------------------------------------------------------------------------

def test_the_user_pages_exist():
    assert ROOT / "docs" / "performance.md" in USER_PAGES and ROOT / "README.md" in USER_PAGES
    assert not any("measurements" in p.parts for p in USER_PAGES)


def test_every_figure_on_a_user_page_has_a_record():
    bad = [f"{page.relative_to(ROOT)}:{number}: {what}"
           for page in USER_PAGES for number, what in findings(page.read_text())]
    assert not bad, ("a figure on a user page links its record (bench/ or docs/measurements/) or says it is an "
                     "estimate and from what; dates, commits and the story of a run belong in docs/measurements/\n"
                     + "\n".join(bad))


# --- the record states the figure -------------------------------------------------------------

HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
COUNT_FIRST = re.compile(rf"\b({COUNTED})\s*[:|]\s*({NUMBER})")
DATED = re.compile(r"(?<![\w/])20\d\d-\d\d-\d\d(?![\w/])")
UNITS = {"sec": "s", "second": "s", "seconds": "s", "minute": "min", "minutes": "min", "hour": "h", "hours": "h"}


def normal(figure: str) -> tuple[str, str]:
    """(value, unit) of a figure as FIGURE finds it: '1,596 passed' -> ('1596', 'passed'), '2 min' -> ('2', 'min')."""
    if DATED.fullmatch(figure):
        return figure, "date"
    m = re.match(rf"({NUMBER})\s*(.*)$", figure)
    assert m, figure
    value, unit = m.group(1).replace(",", ""), m.group(2).strip()
    return f"{float(value):g}", UNITS.get(unit, unit)  # 376 s is 376.0 s; 6.5 GB is not 6.49 GB


def stated(text: str) -> set[tuple[str, str]]:
    """Every figure a record's text states, inline code and bounds included: a record may quote a log."""
    text = re.sub(r"`+", " ", HTML_COMMENT.sub(" ", text))
    found = {normal(m.group(0)) for m in FIGURE.finditer(text)}
    # a count named before its number, as a record's table or a tool's output gives it: "| layers | 34 |", "layers: 34"
    found |= {(f"{float(n.replace(',', '')):g}", word) for word, n in COUNT_FIRST.findall(text)}
    return found


def section(text: str, anchor: str) -> str | None:
    """The part of a Markdown file under the heading whose anchor (mkdocs' slug) is `anchor`, up to the
    next heading of its level or above; None when no heading has that anchor."""
    from markdown.extensions.toc import slugify

    lines, start, level = text.splitlines(), None, 0
    for i, line in enumerate(lines):
        m = HEADING.match(line)
        if not m:
            continue
        if start is not None and len(m.group(1)) <= level:
            return "\n".join(lines[start:i])
        if start is None and slugify(m.group(2), "-") == anchor:
            start, level = i, len(m.group(1))
    return "\n".join(lines[start:]) if start is not None else None


def record(page: Path, target: str, root: Path = ROOT) -> tuple[str, str | None]:
    """(the record as a path in the repo, its text or the anchored part of it; None where it is not in
    the repo, or the anchor names no heading there)."""
    path, _, anchor = target.partition("#")
    if re.match(r"[a-z]+:", path):
        return target, None  # a record elsewhere (a URL) is no record in the repo
    file = (page.parent / path).resolve() if path else page
    try:
        rel = str(file.relative_to(root))
    except ValueError:
        return target, None
    if file.is_dir():
        file = file / "README.md"
    if not file.is_file():
        return rel, None
    text = file.read_text(errors="replace")
    return rel + (f"#{anchor}" if anchor else ""), section(text, anchor) if anchor else text


def unstated(page: Path, text: str, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line number, what is wrong) for each figure of a block that cites records none of which states it
    with a date or a commit, and for each cited record that is not in the repo."""
    found = []
    for start, lines in blocks(text):
        joined = HTML_COMMENT.sub(" ", " ".join(lines))
        targets = [t for t in LINK_TARGET.findall(joined) if RECORD.search(t)]
        if not targets:
            continue
        records = [record(page, t, root) for t in targets]
        for where, body in records:
            if body is None:
                found.append((start, f"record {where} is not in the repo (or its anchor names no heading)"))
        texts = [body for _, body in records if body and (DATED.search(body) or HASH.search(body))]
        held = set().union(*map(stated, texts)) if texts else set()
        for offset, line in enumerate(lines):
            for figure in figures(line):
                if normal(figure) not in held:
                    found.append((start + offset, f"figure {figure!r}: not stated in {', '.join(w for w, _ in records)}"))
    return found


def test_every_figure_on_a_user_page_is_stated_by_its_record():
    bad = [f"{page.relative_to(ROOT)}:{number}: {what}"
           for page in USER_PAGES for number, what in unstated(page, page.read_text())]
    assert not bad, ("a figure on a user page is stated, with its value and unit, by the dated record (or the "
                     "record's section, by its anchor) that its block links\n" + "\n".join(bad))



RECORDS = """# Builds

## 2026-11-23, Docker 20.10

- cold build 875 s (14.6 min); image 6.50 GB; the suite: 1,596 passed
- `prebuilt for cuda in 376.0 s`

| layers | 34 |

## Undated notes

- the gate 153 s
"""


def checked(tmp_path: Path, text: str) -> list[str]:
    """What unstated() finds on a page docs/page.md of a project whose record is docs/measurements/builds.md."""
    (tmp_path / "docs" / "measurements").mkdir(parents=True)
    (tmp_path / "docs" / "measurements" / "builds.md").write_text(RECORDS)
    page = tmp_path / "docs" / "page.md"
    page.write_text(text)
    return [what for _, what in unstated(page, text, tmp_path)]


@pytest.mark.parametrize("text", [
    "A cold build took 875 s ([builds](measurements/builds.md#2026-11-23-docker-2010)).",
    "A cold build took 14.6 min, 1596 passed ([builds](measurements/builds.md#2026-11-23-docker-2010)).",
    "The op compile took 376 s ([builds](measurements/builds.md#2026-11-23-docker-2010)).",  # 376 is 376.0
    "The image had 34 layers ([builds](measurements/builds.md#2026-11-23-docker-2010)).",   # a count named first
], ids=lambda t: t[:40])
def test_a_figure_its_record_states_passes(tmp_path, text):
    assert checked(tmp_path, text) == []


@pytest.mark.parametrize("text, says", [
    ("A cold build took 870 s ([builds](measurements/builds.md#2026-11-23-docker-2010)).", "figure '870 s': not stated"),
    ("The image is 6.49 GB ([builds](measurements/builds.md#2026-11-23-docker-2010)).", "figure '6.49 GB': not stated"),
    ("The image is 875 MB ([builds](measurements/builds.md#2026-11-23-docker-2010)).", "figure '875 MB': not stated"),
    ("The gate took 153 s ([builds](measurements/builds.md#2026-11-23-docker-2010)).", "figure '153 s': not stated"),
    ("The gate took 153 s ([builds](measurements/builds.md#undated-notes)).", "figure '153 s': not stated"),  # no date
    ("It took 875 s ([builds](measurements/builds.md#no-such-entry)).", "anchor names no heading"),
    ("It took 875 s ([builds](measurements/gone.md)).", "not in the repo"),
    ("It took 875 s ([builds](https://example.org/bench/report.md)).", "not in the repo"),
], ids=lambda t: t[:40])
def test_a_figure_its_record_does_not_state_fails(tmp_path, text, says):
    assert any(says in what for what in checked(tmp_path, text)), checked(tmp_path, text)


# --- the --help texts --------------------------------------------------------------------------

def help_texts() -> list[tuple[str, str]]:
    """(where, text) for build.py's description, each command's help and each option's help."""
    import argparse

    from pytorch_cuda_build import cli

    top = cli.parser()
    found = [("build.py", top.description or "")]
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    found += [(f"build.py {c.dest}", c.help or "") for c in commands._choices_actions]
    for name, sub in [("build.py", top), *commands.choices.items()]:
        found += [(f"{name} {'/'.join(a.option_strings) or a.dest}", a.help) for a in sub._actions
                  if a.help and a.help != argparse.SUPPRESS]
    return found


def test_the_help_texts_are_read():
    texts = dict(help_texts())
    assert "verify --compile-ops" in texts and "build.py job" in texts and len(texts) > 100


@pytest.mark.parametrize("text", ["as a rebuild does (about 4 min more per build on 2 cores)", "report in bench/ (hours on 2 cores)"])
def test_the_help_check_flags_a_figure(text):
    assert figures(text) + spelled(text)


def test_no_help_text_holds_a_figure():
    """--help cannot link a record: a figure there has none. It names the page that gives it; a
    default or a bound (`default 540 s`, `at most 40`) is a setting, not a figure."""
    bad = [f"{where}: {f!r}" for where, text in help_texts() for f in figures(text) + spelled(text)]
    assert not bad, "a --help text states a figure; name the docs page that gives it with its record instead:\n" + "\n".join(bad)

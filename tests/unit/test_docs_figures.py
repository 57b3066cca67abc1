"""Every figure on a user page has a source. The user pages are the README and docs/*.md; the
records are the reports the tools write (bench/) and the dated entries of docs/measurements/,
which may hold dates, commits and the story of a run. A user page states what is true now and
points to the record a figure comes from.

The rule, per block (a paragraph, a list item with its continuation lines, a heading, or a table
together with the paragraph just above it, its caption), outside fenced code and inline code:

- a block that holds a figure links a record (a link whose target names `bench/` or
  `measurements/`), or says "estimate"/"estimated" (with its basis), or "not recorded";
- no block holds a commit hash, "today", or "as of <date>".

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
USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # docs/measurements/ are the records

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
         r"|\bwithin|\bdefault|\blimit of|\bbudget of)\s*(?:about\s+)?$")
UNIT = (r"ms|s|sec|min|h|seconds?|minutes?|hours?"
        r"|[KMGT]B|kB|[KMGT]iB"
        r"|x|%")
COUNTED = (r"layers?|passed|failed|skipped|errors|checks?|wheels|runs|failures|tests"
           r"|steps|blobs|files|ranks")
FIGURE = re.compile(rf"({NUMBER})(?:\s?(?:{UNIT})(?![\w])|\s+(?:{COUNTED})\b)|(?<![\w/])20\d\d-\d\d-\d\d(?![\w/])")
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
                for f in figures(line):
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

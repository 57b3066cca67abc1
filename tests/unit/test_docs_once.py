"""Each fact that pages used to give two ways has one home: the page that states it. Every other
user page (the README, SECURITY.md, CONTRIBUTING.md, docs/*.md) that touches it links that home
in the same block (a paragraph, a list item, a table with its caption) and states nothing the home
could contradict. The records (docs/measurements/, bench/) are history and are not read.

The kinds, each found once on two pages that disagreed:
- the suite's time on the slower kind of our machines ("50 to 54 min" on three pages, "57 to 62"
  on two): stated on testing.md alone, in "How long the suite takes";
- what CUDA errors 35, 803 and 804 mean (803 and 804 were "a driver too old" on three pages and in
  the preflight's own message): troubleshooting.md;
- what has run on a GPU ("nothing of this has run on a GPU" on ops.md, one H100 on gpu-host.md):
  gpu-host.md, "What has run on a GPU";
- how far a build has been reproduced on other machines ("not run on another machine" on
  limits.md, three machines on the reproducibility pages): reproducibility.md.
And one read from the code: the Slurm test cluster's node count (two on two pages, three on two)
is tests/integration/test_slurm.py's NODES."""
from __future__ import annotations

import re

import pytest
from test_docs_figures import USER_PAGES, blocks, prose

from helpers import ROOT

LINK = re.compile(r"\]\(([^)\s]*)[^)]*\)")

# (what, the statement, the home page, the anchor a link from elsewhere names ("" for the page),
# whether another page may restate it beside that link; a figure that moves with every new run may not)
FACTS = [
    ("the suite's time on the slower kind",
     re.compile(r"\bestimated (?:at )?\d+(?: to \d+)? min\b[^.;]{0,60}\bslower (?:kind|machine)"
                r"|\bslower (?:kind|machine)[^.;]{0,60}\bestimated (?:at )?\d+(?: to \d+)? min\b", re.I),
     "docs/testing.md", "how-long-the-suite-takes", False),
    ("what a CUDA error number means", re.compile(r"\b(?:CUDA )?errors? (?:35|803|804)\b"), "docs/troubleshooting.md", "", True),
    ("what has run on a GPU",
     re.compile(r"\b(?:nothing|no image|none)\b[^.]*?\bha(?:s|ve)(?: not)? run on a GPU|\bha(?:s|ve) (?:not|never) run on a GPU",
                re.I),
     "docs/gpu-host.md", "what-has-run-on-a-gpu", True),
    ("a build reproduced on other machines",
     re.compile(r"\b(?:not|never)\b[^.]*?\b(?:run|tried|built|reproduced) on (?:another|a second|other) (?:machine|CPU)", re.I),
     "docs/reproducibility.md", "", True),
]


def links_home(page, joined: str, home: str, anchor: str) -> bool:
    for target in LINK.findall(joined):
        path, _, name = target.partition("#")
        if not path or path.startswith(("http:", "https:")):
            continue
        try:
            rel = (page.parent / path).resolve().relative_to(ROOT)
        except ValueError:
            continue
        if str(rel) == home and (not anchor or name == anchor):
            return True
    return False


def strays(page, text: str) -> list[tuple[int, str]]:
    """(line, fact) for each block of a page, not the fact's home, that states the fact and does not link its home."""
    found = []
    for start, lines in blocks(text):
        joined = " ".join(lines)
        words = prose(joined)
        for what, statement, home, anchor, restate in FACTS:
            if str(page.relative_to(ROOT)) == home or not statement.search(words):
                continue
            if not restate:
                found.append((start, f"{what}: stated on {home} alone; link {home}#{anchor} instead of restating it"))
            elif not links_home(page, joined, home, anchor):
                found.append((start, f"{what}: link {home}{'#' + anchor if anchor else ''} from here, the one page that states it"))
    return found


@pytest.mark.parametrize("text, fact", [
    ("The suite takes an estimated 50 to 54 min on the slower kind.", "the suite's time on the slower kind"),
    ("CUDA would fail at first use with error 803 or 804.", "what a CUDA error number means"),
    ("| troubleshooting | a driver too old (CUDA errors 803, 804) |", "what a CUDA error number means"),
    ("Nothing of this has run on a GPU: no GPU machine was lent.", "what has run on a GPU"),
    ("Estimated at 50 to 54 min on the slower kind ([testing](testing.md#how-long-the-suite-takes)).",
     "the suite's time on the slower kind"),  # linked, and restated all the same
    ("Not run on another machine or CPU model.", "a build reproduced on other machines"),
], ids=lambda t: t[:40])
def test_the_check_finds_a_fact_away_from_its_home(text, fact):
    page = ROOT / "docs" / "limits.md"
    assert [what.split(":")[0] for _, what in strays(page, text)] == [fact]


@pytest.mark.parametrize("text", [
    "On the slower kind: [how long the suite takes](testing.md#how-long-the-suite-takes).",
    "It fails with error 35 ([the driver is too old](troubleshooting.md#the-driver-is-too-old)).",
    "No image has run on a GPU ([what has run](gpu-host.md#what-has-run-on-a-gpu)).",
    "A check from a second machine: [reproducibility](reproducibility.md#the-promise), not run on another machine.",
    "The build took 11 min on the faster machine.",  # no slower kind named
], ids=lambda t: t[:40])
def test_the_check_passes_a_fact_that_links_its_home(text):
    assert strays(ROOT / "docs" / "limits.md", text) == []


def test_each_fact_s_home_is_a_user_page_with_its_heading():
    from test_docs_figures import section
    for what, _, home, anchor, _ in FACTS:
        assert ROOT / home in USER_PAGES, f"{what}: {home} is no user page"
        assert not anchor or section((ROOT / home).read_text(), anchor) is not None, f"{what}: {home} has no heading #{anchor}"


def test_no_user_page_states_a_fact_away_from_its_home():
    bad = [f"{page.relative_to(ROOT)}:{line}: {what}" for page in USER_PAGES for line, what in strays(page, page.read_text())]
    assert not bad, "a fact stated away from its home page, which it does not link:\n" + "\n".join(bad)


# --- read from the code ------------------------------------------------------------------------

WORDS = {"two": 2, "three": 3, "four": 4, "five": 5}
SLURM_CLUSTER = re.compile(r"\b(two|three|four|five|\d+)-node Slurm\b|\bSlurm\b[^.]*?\bcluster of (two|three|four|five|\d+) nodes\b")


def test_the_slurm_test_cluster_s_node_count_is_the_test_s():
    nodes = int(re.search(r"^NODES = (\d+)", (ROOT / "tests" / "integration" / "test_slurm.py").read_text(), re.M).group(1))
    said = {}
    for page in USER_PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for m in SLURM_CLUSTER.finditer(line):
                word = m.group(1) or m.group(2)
                said[f"{page.relative_to(ROOT)}:{number}"] = WORDS.get(word) or int(word)
    assert said, "no page names the Slurm test cluster's size"
    wrong = {where: n for where, n in said.items() if n != nodes}
    assert not wrong, f"tests/integration/test_slurm.py's cluster has {nodes} nodes; these pages say otherwise: {wrong}"

"""Slurm host lists: the cases Slurm documents (slurm_hostlist_create(3), Slurm::Hostlist(3pm),
the issue's), the lists it refuses, and a cross-check against the real `scontrol show hostnames`
where Slurm's client is installed (Debian's slurm-client; it needs a slurm.conf, not a cluster)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pytorch_cuda_runtime import hostlist

from helpers import require

EXPANDS = {
    "node[01-04,07]": ["node01", "node02", "node03", "node04", "node07"],
    "a[1-2],b3": ["a1", "a2", "b3"],
    "rack[1-2]-node[01-02]": ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"],
    "n[001-003]": ["n001", "n002", "n003"],
    "n1,n2": ["n1", "n2"],
    "n1 n2": ["n1", "n2"],
    "tux[0-5,12,20-25]": ["tux0", "tux1", "tux2", "tux3", "tux4", "tux5", "tux12",
                          "tux20", "tux21", "tux22", "tux23", "tux24", "tux25"],
    "node1,node[2-5,12]": ["node1", "node2", "node3", "node4", "node5", "node12"],
    "linux[1-3,6]": ["linux1", "linux2", "linux3", "linux6"],
    "n[8-10]": ["n8", "n9", "n10"],
    "n[08-10]": ["n08", "n09", "n10"],
    "n[099-101]": ["n099", "n100", "n101"],
    "n[01-3]": ["n01", "n02", "n03"],
    "n[1-03]": ["n1", "n2", "n3"],
    "n[0]": ["n0"],
    "[1-2]": ["1", "2"],
    "a,b[1-2]c[3-4],d": ["a", "b1c3", "b1c4", "b2c3", "b2c4", "d"],
    "n1,,n2": ["n1", "n2"],
    "n[1-2],": ["n1", "n2"],
    "n1,n1": ["n1", "n1"],
    "gpu-a100-[1-2]": ["gpu-a100-1", "gpu-a100-2"],
}
REFUSED = ["", " ", ",", "n[1-2", "n1]", "n[0-1]]", "n[[1]]", "n[3-1]", "n[a-b]", "n[]", "n[1-2-3]",
           "n[-1]", "n[1-]", "n[ 1-2]", "bgl[123x456]"]
# Slurm 22.05 refuses a suffix after a single bracket and orders 3+ brackets its own way.
NOT_SLURMS = {"node[1-2]-ib": ["node1-ib", "node2-ib"]}


@pytest.mark.parametrize("text", sorted(EXPANDS))
def test_documented_lists_expand(text):
    assert hostlist.expand(text) == EXPANDS[text]


def test_a_suffix_after_the_bracket():
    assert hostlist.expand("node[1-2]-ib") == NOT_SLURMS["node[1-2]-ib"]


@pytest.mark.parametrize("text", REFUSED)
def test_bad_lists_are_one_line_errors(text):
    with pytest.raises(hostlist.HostlistError) as e:
        hostlist.expand(text)
    assert "\n" not in str(e.value) and repr(text) in str(e.value)


def fake_scontrol(tmp_path: Path, script: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n" + script)
    (bin_dir / "scontrol").chmod(0o755)
    return bin_dir


def test_scontrol_gives_the_names_where_it_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_scontrol(tmp_path, 'echo from-scontrol-1; echo from-scontrol-2\n')))
    assert hostlist.hostnames("n[1-2]") == ["from-scontrol-1", "from-scontrol-2"]


def test_an_unclean_scontrol_answer_is_ignored(tmp_path, monkeypatch):
    # Slurm 22.05 exits 0 and prints this for a list it refuses; without a slurm.conf it fails.
    monkeypatch.setenv("PATH", str(fake_scontrol(tmp_path, 'echo "Invalid hostlist: $3"\n')))
    assert hostlist.scontrol_expand("node[1-2]-ib") is None
    assert hostlist.hostnames("node[1-2]-ib") == ["node1-ib", "node2-ib"]


def test_this_parser_decides_validity_even_where_scontrol_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_scontrol(tmp_path, "echo n]\n")))  # Slurm's answer to n[1-2
    with pytest.raises(hostlist.HostlistError):
        hostlist.hostnames("n[1-2")


def test_without_scontrol_the_parser_answers(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hostlist.scontrol_expand("n[1-2]") is None
    assert hostlist.hostnames("n[1-2]") == ["n1", "n2"]


def test_the_parser_agrees_with_scontrol(tmp_path, monkeypatch):
    require(shutil.which("scontrol"), "needs Slurm's scontrol (apt-get install slurm-client; build.py selftest installs it)")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=test\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    version = subprocess.run(["scontrol", "--version"], capture_output=True, text=True).stdout.strip()
    for text, hosts in EXPANDS.items():
        assert hostlist.scontrol_expand(text) == hosts, (version, text)
    for text in REFUSED:
        if text.strip(" ,") and text not in ("n[1-2", "n[1-]", "n[ 1-2]"):  # Slurm answers these oddly
            assert hostlist.scontrol_expand(text) is None, (version, text)
    for text in NOT_SLURMS:
        assert hostlist.scontrol_expand(text) is None, (version, text)

"""The worked example's page (docs/example.md) shows the files the integration test runs
(docs/examples/, tests/integration/test_worked_example.py), byte for byte; the config is raw
DeepSpeed (no Hugging Face "auto" value); and the page's CPU command is the one the test runs."""
from __future__ import annotations

import json
import re

from helpers import ROOT

PAGE = ROOT / "docs" / "example.md"
FILES = ROOT / "docs" / "examples"


def fenced(text: str, lang: str) -> list[str]:
    """The bodies of the fenced blocks opened with ```lang (```, with no language, for "")."""
    return [body for opened, body in re.findall(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M) if opened == lang]


def test_the_page_shows_the_files_the_test_runs():
    text = PAGE.read_text()
    assert fenced(text, "json") == [(FILES / "ds_config.json").read_text()]
    assert fenced(text, "python") == [(FILES / "train.py").read_text()]


def values(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from values(v)
    elif isinstance(node, list):
        for v in node:
            yield from values(v)
    else:
        yield node


def test_the_config_is_raw_deepspeed():
    config = json.loads((FILES / "ds_config.json").read_text())
    assert "auto" not in [v for v in values(config) if isinstance(v, str)]
    assert "train_micro_batch_size_per_gpu" in config and "train_batch_size" not in config


def test_the_pages_cpu_command_is_the_tests():
    test = (ROOT / "tests" / "integration" / "test_worked_example.py").read_text()
    blocks = [b for b in fenced(PAGE.read_text(), "") if "DS_ACCELERATOR=cpu" in b]
    assert len(blocks) == 1
    command = " ".join(blocks[0].replace("\\\n", " ").split())
    for part in ("--shm-size 1g", "-e DS_ACCELERATOR=cpu", "-e OMP_NUM_THREADS=1", ":/workspace/example:ro",
                 "torchrun --nproc-per-node 2 train.py --deepspeed_config ds_config.json"):
        assert part in command, part
    assert "torchrun --nproc-per-node 2 train.py --deepspeed_config ds_config.json" in test
    for option in ('"--shm-size", "1g"', '"DS_ACCELERATOR=cpu"', '"OMP_NUM_THREADS=1"', ':/workspace/example:ro'):
        assert option in test, option


def test_the_readmes_job_line_is_the_pages_gpu_command():
    gpu = [b for b in fenced(PAGE.read_text(), "") if "--gpus all" in b]
    readme = [b for b in fenced((ROOT / "README.md").read_text(), "") if "train.py --deepspeed_config" in b]
    assert len(gpu) == 1 and readme == gpu

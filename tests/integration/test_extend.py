"""The image as users extend it (docs/extending.md), on the built default row: pip and uv as the
image's user (uid 1000) and as OpenShift's arbitrary uid in group 0, a derived Dockerfile with
`RUN pip install` and no USER line, the pinned stack held and its documented override, and a
training library on top that trains with DeepSpeed ZeRO-3.

Every install names exact versions (and an sdist's build backend through a build constraint), so
no test depends on the index's newest release. The containers reach the index on host networking
with this host's CA bundle where one is configured (a TLS-intercepting proxy); nothing else.
Every container is removed afterwards.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.ca import default_ca_bundle
from pytorch_cuda_build.stages import gate, lock

from helpers import ROOT, current_engine, default_image, shown

pytestmark = [pytest.mark.docker, pytest.mark.network, pytest.mark.slow]

ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
PINS = lock.read(ROOT, ROW)["pins"]
DATA = ROOT / "tests" / "data" / "extend"
CA_IN_CONTAINER = "/etc/pytorch-cuda-test/ca.crt"
USERS = {"default": (), "group-0": ("--user", "1000700000:0")}
# An sdist's build backend, pinned (pip's isolated build would otherwise take the newest setuptools).
BUILD_CONSTRAINT = "setuptools==80.9.0\n"


@pytest.fixture(scope="module")
def image(docker_client, default_build) -> str:
    # default_build first: the session's one tested build, which default_image() then finds done
    return default_image()


@pytest.fixture(scope="module")
def ca() -> str | None:
    return default_ca_bundle()


def index_opts(ca: str | None) -> tuple[str, ...]:
    """Host networking, and the host's CA bundle for pip (PIP_CERT) and uv (SSL_CERT_FILE)."""
    opts: tuple[str, ...] = ("--network", "host", "-e", "PYTORCH_CUDA_NO_BANNER=1")
    if ca:
        opts += ("-v", f"{ca}:{CA_IN_CONTAINER}:ro", "-e", f"PIP_CERT={CA_IN_CONTAINER}", "-e", f"SSL_CERT_FILE={CA_IN_CONTAINER}")
    return opts


def run(image: str, script: str, *opts: str, user: str = "default", timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "run", "--rm", "--label", f"{gate.RUN_LABEL}={gate.RUN_ID}",
                           "--label", "pytorch-cuda.test=extend", *USERS[user], *opts, image, "bash", "-c", script],
                          capture_output=True, text=True, timeout=timeout)


def lines(proc: subprocess.CompletedProcess, prefix: str) -> list[str]:
    return [ln for ln in proc.stdout.splitlines() if ln.startswith(prefix)]


# A wheel with a console script, an sdist built in pip's isolated build environment, and a
# package the image already has (six 1.17.0 in the lock) replaced by another version: its files
# came with an image layer, so pip must be allowed to remove them. Another version, not the
# newest: the test must not depend on what the index publishes next.
PIP = f"""
set -eu
printf '{BUILD_CONSTRAINT}' > /tmp/build-constraints.txt
pip install --quiet --build-constraint /tmp/build-constraints.txt pyflakes==3.2.0 docopt==0.6.2 six==1.16.0
echo "WHO $(id -u):$(id -g)"
echo "SCRIPT $(command -v pyflakes)"
python -c 'import docopt, pyflakes, six, importlib.metadata as m; print("VERSIONS", docopt.__version__, pyflakes.__version__, six.__version__, m.version("torch"), m.version("deepspeed"))'
"""


@pytest.mark.parametrize("user", USERS)
def test_pip_adds_a_wheel_an_sdist_and_replaces_a_locked_package_as_any_user(image, ca, user):
    proc = run(image, PIP, *index_opts(ca), user=user)
    assert proc.returncode == 0, shown(proc)
    assert lines(proc, "WHO ") == [f"WHO {'1000:1000' if user == 'default' else '1000700000:0'}"], shown(proc)
    assert lines(proc, "SCRIPT ") == ["SCRIPT /opt/venv/bin/pyflakes"], shown(proc)
    assert lines(proc, "VERSIONS ") == [f"VERSIONS 0.6.2 3.2.0 1.16.0 {PINS['torch']} {ROW.deepspeed}"], shown(proc)


UV = """
set -eu
uv --version
uv pip install --quiet tomli-w==1.2.0
python -c 'import tomli_w; print("UV-INSTALLED", tomli_w.dumps({"a": 1}).strip())'
"""


@pytest.mark.parametrize("user", USERS)
def test_uv_ships_at_its_pin_and_installs_as_any_user(image, ca, user):
    proc = run(image, UV, *index_opts(ca), user=user)
    assert proc.returncode == 0, shown(proc)
    assert lines(proc, "uv ") and lines(proc, "uv ")[0].split()[1] == PINS["uv"], shown(proc)
    assert lines(proc, "UV-INSTALLED ") == ["UV-INSTALLED a = 1"], shown(proc)


# torchvision 0.23.0 requires torch 2.8.0; the image holds torch at its pin. Each attempt's output
# follows its own marker line.
MOVE_TORCH = """
echo "== pip-indirect"; pip install torchvision==0.23.0 2>&1; echo "EXIT $?"
echo "== uv-indirect"; uv pip install torchvision==0.23.0 2>&1; echo "EXIT $?"
echo "== pip-direct"; pip install torch==2.8.0 2>&1; echo "EXIT $?"
echo "== after"; python -c 'import importlib.metadata as m; print(m.version("torch"))'
"""


def sections(text: str) -> dict[str, str]:
    """Output after each `== NAME` marker line, by NAME."""
    out: dict[str, str] = {}
    for part in text.split("== ")[1:]:
        name, _, body = part.partition("\n")
        out[name.strip()] = body
    return out


def test_an_install_that_would_move_torch_is_refused_naming_torch_and_its_pin(image, ca):
    proc = run(image, MOVE_TORCH, *index_opts(ca))
    got, torch = sections(proc.stdout), PINS["torch"]
    for name in ("pip-indirect", "uv-indirect", "pip-direct"):
        assert got[name].rstrip().endswith("EXIT 1"), shown(proc)
    assert f"The user requested (constraint) torch=={torch}" in got["pip-indirect"], shown(proc)
    assert "torchvision 0.23.0 depends on torch==2.8.0" in got["pip-indirect"], shown(proc)
    assert f"The user requested (constraint) torch=={torch}" in got["pip-direct"], shown(proc)
    assert f"torch=={torch}" in got["uv-indirect"] and "torch==2.8.0" in got["uv-indirect"], shown(proc)
    assert got["after"].split() == [torch], shown(proc)  # nothing moved


# A protected package small enough to move in a test (nvidia-nvtx-cu12, about 100 kB), held, then
# moved with the documented override; the banner then says the stack is not the tested one, and
# `stack check` names it.
OVERRIDE = """
pip install nvidia-nvtx-cu12==12.4.127; echo "HELD-EXIT $?"
PIP_CONSTRAINT= pip install --quiet --no-deps nvidia-nvtx-cu12==12.4.127; echo "OVERRIDE-EXIT $?"
python -m pytorch_cuda_runtime.stack check; echo "CHECK-EXIT $?"
PYTORCH_CUDA_NO_BANNER=0 pytorch-cuda-banner
"""


def test_the_documented_override_moves_a_pinned_package_and_the_banner_says_so(image, ca):
    proc = run(image, OVERRIDE, *index_opts(ca))
    nvtx = PINS["nvidia-nvtx-cu12"]
    assert lines(proc, "HELD-EXIT ") == ["HELD-EXIT 1"], shown(proc)
    assert f"The user requested (constraint) nvidia-nvtx-cu12=={nvtx}" in proc.stdout + proc.stderr, shown(proc)
    assert lines(proc, "OVERRIDE-EXIT ") == ["OVERRIDE-EXIT 0"], shown(proc)
    assert f"nvidia-nvtx-cu12 12.4.127 (tested: {nvtx})" in proc.stdout and lines(proc, "CHECK-EXIT ") == ["CHECK-EXIT 1"], shown(proc)
    assert ("WARNING: the pinned stack differs from what this image was tested with: "
            f"nvidia-nvtx-cu12 12.4.127 (tested: {nvtx})") in proc.stderr, shown(proc)


def test_the_banner_says_how_packages_are_added_and_the_stack_held(image):
    proc = run(image, "true", "-e", "PYTORCH_CUDA_NO_BANNER=0")
    assert proc.returncode == 0, shown(proc)
    assert "pip/uv install as any user; torch, triton, DeepSpeed and the CUDA wheels stay as tested" in proc.stderr, shown(proc)
    assert "PIP_CONSTRAINT= pip install" in proc.stderr and "differs from what this image was tested" not in proc.stderr, shown(proc)


def derived_dockerfile() -> str:
    """The derived Dockerfile docs/extending.md gives behind a TLS-intercepting proxy, as written there."""
    text = (ROOT / "docs" / "extending.md").read_text()
    start = text.index("<!-- derived-dockerfile:start -->")
    block = text[start:text.index("<!-- derived-dockerfile:end -->")]
    return block.split("```dockerfile\n", 1)[1].split("```", 1)[0]


def build_derived(docker: str, env: dict[str, str], image: str, ca: str | None, ctx: Path, tag: str) -> None:
    """The documented derived Dockerfile, built FROM image by one engine's BuildKit: its RUN steps
    run as the image's user (no USER line) and install a package from the index."""
    dockerfile = derived_dockerfile()
    assert "\nUSER" not in dockerfile and "pip install tomli-w==1.2.0" in dockerfile
    ctx.mkdir(exist_ok=True)
    (ctx / "Dockerfile").write_text(dockerfile)
    (ctx / "train.py").write_text("print('TRAIN-PY')\n")
    proc = subprocess.run([docker, "build", "--network", "host", "--secret", f"id=ca,src={ca or os.devnull}",
                           "--build-arg", f"BASE={image}", "-t", tag, str(ctx)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "DOCKER_BUILDKIT": "1", **env})
    assert proc.returncode == 0, shown(proc)


def derived_runs(docker: str, env: dict[str, str], tag: str) -> None:
    """The derived image runs as uid 1000, with the new package, torch at its pin and the code."""
    out = subprocess.run([docker, "run", "--rm", "--network", "host", "-e", "PYTORCH_CUDA_NO_BANNER=1", tag, "bash", "-c",
                          "id -u; python -c 'import tomli_w, torch; print(\"DERIVED\", torch.__version__)'; python train.py"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert out.returncode == 0, shown(out)
    assert out.stdout.split()[0] == "1000" and f"DERIVED {PINS['torch']}" in out.stdout and "TRAIN-PY" in out.stdout, shown(out)


def test_a_derived_dockerfile_pip_installs_with_no_user_line_on_docker_20_10(image, ca, tmp_path):
    tag = f"pytorch-cuda-test-derived:{gate.RUN_ID[-12:]}"
    docker = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker")  # 20.10's client has BuildKit built in
    try:
        build_derived(docker, {}, image, ca, tmp_path / "ctx", tag)
        derived_runs(docker, {}, tag)
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


@pytest.mark.skipif(os.environ.get("PYTORCH_CUDA_TEST_DERIVED_26") != "1",
                    reason="copies the 6.5 GB default image into Docker 26's store first (minutes on 2 cores): "
                           "on request, PYTORCH_CUDA_TEST_DERIVED_26=1")
@pytest.mark.engine26
def test_a_derived_dockerfile_pip_installs_with_no_user_line_on_docker_26(image, ca, tmp_path):
    """The same on Docker 26 with buildx and the containerd store (`build.py engine`), the default
    image carried over with docker save | docker load."""
    tag = f"pytorch-cuda-test-derived:{gate.RUN_ID[-12:]}"
    with current_engine() as engine:
        docker, env = engine["PYTORCH_CUDA_DOCKER"], {**os.environ, **engine}
        try:
            save = subprocess.Popen(["/usr/bin/docker", "save", image], stdout=subprocess.PIPE)
            load = subprocess.run([docker, "load"], stdin=save.stdout, env=env, capture_output=True, text=True, timeout=1800)
            save.stdout.close()
            assert save.wait() == 0 and load.returncode == 0, load.stderr
            build_derived(docker, engine, image, ca, tmp_path / "ctx", tag)
            derived_runs(docker, engine, tag)
        finally:
            for ref in (tag, image):
                subprocess.run([docker, "rmi", "-f", ref], env=env, capture_output=True)


HF = """
set -eu
pip install --quiet -r /extend/hf-requirements.txt
python -c 'import importlib.metadata as m; print("AFTER", *(m.version(n) for n in ("torch", "deepspeed", "transformers", "accelerate")))'
DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 /extend/hf_zero3.py 2>&1 | tail -n 40
"""


def test_transformers_installs_as_the_user_and_trains_zero3_on_the_cpu(image, ca):
    proc = run(image, HF, *index_opts(ca), "-v", f"{DATA}:/extend:ro", "--shm-size", "1g", timeout=900)
    assert proc.returncode == 0, shown(proc)
    assert lines(proc, "AFTER ") == [f"AFTER {PINS['torch']} {ROW.deepspeed} 5.24.0 1.15.0"], shown(proc)
    result = lines(proc, "STAGE=")
    assert len(result) == 1, shown(proc)
    fields = dict(f.split("=", 1) for f in result[0].split() if "=" in f)
    assert fields["STAGE"] == "3" and fields["FINITE"] == "True", shown(proc)

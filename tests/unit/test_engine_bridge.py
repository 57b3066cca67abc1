"""engine.sh's bridge check, against a fake `ip` and `docker` on PATH: the real docker0 is never touched."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytorch_cuda_build.engine.docker_env import ENGINE_SCRIPT

GONE = "engine: the Docker daemon answers but its bridge docker0 is gone; restart dockerd"


@pytest.fixture
def fakes(tmp_path) -> Path:
    """bin/ip answers for the links listed in links/; bin/docker names the daemon's bridge."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (tmp_path / "links").mkdir()
    (bin_ / "ip").write_text(f'#!/bin/sh\n[ "$1 $2" = "link show" ] && [ -e "{tmp_path}/links/$3" ]\n')
    (bin_ / "docker").write_text(f'#!/bin/sh\ncat "{tmp_path}/bridge-name" 2>/dev/null || exit 1\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    (tmp_path / "bridge-name").write_text("docker0\n")
    return tmp_path


def check(fakes: Path, ours: bool = False) -> subprocess.CompletedProcess:
    """Source engine.sh and run check_bridge; a restart is simulated by bringing the link back."""
    # A live dockerd of our own is simulated with a process named dockerd (a copy of sleep).
    script = f"""
source {ENGINE_SCRIPT}
marker={fakes}/marker
pidfile={fakes}/docker.pid
restart_dockerd() {{ echo restarted >> {fakes}/calls; : > {fakes}/links/docker0; }}
wait_answers() {{ return 0; }}
check_bridge
"""
    env = {**os.environ, "PATH": f"{fakes / 'bin'}:{os.environ['PATH']}"}
    proc = None
    if ours:
        dockerd = fakes / "dockerd"
        dockerd.write_bytes(Path("/bin/sleep").read_bytes())
        dockerd.chmod(0o755)
        proc = subprocess.Popen([str(dockerd), "30"])
        (fakes / "marker").write_text(f"{proc.pid}\n")
    try:
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    finally:
        if proc:
            proc.kill()
            proc.wait()


def test_bridge_present_passes(fakes):
    (fakes / "links" / "docker0").touch()
    proc = check(fakes)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_no_bridge_network_means_nothing_to_check(fakes):
    (fakes / "bridge-name").unlink()  # `docker network inspect bridge` fails: --bridge=none
    assert check(fakes).returncode == 0


def test_someone_elses_daemon_without_its_bridge_is_one_clear_line(fakes):
    proc = check(fakes)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [GONE]
    assert not (fakes / "calls").exists()  # not ours: never restarted


def test_a_stale_marker_is_not_ours(fakes):
    (fakes / "marker").write_text("999999\n")
    proc = check(fakes)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1] == GONE
    assert not (fakes / "calls").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_our_own_daemon_is_restarted_and_its_bridge_comes_back(fakes):
    proc = check(fakes, ours=True)
    assert proc.returncode == 0, proc.stderr
    assert (fakes / "calls").read_text() == "restarted\n"
    assert "restarting the dockerd this script started" in proc.stderr


def test_a_daemon_on_its_own_bridge_is_checked_by_that_name(fakes):
    (fakes / "bridge-name").write_text("br-own\n")
    (fakes / "links" / "docker0").touch()
    proc = check(fakes)
    assert proc.returncode != 0 and "its bridge br-own is gone" in proc.stderr
    (fakes / "links" / "br-own").touch()
    assert check(fakes).returncode == 0


def test_sourcing_the_script_runs_nothing():
    """Sourcing defines functions only; nothing is started, installed or checked."""
    proc = subprocess.run(["bash", "-c", f"source {ENGINE_SCRIPT}; type check_bridge >/dev/null"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr


# ---- which dockerd is the default engine's: a second engine beside it is not ---------------

def running(tmp_path: Path, *argv: str, pidfile_names_it: bool = False) -> int:
    """dockerd_running's exit status with one process named dockerd (a shell script) started
    with argv; a fake pgrep lists only that process, so this machine's own daemons are unseen."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    dockerd = tmp_path / "dockerd"
    dockerd.write_text("#!/bin/sh\nsleep 30\n")
    dockerd.chmod(0o755)
    proc = subprocess.Popen([str(dockerd), *argv])
    (bin_ / "pgrep").write_text(f"#!/bin/sh\necho {proc.pid}\n")
    (bin_ / "pgrep").chmod(0o755)
    pidfile = tmp_path / "docker.pid"
    pidfile.write_text(f"{proc.pid}\n" if pidfile_names_it else "999999\n")
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
    try:
        for _ in range(50):  # until the kernel has named it
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "dockerd":
                break
            time.sleep(0.02)
        script = f"source {ENGINE_SCRIPT}; pidfile={pidfile}; dockerd_running"
        return subprocess.run(["bash", "-c", script], env=env, timeout=30).returncode
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_dockerd_with_the_default_pid_file_is_the_default_engine(tmp_path):
    assert running(tmp_path, "--log-level", "info") == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("argv", [("--pidfile", "/run/other/dockerd.pid", "-H", "unix:///run/other.sock"),
                                  ("--pidfile=/run/other/dockerd.pid",), ("-p", "/run/other/dockerd.pid")])
def test_a_second_engine_with_its_own_pid_file_is_not(tmp_path, argv):
    """The CI failure this guards: with Docker 26 up beside it, a killed 20.10 daemon was never
    restarted, because engine.sh took the other dockerd for its own."""
    assert running(tmp_path, *argv) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_process_the_default_pid_file_names_is_the_default_engine(tmp_path):
    assert running(tmp_path, "--pidfile", "/var/run/docker.pid", pidfile_names_it=True) == 0

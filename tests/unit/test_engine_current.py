"""The current engine beside 20.10 (engine_current): what it is started with, without starting it.

Its bring-up for real (download, unpack, two daemons, 20.10 untouched) is
tests/integration/test_engines.py."""
from __future__ import annotations

import shlex
import subprocess

from pytorch_cuda_build.tooling import engine_current

from helpers import ROOT, run_cli

U = engine_current.Unpacked(engine_current.HOME / "packages" / "k", {"docker.io": "26.1.5+dfsg1-9+deb13u1"})


def test_each_store_has_its_own_everything():
    a, b = engine_current.STORES["containerd"], engine_current.STORES["classic"]
    for attr in ("bridge", "address", "state", "run", "docker_host"):
        assert getattr(a, attr) != getattr(b, attr), attr
    assert all(len(s.bridge) <= 15 for s in (a, b))  # IFNAMSIZ
    assert "/var/run/docker.sock" not in a.docker_host + b.docker_host


def test_dockerd_leaves_the_host_and_the_other_engine_alone():
    store = engine_current.STORES["containerd"]
    argv = engine_current.dockerd_argv(U, store)
    assert {"--iptables=false", "--ip6tables=false"} <= set(argv)
    assert argv[argv.index("--bridge") + 1] == store.bridge != "none"  # --bridge=none deleted docker0 here
    # No daemon-wide --dns: BuildKit gives it to RUN steps on the host network too, and apt
    # resolved nothing there. Containers get theirs from the environment (below).
    assert not [a for a in argv if a.startswith("--dns")]
    assert engine_current.environment(U, store)["PYTORCH_CUDA_CONTAINER_DNS"] == "127.0.0.1"
    for flag, value in (("--data-root", store.state / "docker"), ("--exec-root", store.run / "exec"),
                        ("--pidfile", store.run / "dockerd.pid"), ("-H", store.docker_host),
                        ("--containerd", store.run / "containerd.sock")):
        assert argv[argv.index(flag) + 1] == str(value), flag
    assert engine_current.daemon_json(store) == {"features": {"containerd-snapshotter": True}}
    assert engine_current.daemon_json(engine_current.STORES["classic"]) == {"features": {"containerd-snapshotter": False}}


def test_containerd_gets_its_own_root_state_and_socket():
    store = engine_current.STORES["classic"]
    text = engine_current.containerd_config(store)
    assert f'root = "{store.state / "containerd"}"' in text and f'state = "{store.run / "containerd"}"' in text
    assert f'address = "{store.run / "containerd.sock"}"' in text
    assert "/run/containerd" not in text and "/var/lib/containerd" not in text


def test_the_exports_are_shell_that_a_shell_reads_back():
    env = engine_current.environment(U, engine_current.STORES["containerd"])
    script = engine_current.exports({**env, "ODD": "a b'c"}) + 'printf "%s|" "$DOCKER_HOST" "$PYTORCH_CUDA_BUILD_NETWORK" "$ODD"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out == f"{env['DOCKER_HOST']}|host|a b'c|"
    assert shlex.split(engine_current.exports(env).splitlines()[0])[0] == "export"


def test_an_unknown_store_is_one_line_and_exit_2():
    proc = run_cli(ROOT, "engine", "--store", "zfs")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: argument --store: invalid choice: 'zfs' (choose from 'containerd', 'classic') (see --help)"]
    assert proc.stdout == ""

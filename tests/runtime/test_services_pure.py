"""The entrypoint's server modes (pytorch_cuda_runtime.services), their input checks, without
a container: the real sshd and JupyterLab run in tests/integration/test_ways_in.py.

Needs ssh-keygen (openssh-client) on the host, as the image has.
"""
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from pytorch_cuda_runtime import banner  # noqa: E402
from pytorch_cuda_runtime import services as sv

from helpers import free_port  # noqa: E402


def a_public_key():
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "me@laptop", "-f", f"{d}/k"], check=True)
        with open(f"{d}/k.pub") as f:
            pub = f.read()
        with open(f"{d}/k") as f:
            private = f.read()
    return pub, private


class PublicKey(unittest.TestCase):
    def test_a_real_key_passes_trimmed(self):
        pub, _ = a_public_key()
        self.assertEqual(sv.public_key(pub + "\n\n"), pub.strip())

    def test_bad_keys_are_one_line_errors_with_exit_2(self):
        pub, private = a_public_key()
        cases = {None: "is not set", "": "is empty", "   \n": "is empty",
                 pub.strip() + "\n" + pub.strip(): "several lines", private: "private key",
                 "ssh-ed25519 not-base64 me": "not an OpenSSH public key", "garbage": "not an OpenSSH public key"}
        for text, says in cases.items():
            with self.subTest(text=text):
                with self.assertRaises(sv.ServiceError) as e:
                    sv.public_key(text)
                self.assertIn(says, str(e.exception))
                self.assertEqual(e.exception.code, 2)
                self.assertNotIn("\n", str(e.exception))


class Ports(unittest.TestCase):
    def test_port_numbers(self):
        self.assertEqual(sv.port_number(None, "SSH_PORT", 2222), 2222)
        self.assertEqual(sv.port_number("2022", "SSH_PORT", 2222), 2022)
        for bad in ("0", "65536", "22a", "-1", " 22"):
            with self.assertRaises(sv.ServiceError):
                sv.port_number(bad, "SSH_PORT", 2222)

    def test_a_port_in_use_is_refused_before_anything_starts(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            with self.assertRaises(sv.ServiceError) as e:
                sv.port_free("127.0.0.1", port, "sshd")
            self.assertIn(f"port {port} on 127.0.0.1 is already in use", str(e.exception))
            self.assertEqual(e.exception.code, 1)
        sv.port_free("127.0.0.1", port, "sshd")  # free again


class SshdFiles(unittest.TestCase):
    ENV = {"PATH": "/opt/venv/bin:/usr/bin", "VIRTUAL_ENV": "/opt/venv", "NCCL_DEBUG": "INFO",
           "SSH_PUBLIC_KEY": "ssh-ed25519 AAAA", "JUPYTER_TOKEN": "t", "HOME": "/root", "HOSTNAME": "x",
           "WEIRD": 'a"b', "MULTI": "a\nb", "bad-name": "1"}

    def test_the_login_gets_the_containers_environment_but_not_its_secrets(self):
        env = sv.login_environment(self.ENV)
        self.assertEqual(env, {"NCCL_DEBUG": "INFO", "PATH": "/opt/venv/bin:/usr/bin", "VIRTUAL_ENV": "/opt/venv"})

    def test_config_is_key_only_for_one_user(self):
        conf = sv.sshd_config(sv.SSHD_DIR, 2222, "0.0.0.0", "trainer",
                              sv.login_environment(self.ENV))
        for line in ("PasswordAuthentication no", "KbdInteractiveAuthentication no", "PermitRootLogin no",
                     "AllowUsers trainer", "Port 2222", "StrictModes yes",
                     'SetEnv "NCCL_DEBUG=INFO" "PATH=/opt/venv/bin:/usr/bin" "VIRTUAL_ENV=/opt/venv"'):
            self.assertIn(line + "\n", conf)
        self.assertNotIn("/etc/ssh/ssh_host", conf)

    def test_profile_script_quotes(self):
        self.assertEqual(sv.profile_script({"A": "x y", "B": "it's"}), "export A='x y'\nexport B='it'\"'\"'s'\n")

    def test_root_is_refused(self):
        with self.assertRaises(sv.ServiceError) as e:
            sv.prepare_sshd({"SSH_PUBLIC_KEY": "x"}, "/root", "root", 0)
        self.assertIn("non-root", str(e.exception))

    def test_an_sshd_directory_it_cannot_use_is_one_line_about_the_environment(self):
        """The image makes /var/lib/pytorch-cuda/sshd for uid 1000; elsewhere, or gone, one line and exit 1."""
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d)
        env = {"SSH_PUBLIC_KEY": a_public_key()[0], "SSH_PORT": str(free_port()), "SSH_LISTEN": "127.0.0.1"}
        with self.assertRaises(sv.ServiceError) as e:
            sv.prepare_sshd(env, f"{d}/absent", "trainer", 1000)
        self.assertEqual(e.exception.code, 1)
        self.assertIn(f"cannot use {d}/absent", str(e.exception))

    def test_a_uid_without_an_account_is_refused_as_the_environment(self):
        # OpenShift's arbitrary uid, Apptainer's or enroot's caller: no /etc/passwd entry.
        uid = 1000700000
        while True:
            try:
                pwd.getpwuid(uid)
                uid += 1
            except KeyError:
                break
        with self.assertRaises(sv.ServiceError) as e:
            sv.account(uid)
        self.assertEqual(e.exception.code, 1)
        self.assertIn(f"uid {uid} has no account", str(e.exception))
        self.assertEqual(sv.account(os.getuid()), pwd.getpwuid(os.getuid()).pw_name)


class Jupyter(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root)

    def check(self, args, env=None):
        sv.jupyter_checks(args + ["--ip=127.0.0.1", f"--port={free_port()}"], env or {}, root_dir=self.root)

    def test_a_token_or_none_given_is_fine(self):
        self.check([])
        self.check([], {"JUPYTER_TOKEN": "abc"})
        self.check(["--IdentityProvider.token=abc"])

    def test_an_empty_token_is_refused(self):
        for args, env in (([], {"JUPYTER_TOKEN": ""}), ([], {"JUPYTER_TOKEN": "  "}),
                          (["--IdentityProvider.token="], {}), (["--ServerApp.token="], {}),
                          (["--NotebookApp.token=''".replace("''", "")], {})):
            with self.subTest(args=args, env=env):
                with self.assertRaises(sv.ServiceError) as e:
                    self.check(args, env)
                self.assertIn("authentication off", str(e.exception))
                self.assertEqual(e.exception.code, 2)

    @unittest.skipIf(os.geteuid() == 0, "root writes anywhere")
    def test_an_unwritable_root_dir_is_refused(self):
        os.chmod(self.root, 0o500)
        with self.assertRaises(sv.ServiceError) as e:
            self.check([])
        self.assertIn("is not writable", str(e.exception))

    def test_a_missing_root_dir_is_refused(self):
        with self.assertRaises(sv.ServiceError) as e:
            sv.jupyter_checks(["--ServerApp.root_dir=/nonexistent/x", "--ip=127.0.0.1", f"--port={free_port()}"], {})
        self.assertIn("/nonexistent/x is not writable", str(e.exception))

    def test_main_prints_one_line_and_exits_with_the_code(self):
        env = dict(os.environ, PYTHONPATH=ROOT, JUPYTER_TOKEN="")
        p = subprocess.run([sys.executable, "-m", "pytorch_cuda_runtime.services", "jupyter", "lab"],
                           env=env, capture_output=True, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertEqual(p.stderr.count("\n"), 1)
        self.assertTrue(p.stderr.startswith("pytorch-cuda: error: jupyter: JUPYTER_TOKEN is empty"))

    def test_other_commands_pass_through(self):
        env = dict(os.environ, PYTHONPATH=ROOT, JUPYTER_TOKEN="")
        p = subprocess.run([sys.executable, "-m", "pytorch_cuda_runtime.services", "echo", "hi"],
                           env=env, capture_output=True, text=True)
        self.assertEqual((p.returncode, p.stdout), (0, "hi\n"))


class InfiniBand(unittest.TestCase):
    def test_devices_and_the_line_that_says_so(self):
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(f"{d}/sys/mlx5_0")
            os.makedirs(f"{d}/dev")
            self.assertEqual(banner.ib_devices(f"{d}/sys", f"{d}/dev"), (["mlx5_0"], False))
            self.assertIn("--device /dev/infiniband", banner.ib_line(["mlx5_0"], False))
            open(f"{d}/dev/uverbs0", "w").close()
            self.assertEqual(banner.ib_devices(f"{d}/sys", f"{d}/dev"), (["mlx5_0"], True))
        self.assertEqual(banner.ib_devices("/nonexistent", "/nonexistent"), ([], False))
        self.assertIn("no devices visible", banner.ib_line([], False))


if __name__ == "__main__":
    unittest.main()

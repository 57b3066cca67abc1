"""Pure-logic tests of pytorch_cuda_runtime: no torch, no GPU needed.

Run: python3 -m unittest discover -s tests/runtime   (or: pytest tests/runtime)
"""
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from pytorch_cuda_runtime import banner, manifest as mf  # noqa: E402
from pytorch_cuda_runtime.smoke import cli, launch, nocompile, results, versions  # noqa: E402

MANIFEST = {"image": "2.7.1-cuda12.1-runtime", "torch": "2.7.1", "cuda_platform": "12.1",
            "torch_cuda": "12.6", "cudnn": "9.5.1.17", "nccl": "2.26.2", "python": "3.11",
            "deepspeed": "0.17.6", "driver_min": "525.60.13",
            "prebuilt_ops": ["cpu_adam", "shm_comm"],
            "cuda_arch_list": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]}
FACTS = {"torch": "2.7.1+cu126", "torch_cuda": "12.6", "cudnn": 90501, "nccl": "2.26.2",
         "python": "3.11.2", "deepspeed": "0.17.6", "arch_list": MANIFEST["cuda_arch_list"],
         "installed_ops": {"cpu_adam": 1, "deepspeed_shm_comm": 1},
         "ds_build_accelerator": "cpu", "ds_runtime_accelerator": "cpu"}


class VersionTests(unittest.TestCase):
    def test_public_version(self):
        self.assertTrue(mf.versions_match("2.7.1", "2.7.1+cu126"))
        self.assertFalse(mf.versions_match("2.7.1", "2.7.0+cu126"))

    def test_prefix_precision(self):
        self.assertTrue(mf.versions_match("3.11", "3.11.2"))
        self.assertTrue(mf.versions_match("9.5.1.17", "9.5.1"))
        self.assertFalse(mf.versions_match("9.5.1.17", "9.1.0"))
        self.assertFalse(mf.versions_match("12.6", None))
        self.assertFalse(mf.versions_match("2", "2.7"))

    def test_cudnn_encoding(self):
        self.assertEqual(mf.cudnn_version_string(90501), "9.5.1")
        self.assertEqual(mf.cudnn_version_string(8902), "8.9.2")
        self.assertEqual(mf.cudnn_version_string(91002), "9.10.2")

    def test_versions_check_pass_and_fail(self):
        recs = versions.check(MANIFEST, FACTS)
        self.assertEqual([r["status"] for r in recs], ["PASS"] * len(recs))
        bad = versions.check(dict(MANIFEST, nccl="2.21.5"), FACTS)
        nccl = [r for r in bad if r["check"] == "versions.nccl"][0]
        self.assertEqual(nccl["status"], "FAIL")
        self.assertIn("expected '2.21.5', got '2.26.2'", results.describe(nccl))


class ArchTests(unittest.TestCase):
    archs = MANIFEST["cuda_arch_list"]

    def test_exact_and_same_major(self):
        self.assertTrue(mf.arch_supported("9.0", self.archs)[0])
        ok, how = mf.arch_supported("8.9", self.archs)
        self.assertTrue(ok)
        self.assertIn("sm_86", how)

    def test_missing(self):
        self.assertFalse(mf.arch_supported("10.0", self.archs)[0])
        self.assertFalse(mf.arch_supported((3, 7), self.archs)[0])
        self.assertTrue(mf.arch_supported("10.0", self.archs + ["compute_90"])[0])


class BannerTests(unittest.TestCase):
    def test_parse_smi(self):
        gpus = banner.parse_smi("NVIDIA H100 80GB HBM3, 550.54.15, 9.0\n\n")
        self.assertEqual(gpus, [("NVIDIA H100 80GB HBM3", "550.54.15", "9.0")])

    def test_warnings(self):
        w = banner.warnings_for(MANIFEST, [], 64 << 20)
        self.assertTrue(any("--gpus all" in x for x in w))
        self.assertTrue(any("--shm-size" in x and "--ipc=host" in x for x in w))
        w = banner.warnings_for(MANIFEST, [("Old", "470.1", "9.0"), ("B200", "575.1", "10.0")],
                                8 << 30)
        self.assertTrue(any("older than 525.60.13" in x for x in w))
        self.assertTrue(any("sm_100" in x for x in w))
        self.assertEqual(len(w), 2)

    def test_no_banner_env_and_never_fails(self):
        env = dict(os.environ, PYTHONPATH=ROOT, PYTORCH_CUDA_MANIFEST="/nonexistent")
        p = subprocess.run([sys.executable, "-m", "pytorch_cuda_runtime.banner"], env=env,
                           capture_output=True, text=True)
        self.assertEqual((p.returncode, p.stdout), (0, ""))
        self.assertIn("manifest unreadable", p.stderr)
        env["PYTORCH_CUDA_NO_BANNER"] = "1"
        p = subprocess.run([sys.executable, "-m", "pytorch_cuda_runtime.banner"], env=env,
                           capture_output=True, text=True)
        self.assertEqual((p.returncode, p.stdout, p.stderr), (0, "", ""))

    def test_entrypoint_execs_command(self):
        bindir = os.path.join(ROOT, "pytorch_cuda_runtime", "bin")
        env = dict(os.environ, PATH=bindir + os.pathsep + os.environ["PATH"], PYTHONPATH=ROOT,
                   PYTORCH_CUDA_PYTHON=sys.executable, PYTORCH_CUDA_MANIFEST="/nonexistent")
        p = subprocess.run([os.path.join(bindir, "pytorch-cuda-entrypoint"), "echo", "hi"],
                           env=env, capture_output=True, text=True)
        self.assertEqual((p.returncode, p.stdout), (0, "hi\n"))
        self.assertIn("pytorch-cuda", p.stderr)


class SuiteLogicTests(unittest.TestCase):
    def test_plan(self):
        self.assertEqual(cli.plan(["fsdp2"], 0, 2), [("fsdp2", "cpu", 2)])
        self.assertEqual(cli.plan(["collectives", "fsdp2"], 1, 2),
                         [("collectives", "cuda", 1), ("fsdp2", "cuda", 1), ("fsdp2", "cpu", 2)])
        self.assertEqual(cli.plan(["zero3"], 4, 2), [("zero3", "cuda", 4)])

    def test_only_validation(self):
        with self.assertRaises(SystemExit):
            cli.parse_args(["--only", "bogus"])
        self.assertEqual(cli.parse_args(["--only", "versions,fsdp2"]).only, ["versions", "fsdp2"])

    def test_table_and_summary(self):
        recs = [results.record("a.b", "PASS", "cpu x2", 0, actual="ok"),
                results.record("c", "FAIL", "cpu x2", 1, expected=1, actual=2)]
        t = results.table(recs)
        self.assertIn("expected 1, got 2", t)
        self.assertEqual(results.summary(recs)["FAIL"], 1)

    def test_nocompile(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual([r["status"] for r in nocompile.check(d, FACTS, MANIFEST)],
                             ["PASS"] * 3)
            os.makedirs(os.path.join(d, "shm_comm"))
            open(os.path.join(d, "shm_comm", "x.so"), "w").close()
            recs = nocompile.check(d, dict(FACTS, installed_ops={"cpu_adam": 1}), MANIFEST)
            self.assertEqual([r["status"] for r in recs], ["FAIL", "PASS", "FAIL"])
            recs = nocompile.check(d, dict(FACTS, ds_runtime_accelerator="cuda"), MANIFEST)
            self.assertIn("would JIT", recs[1]["actual"])

    def test_step_timeout_kills_group(self):
        with tempfile.TemporaryDirectory() as d:
            # The grandchild must die with the group, not outlive the timeout.
            cmd = ["sh", "-c", f"sleep 30 & echo $! > {d}/pid; wait"]
            r = launch.run_step(cmd, dict(os.environ), 1, os.path.join(d, "log"))
            self.assertTrue(r["timed_out"])
            with open(os.path.join(d, "pid")) as f:
                pid = int(f.read())
            with self.assertRaises(ProcessLookupError):
                for _ in range(50):
                    os.kill(pid, 0)
                    import time
                    time.sleep(0.1)


if __name__ == "__main__":
    unittest.main()

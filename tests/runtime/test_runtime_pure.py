"""Pure-logic tests of pytorch_cuda_runtime: no torch, no GPU needed.

Run: python3 -m unittest discover -s tests/runtime   (or: pytest tests/runtime)
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from pytorch_cuda_runtime import banner  # noqa: E402
from pytorch_cuda_runtime import manifest as mf
from pytorch_cuda_runtime.smoke import cli, launch, nocompile, ops, results, versions, zero  # noqa: E402

MANIFEST = {"image": "2.7.1-cuda12.1-runtime", "torch": "2.7.1", "cuda_platform": "12.1",
            "torch_cuda": "12.6", "cudnn": "9.5.1.17", "nccl": "2.26.2", "python": "3.11",
            "deepspeed": "0.17.6", "driver_min": "525.60.13",
            "prebuilt_ops": ["cpu_adam", "shm_comm"],
            "cuda_arch_list": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]}
FACTS = {"torch": "2.7.1+cu126", "torch_cuda": "12.6", "cudnn": 90501, "nccl": "2.26.2",
         "python": "3.11.2", "deepspeed": "0.17.6", "arch_list": MANIFEST["cuda_arch_list"],
         "installed_ops": {"cpu_adam": 1, "deepspeed_shm_comm": 1},
         "ds_build_accelerator": "cuda", "ds_runtime_accelerator": "cpu"}


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

    def test_release_numbers(self):
        self.assertEqual(mf.release("2.7.1+cu126"), (2, 7, 1))
        self.assertEqual(mf.release("535.104.05"), (535, 104, 5))  # a driver: numbers, not text
        self.assertLess(mf.release("535.104.05"), mf.release("535.129.03"))
        self.assertEqual(mf.release("N/A"), ())  # no version at all: never equal to one
        self.assertFalse(mf.versions_match("12.6", "N/A"))

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

    def test_plan_new_families(self):
        # One GPU: replication and sharding need CPU ranks too, DDP and ZeRO 1/2 included.
        self.assertEqual(cli.plan(["zero2_offload", "ddp"], 1, 2),
                         [("ddp", "cuda", 1), ("ddp", "cpu", 2),
                          ("zero2_offload", "cuda", 1), ("zero2_offload", "cpu", 2)])
        # One-process families: the GPU when there is one, and always the CPU.
        self.assertEqual(cli.plan(["compile", "bf16"], 2, 2),
                         [("bf16", "cuda", 1), ("bf16", "cpu", 1),
                          ("compile", "cuda", 1), ("compile", "cpu", 1)])
        self.assertEqual(cli.plan(["compile"], 0, 2), [("compile", "cpu", 1)])
        self.assertEqual(cli.plan(["versions", "gpu", "nocompile"], 1, 2), [])
        everything = cli.plan(cli.FAMILIES, 0, 2)  # the measure runs on a GPU only
        self.assertEqual({f for f, _, _ in everything},
                         set(cli.FAMILIES) - {"versions", "gpu", "extras", "nocompile", "measure"})

    def test_cpu_jit_ops_follow_the_plan(self):
        self.assertEqual(nocompile.cpu_jit_ops(cli.plan(["zero3"], 0, 2)), ["shm_comm"])
        self.assertEqual(nocompile.cpu_jit_ops(cli.plan(cli.ZERO, 0, 2)),
                         ["shm_comm", "cpu_adam", "fused_adam"])
        self.assertEqual(nocompile.cpu_jit_ops(cli.plan(["zero2", "ddp", "fsdp2"], 0, 2)),
                         ["shm_comm", "fused_adam"])
        # 2 GPUs: ZeRO runs on the GPUs only, nothing to build for the CPU.
        self.assertEqual(nocompile.cpu_jit_ops(cli.plan(cli.FAMILIES, 2, 2)), [])
        self.assertEqual(nocompile.cpu_jit_ops(cli.plan(["zero1_offload"], 1, 2)),
                         ["shm_comm", "cpu_adam"])

    def test_launcher_per_family(self):
        self.assertEqual(cli.launcher_cmd("bf16", "cpu", 1)[1:],
                         ["-m", "pytorch_cuda_runtime.smoke.worker", "bf16"])
        self.assertIn("--nproc_per_node", cli.launcher_cmd("zero1", "cpu", 2))
        self.assertIn("--num_gpus", cli.launcher_cmd("zero3_launcher", "cpu", 2))

    def test_only_validation(self):
        with self.assertRaises(SystemExit):
            cli.parse_args(["--only", "bogus"])
        self.assertEqual(cli.parse_args(["--only", "versions,fsdp2"]).only, ["versions", "fsdp2"])
        for fam in cli.FAMILIES:
            self.assertEqual(cli.parse_args(["--only", fam]).only, [fam])

    def test_manifest_option(self):
        self.assertEqual(cli.parse_args(["--manifest", "m.json"]).manifest, "m.json")
        old = os.environ.get("PYTORCH_CUDA_MANIFEST")
        os.environ["PYTORCH_CUDA_MANIFEST"] = "/x/m.json"
        try:
            self.assertEqual(cli.parse_args([]).manifest, "/x/m.json")
        finally:
            if old is None:
                del os.environ["PYTORCH_CUDA_MANIFEST"]
            else:
                os.environ["PYTORCH_CUDA_MANIFEST"] = old

    def test_workers_read_the_manifest_the_suite_was_given(self):
        # The extras worker loads the manifest itself: `--manifest` must reach it, or a
        # gpu-bundle's suite run by hand reads /opt/pytorch-cuda/manifest.json (seen on an H100).
        with tempfile.TemporaryDirectory() as d:
            suite = cli.Suite(cli.parse_args(["--manifest", "m.json", "--report", os.path.join(d, "r.json")]))
            try:
                self.assertEqual(suite.env("cuda")["PYTORCH_CUDA_MANIFEST"], os.path.abspath("m.json"))
            finally:
                shutil.rmtree(suite.work)

    def test_family_env_gives_compile_fresh_caches(self):
        env = cli.family_env("compile", "/w/compile_cpu1")
        self.assertEqual(env["TORCHINDUCTOR_CACHE_DIR"], "/w/compile_cpu1/inductor_cache")
        self.assertTrue(env["TRITON_CACHE_DIR"].startswith(env["TORCHINDUCTOR_CACHE_DIR"]))
        self.assertEqual(cli.family_env("zero1", "/w"), {})

    def test_table_and_summary(self):
        recs = [results.record("a.b", "PASS", "cpu x2", 0, actual="ok"),
                results.record("c", "FAIL", "cpu x2", 1, expected=1, actual=2)]
        t = results.table(recs)
        self.assertIn("expected 1, got 2", t)
        self.assertEqual(results.summary(recs)["FAIL"], 1)

    def test_nocompile_empty_check(self):
        with tempfile.TemporaryDirectory() as d:
            r = nocompile.empty_check("nocompile.torch_extensions", "ops", d, "prebuilt ops load")
            self.assertEqual((r["status"], r["actual"]), ("PASS", "empty"))
            os.makedirs(os.path.join(d, "fused_adam"))
            open(os.path.join(d, "fused_adam", "fused_adam.so"), "w").close()
            r = nocompile.empty_check("nocompile.torch_extensions", "ops", d, "prebuilt ops load")
            self.assertEqual((r["status"], r["actual"]), ("FAIL", ["fused_adam/fused_adam.so"]))

    def test_nocompile_jit_builds_are_info(self):
        with tempfile.TemporaryDirectory() as d:
            before = nocompile.built_ops(d)
            for op in ("cpu_adam", "deepspeed_shm_comm"):
                os.makedirs(os.path.join(d, "py311_cu126", op))
                open(os.path.join(d, "py311_cu126", op, "build.ninja"), "w").close()
            so = os.path.join(d, "py311_cu126", "cpu_adam", "cpu_adam.so")  # shm_comm left no library
            open(so, "w").close()
            after = nocompile.built_ops(d)
            self.assertEqual(after, {"cpu_adam": os.stat(so).st_mtime_ns, "deepspeed_shm_comm": 0})
            builds = nocompile.new_builds(before, after, "zero1_offload_cpu2", 95.0)
            self.assertEqual(nocompile.new_builds(after, after, "zero2_cpu2", 9.0), [])
            os.utime(so, ns=(1, after["cpu_adam"] + 10**9))  # rebuilt in place, e.g. over a seeded copy
            rebuilt = nocompile.new_builds(after, nocompile.built_ops(d), "zero2_cpu2", 9.0)
            self.assertEqual(rebuilt, [("cpu_adam", True, "zero2_cpu2", 9.0)])
        r = nocompile.jit_info(builds)
        self.assertEqual(r["status"], "INFO")
        self.assertEqual(r["actual"], "cpu_adam; failed: deepspeed_shm_comm")
        self.assertIn("cpu_adam in zero1_offload_cpu2 (95 s step)", r["detail"])
        self.assertEqual(nocompile.jit_info([])["actual"], "nothing compiled")


    def test_host_facts_for_the_report(self):
        host = cli.host_facts(dict(FACTS, devices=[{"index": 0, "name": "H100"}]))
        self.assertEqual((host["torch"], host["deepspeed"]), ("2.7.1+cu126", "0.17.6"))
        self.assertEqual(host["devices"][0]["name"], "H100")
        self.assertIsInstance(host["nvidia_smi"], list)
        self.assertIn("platform", host)

    def test_ops_step_needs_the_manifest_accelerator(self):
        suite = type("S", (), {"args": type("A", (), {"manifest": "/m.json"})})()
        recs = nocompile.run_ops(suite, dict(MANIFEST))  # no 'ops_accelerator'
        self.assertEqual([(r["check"], r["status"]) for r in recs],
                         [("nocompile.ops_accelerator", "FAIL")])
        self.assertIn("/m.json", recs[0]["detail"])


class OpsTests(unittest.TestCase):
    def test_builder_names(self):
        self.assertEqual(ops.builder_class("cpu_adam"), "CPUAdamBuilder")
        self.assertEqual(ops.builder_class("fused_adam"), "FusedAdamBuilder")
        self.assertEqual(ops.builder_class("fused_lamb"), "FusedLambBuilder")
        self.assertEqual(ops.builder_class("async_io"), "AsyncIOBuilder")
        self.assertEqual(ops.builder_class("shm_comm"), "ShareMemCommBuilder")
        self.assertEqual(ops.builder_class("new_thing"), "NewThingBuilder")

    def test_installed_key(self):
        inst = {"cpu_adam": True, "deepspeed_shm_comm": True}
        self.assertEqual(ops.installed_key("shm_comm", inst), "deepspeed_shm_comm")
        self.assertEqual(ops.installed_key("cpu_adam", inst), "cpu_adam")
        self.assertEqual(ops.installed_key("fused_adam", inst), "fused_adam")

    def test_why_not_prebuilt(self):
        inst = {"cpu_adam": True, "fused_adam": True, "async_io": False}
        self.assertIsNone(ops.why_not_prebuilt("fused_adam", inst, "cuda", "cuda", "cuda"))
        self.assertIn("installed_ops['async_io']=False",
                      ops.why_not_prebuilt("async_io", inst, "cuda", "cuda", "cuda"))
        self.assertIn("built for accelerator 'cpu', run-time 'cuda'",
                      ops.why_not_prebuilt("cpu_adam", inst, "cpu", "cuda", "cuda"))
        self.assertIn("run-time accelerator 'cpu'",
                      ops.why_not_prebuilt("cpu_adam", inst, "cuda", "cpu", "cuda"))

    def test_accelerator_record(self):
        self.assertEqual(ops.accelerator_record("cuda", "cuda", "cuda", None)[1], "PASS")
        check, status, _, actual, detail = ops.accelerator_record("cpu", "cuda", "cuda", None)
        self.assertEqual((check, status), ("nocompile.ops_accelerator", "FAIL"))
        self.assertIn("built for 'cpu'", actual)
        self.assertIn("no CUDA", detail)


class ZeroConfigTests(unittest.TestCase):
    def test_every_variant_is_a_family(self):
        self.assertEqual(list(zero.VARIANTS), cli.ZERO)

    def test_raw_config_has_integer_sizes(self):
        for fam, v in zero.VARIANTS.items():
            cfg = zero.ds_config(2, v["stage"], v["offload"], v["adam"])
            for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                      "gradient_accumulation_steps"):
                self.assertIsInstance(cfg[k], int, (fam, k))
            self.assertEqual(cfg["zero_optimization"]["stage"], v["stage"])
            self.assertEqual("offload_optimizer" in cfg["zero_optimization"], v["offload"])

    def test_deepspeed_default_adam_is_covered(self):
        # {"type": "Adam"} without torch_adam: FusedAdam, the config most users write.
        plain = [f for f, v in zero.VARIANTS.items() if not v["offload"] and v["adam"] == "default"]
        self.assertTrue(plain)
        cfg = zero.ds_config(2, 2, False, "default")
        self.assertEqual(cfg["optimizer"], {"type": "Adam", "params": {"lr": 1e-2}})
        self.assertEqual(zero.expected_optimizer(False, "default"), ("FusedAdam",))
        self.assertEqual(zero.expected_optimizer(True, "default"), ("DeepSpeedCPUAdam",))
        self.assertTrue(zero.ds_config(2, 3, False, "torch")["optimizer"]["params"]["torch_adam"])
        self.assertIn("AdamW", zero.expected_optimizer(False, "torch"))

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


class SbomTests(unittest.TestCase):
    """The image build runs `sbom --strict`: an SBOM missing a whole kind of package fails it."""

    def test_strict_fails_when_a_kind_is_missing(self):
        from unittest import mock

        from pytorch_cuda_runtime import sbom
        with tempfile.TemporaryDirectory() as d, mock.patch.object(sbom, "debian_components", return_value=[]):
            out = os.path.join(d, "sbom.json")
            with self.assertRaises(SystemExit) as e:
                sbom.main(["--strict", "--output", out])
            self.assertIn("no pkg:deb components", str(e.exception.code))
            self.assertFalse(os.path.exists(out))
            self.assertEqual(sbom.main(["--output", out]), 0)  # without --strict: any image, as it is
        deb = [{"type": "library", "name": "tini", "version": "0.19.0-1", "purl": "pkg:deb/debian/tini@0.19.0-1?arch=amd64"}]
        with tempfile.TemporaryDirectory() as d, mock.patch.object(sbom, "debian_components", return_value=deb):
            self.assertEqual(sbom.main(["--strict", "--output", os.path.join(d, "sbom.json")]), 0)

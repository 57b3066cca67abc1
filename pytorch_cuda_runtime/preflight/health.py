"""Phase 1's GPU health: each GPU's faults as NVML reports them, read without torch.

Read through nvidia-ml-py's pynvml (in every image, as DeepSpeed's dependency); where it is
missing or NVML does not start, through nvidia-smi's query mode, which answers fewer of them
(no NVLink state, no slowdown threshold, no Xid). A query a GPU does not support (NVML's
NOT_SUPPORTED: retired pages on Ampere and later, row remapping before it) is recorded as not
read, never as a fault. The threshold of each check, and the NVML call it reads:

  xid            any Xid other than 13, 31, 43, 45 (NVIDIA's Xid catalog marks those four as
                 caused by the application): NVML's XidCriticalError events during a
                 XID_LISTEN_MS window, and the kernel log (/dev/kmsg) where it is readable
  ecc            one or more uncorrected ECC errors since the driver loaded:
                 nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE_ECC)
  row-remap      a remapping pending (a reset applies it) or failed: nvmlDeviceGetRemappedRows
  retired-pages  pages pending retirement: nvmlDeviceGetRetiredPagesPendingStatus
  nvlink         a link inactive while others of the GPU are active: nvmlDeviceGetNvLinkState
  throttle       a clock event reason other than GpuIdle and ApplicationsClocksSetting
                 (nvmlDeviceGetCurrentClocksEventReasons), or applications clocks set below
                 their default (nvmlDeviceGet(Default)ApplicationsClock, SM)
  temperature    at or over the slowdown threshold: nvmlDeviceGetTemperatureThreshold(SLOWDOWN)
  pcie           under load only (the driver lowers an idle link's speed and width): compute.py

Facts in, lines out: findings() is pure, the unit tests drive it with a fake NVML (fakenvml.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

from . import fakenvml

XID_LISTEN_MS = 500
FUNCTION_NOT_FOUND = 13  # NVML_ERROR_FUNCTION_NOT_FOUND: a binding newer than the driver
KMSG = "/dev/kmsg"
APP_XIDS = {13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
            45: "preemptive cleanup, due to previous errors"}
# nvmlClocksEventReason* (pynvml), the names NVML's documentation gives them
REASONS = {0x1: "GpuIdle", 0x2: "ApplicationsClocksSetting", 0x4: "SwPowerCap", 0x8: "HwSlowdown", 0x10: "SyncBoost",
           0x20: "SwThermalSlowdown", 0x40: "HwThermalSlowdown", 0x80: "HwPowerBrakeSlowdown",
           0x100: "DisplayClockSetting"}
BENIGN_REASONS = 0x1 | 0x2
CHECKS = {
    "xid": "an Xid other than 13, 31, 43, 45",
    "ecc": "an uncorrected volatile ECC error",
    "row-remap": "a row remapping pending or failed",
    "retired-pages": "retired pages pending",
    "pcie": "a PCIe link under load below its maximum generation or width",
    "nvlink": "an inactive NVLink link beside active ones",
    "throttle": "a clock event reason other than idle and the applications clocks setting, or applications "
                "clocks below their default",
    "temperature": "a temperature at or over the slowdown threshold",
    "compute": "the bf16 matmul failed or did not end within the GPU bound",
    "compute-peak": "TFLOP/s under --peak-ratio x the product's dense bf16 peak",
    "compute-slow": "TFLOP/s under --gpu-slow-ratio x the job's median GPU of the same product",
    "compute-checksum": "a result differing from the job's majority of the same product",
}
SMI_FIELDS = {"ecc_uncorrected": "ecc.errors.uncorrected.volatile.total", "retired_pages_pending": "retired_pages.pending",
              "reasons": ("clocks_event_reasons.active", "clocks_throttle_reasons.active"),
              "temperature": "temperature.gpu"}


@dataclass(frozen=True)
class Finding:
    check: str  # a key of CHECKS
    gpu: str  # "GPU 3 (serial 1650922000123)"
    text: str

    def line(self) -> str:
        return f"{self.gpu}: {self.text}"


def label(index: int | str, serial: str | None) -> str:
    return f"GPU {index} (serial {serial or 'unknown'})"


def split(findings: Iterable[Finding], warn: frozenset[str]) -> tuple[list[str], list[str]]:
    """(failure lines, warning lines): a check named in warn (--warn) only warns."""
    fails: list[str] = []
    warns: list[str] = []
    for f in findings:
        (warns if f.check in warn else fails).append(f"{f.line()} [{f.check}]")
    return fails, warns


# ---- reading

def load(env: dict[str, str], host: str) -> tuple[Any, str]:
    """(NVML, where it comes from), or (None, why there is none): the fake where the test hook names
    one, else pynvml started."""
    if env.get(fakenvml.VARIABLE):
        fake = fakenvml.FakeNvml(env[fakenvml.VARIABLE], host)
        return fake, fake.source
    try:
        import pynvml  # here: phase 1 runs where nvidia-ml-py is missing too
    except ImportError:
        return None, "nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # pynvml.NVMLError: no driver, no libnvidia-ml.so.1
        return None, f"NVML did not start ({e})"
    return pynvml, "NVML"


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _query(nv: Any, handle: Any, key: str, g: dict[str, Any], read: Callable[[], Any]) -> None:
    try:
        g[key] = read()
    except nv.NVMLError as e:
        g["unread"][key] = text(e)
    except AttributeError as e:  # an older binding without the call
        g["unread"][key] = f"not in this nvidia-ml-py ({e})"


def _reasons(nv: Any, h: Any) -> int:
    """The clock event reasons; through the older name where the binding or the driver lacks the newer."""
    try:
        return int(nv.nvmlDeviceGetCurrentClocksEventReasons(h))
    except (AttributeError, nv.NVMLError) as e:
        if isinstance(e, nv.NVMLError) and getattr(e, "value", None) != FUNCTION_NOT_FOUND:
            raise
        return int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))


def nvlink_states(nv: Any, h: Any) -> list[int] | None:
    """Each present link's state (1 active), or None where the GPU has no NVLink."""
    states = []
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            states.append(int(nv.nvmlDeviceGetNvLinkState(h, link)))
        except nv.NVMLError:
            break  # past the GPU's last link (INVALID_ARGUMENT), or no NVLink at all (NOT_SUPPORTED)
    return states or None


def read_gpu(nv: Any, index: int) -> dict[str, Any]:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    g: dict[str, Any] = {"index": index, "name": text(nv.nvmlDeviceGetName(h)), "uuid": text(nv.nvmlDeviceGetUUID(h)),
                         "unread": {}}
    queries: dict[str, Callable[[], Any]] = {
        "serial": lambda: text(nv.nvmlDeviceGetSerial(h)),
        "ecc_uncorrected": lambda: int(nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                                       nv.NVML_VOLATILE_ECC)),
        "remapped_rows": lambda: [int(v) for v in nv.nvmlDeviceGetRemappedRows(h)],
        "retired_pages_pending": lambda: int(nv.nvmlDeviceGetRetiredPagesPendingStatus(h)) == nv.NVML_FEATURE_ENABLED,
        "nvlink": lambda: nvlink_states(nv, h),
        "reasons": lambda: _reasons(nv, h),
        "app_clocks": lambda: [int(nv.nvmlDeviceGetApplicationsClock(h, nv.NVML_CLOCK_SM)),
                               int(nv.nvmlDeviceGetDefaultApplicationsClock(h, nv.NVML_CLOCK_SM))],
        "temperature": lambda: int(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
        "slowdown": lambda: int(nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
    }
    for key, read in queries.items():
        _query(nv, h, key, g, read)
    return g


def xid_events(nv: Any, count: int, window_ms: int = XID_LISTEN_MS) -> tuple[dict[int, list[int]], str | None]:
    """{GPU index: [Xid, ...]} that NVML delivers within window_ms, and why it could not listen (or None)."""
    events: dict[int, list[int]] = {}
    try:
        es = nv.nvmlEventSetCreate()
    except nv.NVMLError as e:
        return events, f"NVML's event set: {text(e)}"
    try:
        for i in range(count):
            nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(i), nv.nvmlEventTypeXidCriticalError, es)
        deadline = time.monotonic() + window_ms / 1000
        while (left := int((deadline - time.monotonic()) * 1000)) > 0:
            try:
                data = nv.nvmlEventSetWait(es, left)
            except nv.NVMLError as e:
                if getattr(e, "value", None) == nv.NVML_ERROR_TIMEOUT:
                    break
                raise
            events.setdefault(int(nv.nvmlDeviceGetIndex(data.device)), []).append(int(data.eventData))
    except nv.NVMLError as e:
        return events, f"Xid events: {text(e)}"
    finally:
        try:
            nv.nvmlEventSetFree(es)
        except nv.NVMLError:
            pass
    return events, None


def kernel_xids(path: str = KMSG) -> tuple[dict[str, list[int]], str | None]:
    """{PCI bus 'DDDD:BB:DD' (lower case): [Xid, ...]} from the kernel log's `NVRM: Xid (PCI:...): N,` lines,
    and why it was not readable (a container without CAP_SYSLOG, or no /dev/kmsg), or None."""
    out: dict[str, list[int]] = {}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        return out, f"the kernel log ({path}): {e.strerror}"
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(fd, 8192)  # /dev/kmsg: one record a read; a file: its text
            except BlockingIOError:
                break  # the end of the ring buffer
            except OSError as e:
                if e.errno == 32:  # EPIPE: a record overwritten while read; the next read goes on
                    continue
                return out, f"the kernel log ({path}): {e.strerror}"
            if not chunk:
                break
            chunks.append(chunk.decode(errors="replace"))
    finally:
        os.close(fd)
    for m in re.finditer(r"NVRM: Xid \(PCI:([0-9a-fA-F]+:[0-9a-fA-F]+:[0-9a-fA-F]+)[^)]*\): (\d+),", "".join(chunks)):
        out.setdefault(bus(m[1]), []).append(int(m[2]))
    return out, None


def bus(text_id: str) -> str:
    """'00000000:3B:00.0' or '0000:3b:00' as 'dddd:bb:dd' (domain, bus and device, lower case)."""
    parts = text_id.lower().split(".")[0].split(":")
    domain, rest = parts[:-2], parts[-2:]
    return ":".join([f"{int(domain[0], 16) if domain else 0:04x}", *rest])


def read_nvml(nv: Any, kmsg: str = KMSG, window_ms: int = XID_LISTEN_MS) -> list[dict[str, Any]]:
    count = int(nv.nvmlDeviceGetCount())
    gpus = [read_gpu(nv, i) for i in range(count)]
    events, why = xid_events(nv, count, window_ms)
    logged, why_log = kernel_xids(kmsg)
    for g in gpus:
        try:
            g["bus_id"] = text(nv.nvmlDeviceGetPciInfo(nv.nvmlDeviceGetHandleByIndex(g["index"])).busId)
        except nv.NVMLError:
            g["bus_id"] = None
        from_log = logged.get(bus(g["bus_id"]), []) if g["bus_id"] else []
        g["xid"] = [{"xid": x, "source": "NVML event"} for x in events.get(g["index"], [])] + \
                   [{"xid": x, "source": "kernel log"} for x in from_log]
        if why and why_log:
            g["unread"]["xid"] = f"{why}; {why_log}"
    return gpus


def smi_field(smi: str, field: str, run: Callable[..., Any] = subprocess.run) -> list[str] | None:
    """One field for every GPU, or None where this nvidia-smi does not know it (it refuses a query
    with one unknown field as a whole, so each is asked alone)."""
    try:
        out = run([smi, f"--query-gpu={field}", "--format=csv,noheader,nounits"], capture_output=True, text=True,
                  timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return [ln.strip() for ln in out.stdout.splitlines()] if out.returncode == 0 else None


def read_smi(run: Callable[..., Any] = subprocess.run) -> tuple[list[dict[str, Any]] | None, str]:
    """What nvidia-smi's query mode answers of the same facts: (GPUs, source), or (None, why)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None, "no nvidia-smi"
    ids = smi_field(smi, "index,serial,name,uuid,pci.bus_id", run)
    if ids is None:
        return None, "nvidia-smi did not answer"
    gpus: list[dict[str, Any]] = []
    for line in ids:
        index, serial, name, uuid, pci = (v.strip() for v in line.split(",", 4))
        gpus.append({"index": int(index), "serial": serial, "name": name, "uuid": uuid, "bus_id": pci, "xid": [],
                     "unread": {"nvlink": "not in nvidia-smi's query mode", "slowdown": "not in nvidia-smi's query mode",
                                "xid": "not in nvidia-smi's query mode", "remapped_rows": "not in nvidia-smi's --query-gpu"}})
    for key, fields in SMI_FIELDS.items():
        values: list[str] | None = None
        for field in (fields,) if isinstance(fields, str) else fields:
            values = smi_field(smi, field, run)
            if values is not None:
                break
        read: list[str | None] = list(values) if values is not None else [None] * len(gpus)
        for g, v in zip(gpus, read):
            if v is None or v.startswith(("[N/A]", "N/A", "[Not Supported]")):
                g["unread"][key] = v or "this nvidia-smi does not know the field"
            elif key == "retired_pages_pending":
                g[key] = v.lower() == "yes"
            else:
                g[key] = int(v, 16) if v.startswith("0x") else int(float(v))
    return gpus, "nvidia-smi's query mode (nvidia-ml-py missing or NVML not started)"


def read(env: dict[str, str], host: str) -> tuple[list[dict[str, Any]] | None, str]:
    """Every GPU's facts and their source, or (None, why none were read)."""
    nv, source = load(env, host)
    if nv is None:
        gpus, smi_source = read_smi()
        return gpus, smi_source if gpus is not None else f"{source}; {smi_source}"
    try:
        return read_nvml(nv), source
    except nv.NVMLError as e:
        return None, f"{source}: {text(e)}"
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:  # pynvml.NVMLError; the facts are read
            pass


# ---- the checks

def findings(g: dict[str, Any]) -> list[Finding]:
    """One GPU's faults against each check's threshold (pcie: compute.py, under load)."""
    who, out = label(g["index"], g.get("serial")), []
    for x in g.get("xid", []):
        if x["xid"] not in APP_XIDS:
            out.append(Finding("xid", who, f"Xid {x['xid']} ({x['source']})"))
    if g.get("ecc_uncorrected"):
        out.append(Finding("ecc", who, f"{g['ecc_uncorrected']} uncorrected ECC error(s) since the driver loaded "
                                       "(volatile): the GPU's memory returned data it could not correct"))
    if g.get("remapped_rows"):
        _, unc, pending, failure = g["remapped_rows"]
        if failure:
            out.append(Finding("row-remap", who, f"row remapping failed ({unc} uncorrectable row(s) remapped): the GPU "
                                                 "has no spare rows left and needs service"))
        elif pending:
            out.append(Finding("row-remap", who, "a row remapping is pending: reset the GPU (or reboot the node) to apply it"))
    if g.get("retired_pages_pending"):
        out.append(Finding("retired-pages", who, "pages are pending retirement: reset the GPU (or reboot the node) to "
                                                 "retire them"))
    links = g.get("nvlink") or []
    down = [i for i, s in enumerate(links) if not s]
    if down and len(down) < len(links):
        out.append(Finding("nvlink", who, f"NVLink link(s) {', '.join(map(str, down))} inactive "
                                          f"({len(links) - len(down)} of {len(links)} active)"))
    out += _throttle(g, who)
    temp, slowdown = g.get("temperature"), g.get("slowdown")
    if temp is not None and slowdown and temp >= slowdown:
        out.append(Finding("temperature", who, f"{temp} C, at or over its slowdown threshold {slowdown} C"))
    return out


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit] + ([f"0x{mask & ~sum(REASONS):x}"] if mask & ~sum(REASONS) else [])


def _throttle(g: dict[str, Any], who: str) -> list[Finding]:
    out = []
    mask = g.get("reasons")
    if mask is not None and mask & ~BENIGN_REASONS:
        out.append(Finding("throttle", who, f"clocks held down: {', '.join(reason_names(mask & ~BENIGN_REASONS))} "
                                            f"(clock event reasons 0x{mask:x})"))
    clocks = g.get("app_clocks")
    if clocks and clocks[0] < clocks[1]:
        out.append(Finding("throttle", who, f"applications clocks set to {clocks[0]} MHz (SM), below the default "
                                            f"{clocks[1]} MHz: `nvidia-smi -rac` resets them"))
    return out


def notes(g: dict[str, Any]) -> list[str]:
    """What was read but is no fault: the application's Xids, a GPU whose links are all inactive."""
    out = [f"Xid {x['xid']} ({x['source']}): {APP_XIDS[x['xid']]}, caused by an application; not counted"
           for x in g.get("xid", []) if x["xid"] in APP_XIDS]
    links = g.get("nvlink") or []
    if links and not any(links):
        out.append(f"no NVLink link active of {len(links)} (no bridge or NVSwitch fabric): not counted")
    return out


def summary(gpus: list[dict[str, Any]], source: str) -> dict[str, Any]:
    """The report's record: each GPU's facts, its findings and notes."""
    return {"source": source, "gpus": [{**g, "findings": [asdict(f) for f in findings(g)], "notes": notes(g)}
                                       for g in gpus]}


def main(argv: list[str] | None = None) -> int:
    """The checks alone, for the GPU bundle (gpucheck.py): lines on stderr, the JSON to --out;
    exit 1 where a check failed, 2 where no GPU could be read."""
    p = argparse.ArgumentParser(prog="pytorch_cuda_runtime.preflight.health")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    host = os.uname().nodename.split(".")[0]
    gpus, source = read(dict(os.environ), host)
    if gpus is None:
        print(f"health: no GPU read: {source}", file=sys.stderr)
        return 2
    record = summary(gpus, source)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    fails, _ = split([Finding(**f) for g in record["gpus"] for f in g["findings"]], frozenset())
    for line in fails:
        print(f"health: FAILED: {line}", file=sys.stderr)
    print(f"health: {len(gpus)} GPU(s) read through {source}; {len(fails)} finding(s)", file=sys.stderr)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

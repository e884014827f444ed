"""What GPM costs the exporter per GPU per read, on the fake libnvidia-ml (tests/fakenvml).

Through the real pynvml path: ``GpmReader`` reading 8 H100s that answer GPM (one
``nvmlGpmSampleGet`` and one ``nvmlGpmMetricsGet`` per GPU and read, and the exporter's own
work around them), timed in-process over many reads; and one whole sample of those 8 GPUs
with GPM due against one without. The driver's own time is not in it: on a real H100
``nvmlGpmSampleGet`` takes 0.6-0.7 ms and ``nvmlGpmMetricsGet`` (11 metrics) 4.4-5.4 ms
(docs/real-gpu.md). Run from the repository root::

    .venv/bin/python bench/gpm_cost.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import fakenvml  # noqa: E402
from fakenvml import FakeGpu  # noqa: E402

GPUS, READS = 8, 2000
H100_GPM = {1: 97.0, 2: 96.0, 3: 14.0, 5: 93.0, 6: 0.0, 7: 93.0, 9: 0.0, 10: 25.0, 11: 0.0}
H100_GPM |= {12: 0.0, 13: 0.0, 20: 12.5, 21: 300.0, 60: 0.0, 61: 0.0}

CHILD = """
import json, time
from gpu_exporter.collect.gpm import GpmReader
from gpu_exporter.collect.read import read_gpu
from gpu_exporter.nvml import Nvml
n = Nvml(); n.init()
handles = [n.handle(i) for i in range(GPUS)]
uuids = [n.uuid(h) for h in handles]
g = GpmReader(interval_seconds=0.0)
for i, h in enumerate(handles):
    g.read(n, i, h, uuids[i], (), 0.0)  # support, buffers, the first sample
t0 = time.perf_counter(); c0 = time.process_time()
for k in range(READS):
    for i, h in enumerate(handles):
        g.read(n, i, h, uuids[i], (), float(k + 1))
wall = (time.perf_counter() - t0) / READS / GPUS; cpu = (time.process_time() - c0) / READS / GPUS

identities = {"due": {}, "between": {}, "off": {}}
unsupported = set()

def sample(gpm, now, mode):
    # one sample of every GPU as the sampler takes it between two slow reads
    ids = identities[mode]
    t = time.perf_counter()
    for i in range(GPUS):
        _, ids[i] = read_gpu(n, i, ids.get(i), unsupported, gpm=gpm, now=now,
                             slow_due=i not in ids)
    return time.perf_counter() - t

kept = GpmReader(interval_seconds=1e9)  # read once, then its values kept: not due
for i, h in enumerate(handles):
    kept.read(n, i, h, uuids[i], (), 0.0)
    kept.read(n, i, h, uuids[i], (), 2e9)
due, between, off = [], [], []
for k in range(300):
    due.append(sample(g, 1e6 + k, "due"))  # GPM due at every call (interval 0)
    between.append(sample(kept, 2e9 + k, "between"))  # a sample between two GPM reads
    off.append(sample(None, 0.0, "off"))
for times in (due, between, off):
    times.sort()
print(json.dumps({
    "gpm_read_per_gpu_us": round(wall * 1e6, 1),
    "gpm_read_per_gpu_cpu_us": round(cpu * 1e6, 1),
    "sample_8_gpus_ms_gpm_due": round(due[len(due) // 2] * 1e3, 3),
    "sample_8_gpus_ms_between_gpm_reads": round(between[len(between) // 2] * 1e3, 3),
    "sample_8_gpus_ms_no_gpm": round(off[len(off) // 2] * 1e3, 3),
}))
"""


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="gpm-cost-") as tmp:
        lib = fakenvml.build(Path(tmp) / "lib")
        config = Path(tmp) / "gpus.conf"
        gpu = FakeGpu(name="NVIDIA H100 80GB HBM3", gpm=H100_GPM)
        fakenvml.write_config(config, [gpu] * GPUS)
        env = fakenvml.environment(lib, config)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        code = f"GPUS, READS = {GPUS}, {READS}\n" + CHILD
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return 1
        print(json.dumps({"gpus": GPUS, "reads": READS, **json.loads(out.stdout)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every Python snippet of docs/frameworks.md, run as written against a real exporter.

The exporter serves simulated GPUs, which no real framework can see, so the snippets always
run with the stand-in ``torch``/``tensorflow``/``jax`` of tests/standins first on the path:
small modules that follow the real rules the page is about (the mask is read once, at CUDA
initialisation; framework-level selection indexes the visible cards; TF refuses changes
after initialisation).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_exporter.simulate import DEFAULT_MODEL, Load, SimGpu, SimulatedNvml
from harness import free_port
from served import Served, served

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "frameworks.md"
STANDINS = Path(__file__).resolve().parent / "standins"


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)


@pytest.fixture(scope="module")
def exporter() -> Iterator[Served]:
    idle = [SimGpu(i, DEFAULT_MODEL, Load("idle")) for i in range(4)]
    with served(SimulatedNvml(idle, clock=time.monotonic)) as ex:
        yield ex


def _run(code: str, url: str) -> subprocess.CompletedProcess[str]:
    masks = (
        "CUDA_",
        "GPU_",
        "SLURM_",
        "NVIDIA_VISIBLE_DEVICES",
    )  # a launcher's, test_allocation.py
    env = {k: v for k, v in os.environ.items() if not k.startswith(masks)}
    env.update(GPU_EXPORTER_URL=url, PYTHONPATH=str(STANDINS))
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_the_page_is_linked_from_the_readme() -> None:
    assert "(docs/frameworks.md)" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("index", range(len(_snippets())))
def test_snippet_runs(exporter: Served, index: int) -> None:
    code = _snippets()[index]
    result = _run(code, exporter.url)
    assert result.returncode == 0, f"snippet {index}:\n{code}\n{result.stderr}"
    assert exporter.leases() == []  # every block released its GPUs


def test_cpu_snippet_runs_where_no_gpu_can_be_had() -> None:
    (code,) = [s for s in _snippets() if 'on_unavailable="cpu"' in s]
    result = _run(code, f"http://127.0.0.1:{free_port()}")  # no server, no driver here
    assert result.returncode == 0, result.stderr
    if "running on the CPU" in result.stderr:  # a machine with a driver chooses locally
        assert result.stdout.split() == ["no", "GPU", "cpu"]


def test_the_standins_keep_the_rules_the_page_describes(exporter: Served) -> None:
    """A snippet that broke a rule would fail against them: check they do enforce them."""
    wrong = [
        # indexing the host's list instead of the visible one
        "from gpu_exporter import use_gpus\nwith use_gpus(2):\n import tensorflow as tf\n"
        " tf.config.set_visible_devices(tf.config.list_physical_devices('GPU')[3], 'GPU')",
        # CUDA initialised before the block: the mask is ignored
        "import torch\ntorch.cuda.device_count()\nfrom gpu_exporter import use_gpus\n"
        "with use_gpus(2):\n assert torch.cuda.device_count() == 2",
        # memory growth after initialisation
        "from gpu_exporter import use_gpus\nwith use_gpus(1):\n import tensorflow as tf\n"
        " tf.distribute.MirroredStrategy()\n"
        " tf.config.experimental.set_memory_growth(tf.config.list_physical_devices('GPU')[0], True)",
        # memory growth on a device capped with a logical device (apply_tensorflow's rule)
        "from gpu_exporter import use_gpus\n"
        "with use_gpus(1, mem='8GiB', framework='tensorflow'):\n import tensorflow as tf\n"
        " tf.config.experimental.set_memory_growth(tf.config.list_physical_devices('GPU')[0], True)",
        # capping TensorFlow after its devices were initialised
        "from gpu_exporter import use_gpus\nimport tensorflow as tf\n"
        "tf.config.list_logical_devices()\n"
        "with use_gpus(1, mem='8GiB', framework='tensorflow'):\n pass",
        # a fraction outside 0-1
        "import torch\ntorch.cuda.set_per_process_memory_fraction(1.5, 0)",
    ]
    for code in wrong:
        assert _run(code, exporter.url).returncode != 0, code

"""``--kubernetes``: the kubelet's PodResources answer → ``gpu_pod_info``, ``/choose``'s taken
GPUs and ``gpu_exporter_kubernetes_up``, against a fake kubelet (a real grpcio server on a Unix
socket, tests/fakekubelet.py) and the real exporter over HTTP."""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import build_stack, fake_proc, sim_of
from fakekubelet import FakeKubelet, encode_list_response, fake_kubelet
from gpu_exporter.cli import _serve_config, build_parser
from gpu_exporter.collect.kubelet import ListError, PodResourcesPoller
from gpu_exporter.collect.podresources import DecodeError, decode_list_response
from gpu_exporter.config import DEFAULT_KUBELET_SOCKET
from gpu_exporter.podallocations import (
    PodAllocations,
    PodDevice,
    physical_id,
    resolve,
    taken_reasons,
)
from gpu_exporter.simulate import DEFAULT_MODEL, Load, Scenario, SimGpu, SimulatedNvml
from harness import exporter, get
from served import Served, served

POLL = 0.1


def lab() -> SimulatedNvml:
    """8 GPUs; GPU 3 is split into 4 MIG devices (simulate/scenarios/lab.toml)."""
    return SimulatedNvml.of(Scenario.from_argument("lab"), clock=time.monotonic)


def metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    status, body = get(url + "/metrics")
    assert status == 200
    return {
        f.name: [(s.labels, s.value) for s in f.samples]
        for f in text_string_to_metric_families(body)
    }


def pod_info(url: str) -> set[tuple[str, str, str, str, str]]:
    return {
        (s["gpu"], s["uuid"], s["namespace"], s["pod"], s["container"])
        for s, value in metrics(url).get("gpu_pod_info", [])
        if value == 1
    }


def kubernetes_up(url: str) -> float | None:
    found = metrics(url).get("gpu_exporter_kubernetes_up")
    return found[0][1] if found else None


def choose(url: str, query: str) -> tuple[int, Any]:
    import json

    try:
        with urllib.request.urlopen(f"{url}/choose?{query}&format=json", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("not within {timeout} s")
        time.sleep(0.05)


# -- the pure parts ------------------------------------------------------------------------------


def test_the_list_answer_decodes_to_devices_and_skips_what_it_does_not_read() -> None:
    data = encode_list_response(
        [
            ("ml", "train", [("trainer", [("nvidia.com/gpu", ["GPU-a", "GPU-b"])])]),
            ("default", "web", [("nginx", [])]),  # no GPU limit: no devices
            ("ml", "two", [("a", [("nvidia.com/gpu", ["GPU-c::1"])]), ("b", [])]),
        ],
        cpu_ids=(3, 300),  # a varint field inside a packed field the decoder skips
    )
    assert decode_list_response(data) == [
        PodDevice("ml", "train", "trainer", "nvidia.com/gpu", "GPU-a"),
        PodDevice("ml", "train", "trainer", "nvidia.com/gpu", "GPU-b"),
        PodDevice("ml", "two", "a", "nvidia.com/gpu", "GPU-c::1"),
    ]
    assert decode_list_response(b"") == []
    # unknown fields of every wire type are skipped: varint, fixed64, fixed32
    assert decode_list_response(b"\x10\x05\x19" + b"\0" * 8 + b"\x25" + b"\0" * 4) == []
    for garbage in (b"\x0a\x05ab", b"\xff", b"\x0b", b"\x0a\x02\x08\x01\x0a\x01\x0a"):
        with pytest.raises(DecodeError):
            decode_list_response(garbage)


def test_device_ids_name_cards_mig_devices_and_replicas_and_nothing_else() -> None:
    stack = build_stack(
        lambda clock: SimulatedNvml.of(Scenario.from_argument("lab"), clock=clock.monotonic)
    )
    gpus = stack.sample().gpus
    mig = gpus[3].mig_devices[1].uuid
    devices = [
        PodDevice("a", "whole", "c", "nvidia.com/gpu", gpus[0].uuid),
        PodDevice("a", "replica", "c", "nvidia.com/gpu.shared", gpus[1].uuid + "::7"),
        PodDevice("a", "mig", "c", "nvidia.com/mig-1g.10gb", mig),
        PodDevice("a", "index", "c", "nvidia.com/gpu", "5"),
        PodDevice("a", "elsewhere", "c", "nvidia.com/gpu", "GPU-not-here"),
        PodDevice("a", "nic", "c", "example.com/sriov", "0"),  # not a GPU: "0" is no index
    ]
    resolved = {d.pod: (g.uuid if g else None) for g, d in resolve(devices, gpus)}
    assert resolved == {
        "whole": gpus[0].uuid,
        "replica": gpus[1].uuid,
        "mig": mig,
        "index": gpus[5].uuid,
        "elsewhere": None,
    }
    assert physical_id("MIG-x::2") == "MIG-x"
    assert taken_reasons(devices, gpus)[gpus[0].uuid] == "allocated to pod a/whole"


# -- the real exporter against a fake kubelet ----------------------------------------------------


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    with fake_kubelet() as kube:
        yield kube


@pytest.fixture
def node(kubelet: FakeKubelet) -> Iterator[Served]:
    with served(
        lab(),
        kubernetes_socket=kubelet.socket_path,
        kubernetes_poll_seconds=POLL,
        choose_defaults="",  # every idle or busy card qualifies: only pods take them
    ) as s:
        yield s


def allocate(kubelet: FakeKubelet, s: Served) -> dict[str, str]:
    """A node's pods: a whole card, a MIG device, a card time-sliced by two pods, a pod
    without a GPU limit. Returns the UUIDs used."""
    gpus = s.daemon.cache.get().gpus
    ids = {
        "whole": gpus[0].uuid,
        "shared": gpus[2].uuid,
        "mig": gpus[3].mig_devices[2].uuid,
    }
    kubelet.pods = [
        ("ml", "train", [("trainer", [("nvidia.com/gpu", [ids["whole"]])])]),
        ("ml", "infer", [("server", [("nvidia.com/mig-1g.10gb", [ids["mig"]])])]),
        ("team-a", "nb1", [("jupyter", [("nvidia.com/gpu", [ids["shared"] + "::0"])])]),
        # two replicas of one card in one container: still one series
        (
            "team-b",
            "nb2",
            [("jupyter", [("nvidia.com/gpu", [f"{ids['shared']}::{i}" for i in (1, 2)])])],
        ),
        ("default", "web", [("nginx", [])]),
    ]
    return ids


def test_pods_get_info_series_and_their_gpus_are_taken(node: Served, kubelet: FakeKubelet) -> None:
    ids = allocate(kubelet, node)
    expected = {
        ("0", ids["whole"], "ml", "train", "trainer"),
        ("3", ids["mig"], "ml", "infer", "server"),
        ("2", ids["shared"], "team-a", "nb1", "jupyter"),
        ("2", ids["shared"], "team-b", "nb2", "jupyter"),
    }
    eventually(lambda: pod_info(node.url) == expected)
    assert kubernetes_up(node.url) == 1
    # The value series carry no pod labels: join on uuid instead.
    found = metrics(node.url)
    assert all("pod" not in labels for labels, _ in found["gpu_memory_used_bytes"])

    # /choose: every whole card but the two pods' (and the MIG-mode one) is handed out ...
    status, body = choose(node.url, "n=8")
    assert status == 503, body
    message = body["error"]["message"]
    assert "gpu 0: allocated to pod ml/train" in message
    assert "gpu 2: allocated to pods team-a/nb1, team-b/nb2" in message
    status, body = choose(node.url, "n=5&lease=1m")
    assert status == 200, body
    chosen = {g["index"] for g in body["chosen"]}
    assert chosen.isdisjoint({0, 2, 3}), chosen  # the pod without a GPU limit took nothing
    # ... and advice (lease=0) never names a pod's card either
    status, body = choose(node.url, "n=3&lease=0")
    assert status == 503 and "allocated to pod ml/train" in body["error"]["message"]
    # MIG devices: the pod's one is passed over with the reason
    status, body = choose(node.url, "n=3&mig=only&lease=0")
    assert status == 200, body
    assert ids["mig"] not in {g["uuid"] for g in body["chosen"]}
    rejected = {g["uuid"]: g["reasons"] for g in body["rejected"]}
    assert rejected[ids["mig"]] == ["allocated to pod ml/infer"], body

    # A pod that ends frees its card at the next poll.
    kubelet.pods = kubelet.pods[1:]
    eventually(lambda: not any(p[3] == "train" for p in pod_info(node.url)))
    status, body = choose(node.url, f"n=1&lease=0&include={ids['whole']}")
    assert status == 200, body


def test_the_kubelet_going_away_and_coming_back(
    node: Served, kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    ids = allocate(kubelet, node)
    eventually(lambda: kubernetes_up(node.url) == 1 and len(pod_info(node.url)) == 4)
    caplog.set_level(logging.INFO, "gpu_exporter.collect.kubelet")
    calls = kubelet.calls
    kubelet.stop()
    eventually(lambda: kubernetes_up(node.url) == 0)
    time.sleep(10 * POLL)  # ten more failed polls
    # Everything else keeps working; the last answer is kept (a restarting kubelet frees no
    # card), so a job script still never lands on a pod's GPU.
    assert len(pod_info(node.url)) == 4
    assert get(node.url + "/readyz")[0] == 200
    status, body = choose(node.url, f"n=1&lease=0&include={ids['whole']}")
    assert status == 503 and "allocated to pod ml/train" in body["error"]["message"]
    down = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(down) == 1, [r.getMessage() for r in down]  # once per change, not every poll
    assert "kubernetes_up is 0" in down[0].getMessage()

    kubelet.pods = []
    kubelet.start()
    eventually(lambda: kubernetes_up(node.url) == 1)
    eventually(lambda: pod_info(node.url) == set())
    assert kubelet.calls > calls
    back = [r for r in caplog.records if r.levelno == logging.INFO and "answers" in r.getMessage()]
    assert len(back) == 1
    status, body = choose(node.url, f"n=1&lease=0&include={ids['whole']}")
    assert status == 200, body


def test_a_kubelet_that_stops_warns_once_however_its_failure_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A stopping kubelet first cancels the call (UNAVAILABLE), then its socket is gone: one
    # fall, one warning; the changed reason is logged at info, and a repeat says nothing.
    answers: list[Callable[[], bytes]] = []

    def fail(why: str) -> Callable[[], bytes]:
        def lister() -> bytes:
            raise ListError(why)

        return lister

    poller = PodResourcesPoller("/k.sock", PodAllocations(), lister=lambda: answers.pop(0)())
    caplog.set_level(logging.INFO, "gpu_exporter.collect.kubelet")
    answers += [lambda: encode_list_response([]), fail("UNAVAILABLE: Cancelling all calls")]
    answers += [fail("no socket at /k.sock"), fail("no socket at /k.sock")]
    assert [poller.poll_once() for _ in range(4)] == [True, False, False, False]
    levels = [(r.levelno, r.getMessage().split(": ")[1]) for r in caplog.records]
    assert levels == [
        (logging.INFO, "0 devices allocated to 0 pods"),
        (logging.WARNING, "UNAVAILABLE"),
        (
            logging.INFO,
            "no socket at /k.sock; gpu_exporter_kubernetes_up is 0, the last answer "
            "is kept (asking again every 10 s)",
        ),
    ], levels


def test_a_kubelet_that_answers_too_late_is_down_until_it_answers_in_time(
    node: Served, kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    eventually(lambda: kubernetes_up(node.url) == 1)
    caplog.set_level(logging.WARNING, "gpu_exporter.collect.kubelet")
    kubelet.delay_seconds = 5 * POLL  # the deadline is the poll interval here (5 s at most)
    eventually(lambda: kubernetes_up(node.url) == 0)
    assert "DEADLINE_EXCEEDED" in caplog.text
    assert get(node.url + "/readyz")[0] == 200  # a slow kubelet holds up nothing else
    kubelet.delay_seconds = 0
    eventually(lambda: kubernetes_up(node.url) == 1)


def test_without_the_flag_there_is_no_kubernetes_series() -> None:
    with served(lab()) as s:
        found = metrics(s.url)
    assert "gpu_exporter_kubernetes_up" not in found and "gpu_pod_info" not in found


def test_the_flag_takes_the_kubelet_default_or_a_socket() -> None:
    def config(*args: str) -> Any:
        parser = build_parser()
        return _serve_config(parser.parse_args(["serve", *args]), parser)

    assert config().kubernetes_socket is None
    assert config("--kubernetes").kubernetes_socket == DEFAULT_KUBELET_SOCKET
    assert config("--kubernetes=/run/k.sock").kubernetes_socket == "/run/k.sock"
    assert config("--kubernetes", "--interval", "2").kubernetes_socket == DEFAULT_KUBELET_SOCKET
    assert config().kubernetes_poll_seconds == 10.0
    for value, socket in (("true", DEFAULT_KUBELET_SOCKET), ("/k.sock", "/k.sock"), ("0", None)):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("GPU_EXPORTER_KUBERNETES", value)
            assert config().kubernetes_socket == socket, value


@pytest.mark.slow
def test_gpu_exporter_serve_with_kubernetes(kubelet: FakeKubelet, tmp_path: Any) -> None:
    """The command line end to end: a socket missing at start is kubernetes_up 0 and nothing
    else is hurt; once the kubelet answers, its pods show."""
    gpus = lab()
    kubelet.pods = [("ml", "train", [("trainer", [("nvidia.com/gpu", [gpus.gpus[2].uuid])])])]
    kubelet.stop()
    with exporter(
        "--simulate",
        "lab",
        f"--kubernetes={kubelet.socket_path}",
        "--kubernetes.poll-interval",
        str(POLL),
        "--interval",
        "0.2",
    ) as ex:
        eventually(lambda: kubernetes_up(ex.base) == 0)
        assert "gpu_memory_used_bytes" in metrics(ex.base)
        kubelet.start()
        eventually(lambda: kubernetes_up(ex.base) == 1)
        assert pod_info(ex.base) == {("2", gpus.gpus[2].uuid, "ml", "train", "trainer")}
        status, body = get(ex.base + f"/choose?n=1&lease=0&include={gpus.gpus[2].uuid}")
        assert status == 503 and "allocated to pod ml/train" in body, body


# -- process names: cgroup pod UIDs and container ids named through the allocations ------------

UID = {p: f"{i}0000000-aaaa-bbbb-cccc-dddddddddddd" for i, p in enumerate("ABCD", start=1)}
CONTAINER = {p: f"{i}" * 64 for i, p in enumerate("ABCD", start=1)}


def pod_cgroup(pod: str) -> str:
    """A cgroup v2 path as the systemd driver writes it, with the pod UID and container id."""
    uid = UID[pod].replace("-", "_")
    return (
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid}.slice/"
        f"cri-containerd-{CONTAINER[pod]}.scope\n"
    )


def test_process_pods_are_named_where_the_allocations_pin_them_down(
    kubelet: FakeKubelet, tmp_path: Any
) -> None:
    """Card 0: pod a alone. Card 1: time-sliced by b and c. Card 2: b alone. Card 3: d's card,
    but the process on it is c's (a misplaced process: c also runs on card 1, so the two
    contradict each other). Card 4: no pod's, a process of a pod without a GPU limit."""
    pids = {0: (7000,), 1: (7100, 7101), 2: (7200,), 3: (7300,), 4: (7400,)}
    owner = {7000: "A", 7100: "B", 7101: "C", 7200: "B", 7300: "C", 7400: "D"}
    gpus = [
        SimGpu(
            i,
            DEFAULT_MODEL,
            Load("constant", utilization=0.5, memory_used_ratio=0.5, processes=len(p), pids=p),
        )
        for i, p in pids.items()
    ]
    for pid, pod in owner.items():
        fake_proc(tmp_path, pid, cgroup=pod_cgroup(pod))
    stack = build_stack(
        sim_of(*gpus),
        kubernetes_socket=kubelet.socket_path,
        proc_root=str(tmp_path),
        process_labels=("container", "pod"),
    )
    uuids = [g.uuid for g in stack.sim.gpus]
    kubelet.pods = [
        ("ns", "a", [("main", [("nvidia.com/gpu", [uuids[0]])])]),
        ("ns", "b", [("main", [("nvidia.com/gpu", [uuids[1] + "::0", uuids[2]])])]),
        ("ns", "c", [("side", [("nvidia.com/gpu", [uuids[1] + "::1"])])]),
        ("ns", "d", [("main", [("nvidia.com/gpu", [uuids[3]])])]),
    ]
    (poller,) = [t for t in stack.daemon.background if hasattr(t, "poll_once")]
    assert poller.poll_once()
    stack.sample()
    text = generate_latest(stack.registry).decode()
    found = {
        (s.labels["pid"], s.labels["namespace"], s.labels["pod"], s.labels["container"])
        for f in text_string_to_metric_families(text)
        if f.name == "gpu_process_pod_info"
        for s in f.samples
    }
    # A and B from their own cards; C by elimination on the shared card 1 - then contradicted
    # by its process on D's card 3, so C is named nowhere and D (never seen) neither.
    assert found == {
        ("7000", "ns", "a", "main"),
        ("7100", "ns", "b", "main"),
        ("7200", "ns", "b", "main"),
    }
    # The value series keep their cgroup labels (UID, container id); the join names them.
    assert stack.value(
        "gpu_process_memory_used_bytes", 0, pid="7000", pod=UID["A"], container=CONTAINER["A"]
    )


def test_inference_by_elimination_and_withdrawal() -> None:
    from gpu_exporter.podallocations import _infer

    a, b, c = ("ns", "a"), ("ns", "b"), ("ns", "c")
    # b's own card names uid-b; the shared card then leaves c for uid-c.
    assert _infer([({b, c}, {"ub", "uc"}), ({b}, {"ub"})]) == {"ub": b, "uc": c}
    # Two unknown processes on a card one pod holds: neither is named.
    assert _infer([({a}, {"u1", "u2"})]) == {}
    # A name another card contradicts is withdrawn, and what followed from it too.
    assert _infer([({a}, {"ua"}), ({b}, {"ua"})]) == {}

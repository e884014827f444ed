"""Candidate servers under hostile clients: the attack of issue 14 against each of them.

The candidates are not the project's dependencies; install them into an environment of their
own, never into ``.venv``::

    python3 -m venv bench/.venv-servers
    bench/.venv-servers/bin/pip install -e . waitress uvicorn a2wsgi hypercorn granian cryptography
    bench/.venv-servers/bin/python bench/candidates.py            # plain HTTP, then TLS
    bench/.venv-servers/bin/python bench/candidates.py --servers gpu-exporter,uvicorn --repeat 1

Each server runs the real app as ``bench/servers.py`` runs it (``--serve NAME``: 8 simulated
GPUs, the sampler, 16 request threads or a pool of 16 for the WSGI app) in a subprocess on a
free loopback port. Then ``bench/hostile.py`` attacks it — 200 slowloris + 200 idle
connections, and with ``--tls`` (a certificate made here with ``cryptography``) 100 more that
never start the handshake — while a scraper fetches ``/metrics`` and ``/healthz`` every
100 ms and a job calls ``/choose?lease=0`` every 100 ms. Recorded: the good clients' errors
and p50/p99/max, a baseline of the same clients without the attack, and how long the server
takes to exit after SIGTERM with the attack still running (the bench's own SIGTERM handler
for gpu-exporter, cheroot and waitress; the server's own for the others). JSON goes to
``bench/results/candidates.json`` and a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import hostile  # noqa: E402
import servers  # noqa: E402

CANDIDATES = (
    "gpu-exporter",
    "cheroot",
    "waitress",
    "waitress-1024",
    "uvicorn",
    "hypercorn",
    "granian",
)
NO_TLS = {"waitress", "waitress-1024"}  # waitress has no TLS at all
ATTACK = hostile.Attack(slowloris=200, idle=200)
TLS_ATTACK = hostile.Attack(slowloris=200, idle=200, tls_silent=100)
VERSIONED = (
    "gpu-exporter",
    "cheroot",
    "waitress",
    "uvicorn",
    "a2wsgi",
    "hypercorn",
    "granian",
    "h11",
)


def make_certificate(directory: Path) -> tuple[Path, Path, Path]:
    """(CA, server certificate, key) for 127.0.0.1, made with tests/tls_certs.py."""
    from tls_certs import CA

    ca = CA.create(directory, "bench-ca")
    issued = ca.issue(directory, "bench-server", server=True)
    return ca.path, issued.cert, issued.key


def wait_ready(proc: subprocess.Popen[Any], target: hostile.Target, timeout: float) -> float:
    started = time.monotonic()
    scheme = "https" if target.tls else "http"
    ctx = ssl.create_default_context(cafile=target.ca_file) if target.tls else None
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with status {proc.returncode}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(
                f"{scheme}://127.0.0.1:{target.port}/readyz", timeout=1, context=ctx
            ) as resp,
        ):
            if resp.status == 200:
                return time.monotonic() - started
        time.sleep(0.1)
    raise RuntimeError(f"not ready after {timeout:g} s")


def one(name: str, tls: tuple[Path, Path, Path] | None, seconds: float) -> dict[str, Any]:
    env_before = dict(os.environ)
    if tls:
        os.environ["BENCH_TLS_CERT"], os.environ["BENCH_TLS_KEY"] = str(tls[1]), str(tls[2])
    else:
        os.environ.pop("BENCH_TLS_CERT", None)
        os.environ.pop("BENCH_TLS_KEY", None)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    server = servers.ServerProcess(name, servers.free_port(), "")
    os.environ.clear()
    os.environ.update(env_before)
    target = hostile.Target(server.port, tls=tls is not None, ca_file=str(tls[0]) if tls else None)
    attack = TLS_ATTACK if tls else ATTACK
    result: dict[str, Any] = {"server": name, "tls": tls is not None, "attack": attack.__dict__}
    try:
        result["ready_seconds"] = round(wait_ready(server.proc, target, 30), 2)
        result["processes"] = len(servers._tree(server.proc.pid))
        result["rss_mib"] = servers._rss_mib(server.proc.pid)
        result["baseline"] = hostile.GoodClients(target).run(3.0)
        with hostile.attacking(target, attack) as attack_stats:
            time.sleep(2.0)
            result["under_attack"] = hostile.GoodClients(target).run(seconds)
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(10)
                result["sigterm_exit_seconds"] = round(time.monotonic() - started, 2)
            except subprocess.TimeoutExpired:
                result["sigterm_exit_seconds"] = None  # still running after 10 s
        result["attack_stats"] = attack_stats
        result["worst"] = hostile.worst({"good": result["under_attack"]})
    except RuntimeError as exc:
        result["failed"] = f"{exc}: {server.output()[-1500:]}"
    finally:
        server.stop()
    return result


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for dist in VERSIONED:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def _f(v: Any) -> str:
    return "–" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| server | TLS | run | good requests | errors | p50 / p99 / max ms under attack "
        "| p99 ms, no attack | SIGTERM under attack: exit s |",
        "|---|---|--:|--:|--:|---|--:|---|",
    ]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['server']} | {'yes' if r['tls'] else 'no'} | {r['run']} "
                         f"| failed: {r['failed'][:80]} | | | | |")  # fmt: skip
            continue
        w = r["worst"]
        p50 = max((g["p50_ms"] or 0.0) for g in r["under_attack"].values())
        base = max((g["p99_ms"] or 0.0) for g in r["baseline"].values())
        errors = sum(g["errors"] for g in r["under_attack"].values())
        kinds: dict[str, int] = {}
        for g in r["under_attack"].values():
            for k, n in g["error_kinds"].items():
                kinds[k] = kinds.get(k, 0) + n
        exit_s = r["sigterm_exit_seconds"]
        lines.append(
            f"| {r['server']} | {'yes' if r['tls'] else 'no'} | {r['run']} | {w['requests']} "
            f"| {errors}{' ' + json.dumps(kinds) if kinds else ''} "
            f"| {_f(p50)} / {_f(w['p99_ms'])} / {_f(w['max_ms'])} | {_f(base)} "
            f"| {'still running after 10' if exit_s is None else _f(exit_s)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--servers", default=",".join(CANDIDATES))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--modes", default="plain,tls", help="plain, tls or both")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "candidates.json")
    args = parser.parse_args(argv)
    hostile.raise_fd_limit()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cert = make_certificate(Path(tmp))
        for run in range(1, args.repeat + 1):
            for mode in args.modes.split(","):
                for name in args.servers.split(","):
                    if mode == "tls" and name in NO_TLS:
                        continue
                    servers._log(f"{name} {mode} run {run}")
                    r = one(name, cert if mode == "tls" else None, args.seconds)
                    r["run"] = run
                    results.append(r)
        busy = {}
        for name in args.servers.split(","):
            servers._log(f"{name}: port in use")
            busy[name] = servers.busy_port(name, "", 15.0)
    report = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "cpu": servers.cpu_model(),
            "versions": versions(),
            "seconds": args.seconds,
        },
        "results": results,
        "busy_port": busy,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(sorted(results, key=lambda r: (r["tls"], r["server"], r["run"]))))
    print("\n| server | processes | RSS MiB | port in use: exits after s (rc), last line |")
    print("|---|--:|--:|---|")
    for name, b in busy.items():
        first = next((r for r in results if r["server"] == name and "processes" in r), {})
        exit_s = "still running" if b["exit_seconds"] is None else f"{b['exit_seconds']:g}"
        print(
            f"| {name} | {first.get('processes')} | {first.get('rss_mib')} "
            f"| {exit_s} ({b['returncode']}), {b['output_lines']} lines: {b['message'][:90]} |"
        )
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

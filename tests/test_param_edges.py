"""Numbers a careless or hostile client sends: Unicode digits, hundreds of digits, huge exponents.

``n=²`` and ``min_free`` of 400 digits once answered 500 with a traceback (``int("²")`` raises,
``int(float("9" * 400))`` overflows). Every numeric parameter now takes ASCII digits only and
bounded values, and says what is wrong in a 400 of the error contract; the property tests
below hold every parser to "a value or a refusal, never another exception".
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpu_exporter.choose.params import BY_NAME, PARAMS
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import parse_choose_args, parse_cluster_args
from gpu_exporter.choose.selectors import selector_matches
from gpu_exporter.model import GpuSample
from gpu_exporter.units import parse_bytes, parse_duration, parse_ratio
from served import Served, served


@pytest.fixture(scope="module")
def exporter() -> Any:
    with served() as s:
        yield s


def get(s: Served, path: str, *, method: str = "GET", data: bytes | None = None) -> tuple[int, str]:
    req = urllib.request.Request(s.url + path, method=method, data=data)
    req.add_header("Accept", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


HOSTILE = [
    ("n", "²"),  # superscript two: str.isdigit() and int() take it
    ("n", "٣"),  # Arabic-Indic three: int() reads it as 3
    ("n", "9" * 400),
    ("min_free", "9" * 400),  # int(float(...)) overflowed
    ("min_free", "1e999GiB"),
    ("min_free", "99999999999999999999TiB"),
    ("min_total", "9" * 400),
    ("max_util", "9" * 400 + "%"),
    ("max_procs", "²"),
    ("max_procs", "9" * 400),
    ("exclude", "²"),  # passed the reader, then int("²") failed while ranking
    ("include", "٣"),
    ("exclude", "9" * 400),
    ("wait", "9" * 400),
    ("lease", "9" * 400 + "h"),
    ("idle_for", "1" + "0" * 300 + "s"),
    ("pid", "²"),
    ("model", "x" * 1000),
]


@pytest.mark.parametrize(("name", "value"), HOSTILE)
def test_hostile_numbers_get_a_400_naming_the_parameter(
    exporter: Served, name: str, value: str
) -> None:
    query = urllib.parse.urlencode(
        {name: value, "lease": "0"} if name != "lease" else {name: value}
    )
    status, body = get(exporter, f"/choose?{query}")
    assert status == 400, body
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_parameter" and error["param"] == name
    assert (
        error["message"].startswith(name)
        and "Traceback" not in body
        and len(error["message"]) < 300
    )


def test_hostile_numbers_in_a_post_body_and_on_the_cluster_endpoint(exporter: Served) -> None:
    body = urllib.parse.urlencode({"n": "²", "lease": "0"}).encode()
    status, text = get(exporter, "/choose", method="POST", data=body)
    assert status == 400 and json.loads(text)["error"]["param"] == "n"
    # No fleet here (404 not_configured) — but the parameters are checked first.
    status, text = get(
        exporter, "/cluster/choose?" + urllib.parse.urlencode({"min_free": "9" * 400})
    )
    assert status == 400 and json.loads(text)["error"]["param"] == "min_free"


def test_renew_ttl_of_400_digits_is_a_400(exporter: Served) -> None:
    status, body = get(exporter, "/choose?n=1&format=json&max_util=100%25&max_mem_used=100%25")
    assert status == 200, body
    token = json.loads(body)["lease"]["token"]
    try:
        for ttl in ("9" * 400, "²", "1e999s"):
            data = urllib.parse.urlencode({"ttl": ttl}).encode()
            status, text = get(exporter, f"/leases/{token}/renew", method="POST", data=data)
            assert status == 400 and json.loads(text)["error"]["param"] == "ttl", text
    finally:
        get(exporter, f"/leases/{token}", method="DELETE")


def test_ascii_numbers_still_work(exporter: Served) -> None:
    status, body = get(exporter, "/choose?n=2&lease=0&min_free=1GiB&max_procs=3&exclude=0")
    assert status == 200, body


# -- every parser: a value or ValueError/ApiError, never anything else ------------------------

NUMBERISH = st.text(
    alphabet=st.sampled_from("0123456789.eE+-%²٣ \t\n") | st.characters(), max_size=60
) | st.builds(
    lambda digits, unit: digits + unit,
    st.text(alphabet="0123456789", min_size=1, max_size=500),
    st.sampled_from(["", "GiB", "TiB", "%", "s", "h", "ms", "e999", ".5"]),
)


@settings(max_examples=300, deadline=None)
@given(NUMBERISH)
@example("9" * 400)
@example("1" + "0" * 308 + "GiB")
def test_unit_parsers_give_a_value_or_valueerror(text: str) -> None:
    for parse in (parse_bytes, parse_ratio, parse_duration):
        try:
            value = parse(text)
        except ValueError as exc:
            message = str(exc)
        else:
            message = ""
            assert value == value and value >= 0 and value != float("inf")
        assert len(message) < 200


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(PARAMS), NUMBERISH)
@example(BY_NAME["min_free"], "9" * 400)
@example(BY_NAME["n"], "²")
def test_every_param_reader_gives_a_value_or_valueerror(param: Any, text: str) -> None:
    message = param.name
    try:
        param.parse(param.name, text)
    except ValueError as exc:
        message = str(exc)
    assert message.startswith(param.name)


GPU = GpuSample(index=3, uuid="GPU-5a1e0003-abcd", up=True, pci_bus_id="00000000:48:00.0")


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([p.name for p in PARAMS]), NUMBERISH | st.text(max_size=20), max_size=5
    )
)
@example({"exclude": "²"})
@example({"min_free": "9" * 400})
def test_parse_args_gives_a_request_or_apierror(args: dict[str, str]) -> None:
    for parse in (parse_choose_args, parse_cluster_args):
        try:
            req = parse(args)
        except ApiError as exc:
            refusal: ApiError | None = exc
        else:
            refusal = None
        if refusal is not None:
            assert refusal.status == 400 and refusal.param is not None
            continue
        filters = req.filters if hasattr(req, "filters") else req.choose.filters  # type: ignore[union-attr]
        for selector in (*filters.include, *filters.exclude):
            selector_matches(GPU, selector)  # never raises for what the parser let through


def test_a_fleet_series_with_a_unicode_gpu_label_is_passed_over() -> None:
    """A Prometheus answer is input too: gpu="²" once made int() fail in /cluster/choose."""
    from fleets import fleet_of, gpu, host_results

    good = gpu("a:9400", 0)
    odd = [
        {**s, "metric": {**s["metric"], "gpu": "²", "uuid": "GPU-odd"}} for s in gpu("a:9400", 1)
    ]
    fleet = fleet_of(host_results({"a:9400": [*good, *odd]}))
    (host,) = fleet.hosts
    assert [g.index for g in host.gpus] == [0]

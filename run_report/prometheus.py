"""The Prometheus HTTP API, the only way the report reads data: instant and range queries, series.

Queries go as form-encoded POSTs (long PromQL does not fit a URL) on one pooled session, so the
report can send them from a few threads at once. Every failure becomes a `PrometheusError` with one
line a user can act on: where Prometheus was not reachable, or what it answered.
"""

from __future__ import annotations

import queue
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import requests

from stepscope.contract import json_text

TIMEOUT_SECONDS = 60.0
T = TypeVar("T")


class PrometheusError(Exception):
    """Prometheus could not be reached or refused a request; the message is one line."""


@dataclass(frozen=True)
class Series:
    """One series of a query result: its labels and (unix seconds, value) points in time order."""

    labels: Mapping[str, str]
    points: tuple[tuple[float, float], ...]

    @property
    def last(self) -> float:
        return self.points[-1][1]


class Prometheus:
    def __init__(self, base_url: str, timeout: float = TIMEOUT_SECONDS) -> None:
        self.base_url = base_url.rstrip("/")
        self.shown_url = without_credentials(self.base_url)  # in messages: they end up in CI logs and tickets
        self._timeout = timeout
        self._session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=16)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)

    def query(self, expr: str, at: float) -> list[Series]:
        """An instant query evaluated at `at`; a range-vector result keeps every raw sample."""
        return self._call("query", {"query": expr, "time": _timestamp(at)}, _series)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        """Points at start, start + step, ... up to end, as asked. VictoriaMetrics moves start and end to
        multiples of the step (for its cache) unless told `nocache=1`, which Prometheus ignores: the run's
        search grids start at the range's own start, and an hour grid moved down missed a run's last hour."""
        return self._call(
            "query_range",
            {"query": expr, "start": _timestamp(start), "end": _timestamp(end), "step": f"{step:g}", "nocache": "1"},
            _series,
        )

    def series(self, match: str, start: float, end: float) -> list[dict[str, str]]:
        """Label sets of the series `match` selects in [start, end] (an index lookup, no samples read)."""
        return self._call("series", {"match[]": match, "start": _timestamp(start), "end": _timestamp(end)},
                          _label_sets)

    def _call(self, endpoint: str, form: dict[str, str], parse: Callable[[Any], T]) -> T:
        """`parse` of the API's `data`. A body that says success in another shape (a proxy's, another API's
        at that path) is a PrometheusError naming what was wrong, not a traceback from deep in the report."""
        url = f"{self.base_url}/api/v1/{endpoint}"
        try:
            response = answered_within(self._timeout,
                                       lambda: self._session.post(url, data=form, timeout=self._timeout))
        except requests.Timeout:
            raise PrometheusError(
                f"Prometheus at {self.shown_url} did not answer within {self._timeout:g}s{_LONG_QUERY}") from None
        except requests.RequestException as exc:
            raise PrometheusError(f"cannot reach Prometheus at {self.shown_url}: {_reason(exc)}") from None
        shown = f"{self.shown_url}/api/v1/{endpoint}"
        try:
            body = json_text.loads(response.content)
        except ValueError:
            raise PrometheusError(
                f"{shown} answered HTTP {response.status_code} without a Prometheus API response "
                "(is --prometheus the server's base URL?)"
            ) from None
        if not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error", "no error message") if isinstance(body, dict) else "unexpected body"
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else "no error message"
            hint = _LONG_QUERY if any(limit in first_line for limit in _QUERY_LIMITS) else ""
            raise PrometheusError(
                f"Prometheus refused a {endpoint} request (HTTP {response.status_code}): {first_line}{hint}"
            )
        try:
            return parse(body["data"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PrometheusError(
                f"{shown} answered success with data not in the Prometheus API's {endpoint} format "
                f"({type(exc).__name__}: {exc})"
            ) from None


# A run of hundreds of ranks over days asks a lot of the server: what to do when it is too much.
_LONG_QUERY = ("; a long or wide run's queries can take minutes: raise --timeout (and the server's --query.timeout, "
               "--query.max-samples), or report a part of the run with --from/--to")
_QUERY_LIMITS = ("query timed out", "too many samples", "exceeded maximum resolution")  # Prometheus' and VM's words


def answered_within(seconds: float, send: Callable[[], T]) -> T:
    """What `send()` returns (a response read whole), or requests.Timeout once `seconds` have passed. requests'
    timeout bounds each wait for the next bytes, not the exchange: a server answering a byte a second (a sick
    proxy, a wrong port) kept `--timeout 3` waiting past 40 s, for ever. The exchange runs on a daemon thread,
    left behind when it overruns: the command ends with the error soon after."""
    outcome: queue.SimpleQueue[tuple[Any, Exception | None]] = queue.SimpleQueue()

    def exchange() -> None:
        try:
            outcome.put((send(), None))
        except Exception as exc:  # raised in the caller's thread, where its handlers are
            outcome.put((None, exc))

    threading.Thread(target=exchange, name="http-exchange", daemon=True).start()
    try:
        answer, error = outcome.get(timeout=seconds)
    except queue.Empty:
        raise requests.Timeout(f"no whole answer within {seconds:g} s") from None
    if error is not None:
        raise error
    return answer


def without_credentials(url: str) -> str:
    """The URL as the page and the messages show it: user and password (http://user:secret@host) left out."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit(parts._replace(netloc=host))


def _timestamp(seconds: float) -> str:
    return f"{seconds:.3f}"


def _reason(exc: requests.RequestException) -> str:
    """The innermost cause of a connection error, e.g. 'Connection refused', not urllib3's wrapping."""
    cause: BaseException = exc
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    text = str(cause).strip() or type(cause).__name__
    return text.rsplit("] ", 1)[-1].splitlines()[0]


def _series(data: dict[str, Any]) -> list[Series]:
    kind, result = data["resultType"], data["result"]
    if kind == "vector":
        return [Series(_labels(item["metric"]), (_point(item["value"]),)) for item in result]
    if kind == "matrix":
        return [Series(_labels(item["metric"]), tuple(_point(value) for value in item.get("values", ())))
                for item in result]
    if kind == "scalar":
        return [Series({}, (_point(result),))]
    raise ValueError(f"a result of type {kind!r}")


def _point(value: Any) -> tuple[float, float]:
    """A [unix seconds, "value"] pair of the API as numbers."""
    at, number = value
    return float(at), float(number)


def _labels(metric: Any) -> dict[str, str]:
    if not isinstance(metric, dict) or not all(isinstance(v, str) for v in metric.values()):
        raise TypeError(f"labels {str(metric)[:80]!r} are not a name-value object")
    return metric


def _label_sets(data: Any) -> list[dict[str, str]]:
    if not isinstance(data, list):
        raise TypeError(f"{type(data).__name__} where a list of label sets belongs")
    return [_labels(item) for item in data]

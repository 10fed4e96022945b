"""GET /metrics on the router's port, as vLLM serves it on its API port: this node's Ray
metrics export, read and renamed.

Ray exports the router's and the pools' metrics (deployments.metrics) through the metrics
agent on each node, prefixed `ray_`; vLLM users' scrape configs and dashboards read
`vllm:<name>{model_name=...}` at the server's /metrics. The router answers that path with
its node's export translated (`translated`, pure): the vLLM-named families renamed
`vllm:<name>` with the served model's name as `model_name`, the `specserve_*` families under
their own names, both only as this router's application and its pools' record them, and
everything else (Ray's and Serve's own) dropped. A replica pushes its metrics to its node's
agent every metrics_report_interval_ms (Ray's default 10 s): a scrape reads the last push.
"""

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from fastapi.responses import Response

from deployments.ingress import error_response, retry_later

# Prometheus's text format, which the agent's text is and this keeps (`vllm:` is a legal name)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# the metrics that carry vLLM's names (deployments.metrics: the router's, and the pools'
# kv_cache_usage_perc)
VLLM_FAMILIES = frozenset({
    "num_requests_running", "num_requests_waiting", "prompt_tokens", "generation_tokens",
    "prefix_cache_queries", "prefix_cache_hits",
    "request_success", "time_to_first_token_seconds", "e2e_request_latency_seconds",
    "request_time_per_output_token_seconds", "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos", "spec_decode_cache_misses",
    "spec_decode_rounds_by_num_speculative_tokens", "spec_decode_round_seconds",
    "kv_cache_usage_perc"})
# a sample's name beyond its family's, as Prometheus writes counters and histograms
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")
# name, {labels} (quoted values may hold braces and escaped quotes), then value [timestamp]
SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?(.*)')
LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')
SHARED_S = 1.0  # scrapes closer than this share one read
FETCH_TIMEOUT_S = 5.0

logger = logging.getLogger(__name__)


class MetricsUnavailable(Exception):
    """This node's Ray metrics export cannot be read (no metrics agent, or it failed)."""


def exported_name(name: str) -> str | None:
    """A metric's (or a sample's) name in Ray's export as /metrics gives it; None: dropped."""
    if not name.startswith("ray_"):
        return None
    name = name.removeprefix("ray_")
    if name.startswith("specserve_"):
        return name
    family = next((name.removesuffix(suffix) for suffix in SUFFIXES
                   if name.endswith(suffix) and name.removesuffix(suffix) in VLLM_FAMILIES),
                  name)
    return f"vllm:{name}" if family in VLLM_FAMILIES else None


def label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def translated(text: str, model_name: str, applications: frozenset[str]) -> str:
    """Ray's Prometheus text as vLLM's /metrics reads: this project's families renamed
    (exported_name), their HELP and TYPE lines with them, vLLM's tagged `model_name`, only
    the samples of `applications` (the router's and its pools': another router on the node
    serves another model). Ray's gauge twin of each counter (RAY_EXPORT_COUNTER_AS_GAUGE,
    `ray_x` beside `ray_x_total`) is dropped: vLLM's counters have none."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)", text, re.MULTILINE))
    counters = {name.removesuffix("_total") for name, kind in types.items() if kind == "counter"}
    twins = {name for name, kind in types.items() if kind == "gauge" and name in counters}
    model_label = f'model_name="{label_value(model_name)}"'
    lines = []
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            name, _, rest = line[7:].partition(" ")
            renamed = None if name in twins else exported_name(name)
            if renamed is not None:
                lines.append(f"{line[:7]}{renamed} {rest}")
        elif line and not line.startswith("#"):
            sample = renamed_sample(line, twins, model_label, applications)
            if sample is not None:
                lines.append(sample)
    return "".join(line + "\n" for line in lines)


def renamed_sample(line: str, twins: set[str], model_label: str,
                   applications: frozenset[str]) -> str | None:
    match = SAMPLE.match(line)
    name, labels, rest = match.groups() if match else ("", None, "")
    renamed = None if name in twins else exported_name(name)
    labels = (labels or "").rstrip(",")
    if renamed is None or dict(LABEL.findall(labels)).get("application") not in applications:
        return None
    if renamed.startswith("vllm:"):
        labels = f"{labels},{model_label}" if labels else model_label
    return f"{renamed}{{{labels}}}{rest}"


@dataclass(frozen=True)
class NodeExport:
    url: str  # this node's Ray metrics export
    application: str  # the router's Serve application, whose series are its own


def node_export() -> NodeExport:
    """Where this replica's node exports Ray's metrics, through Ray's public API (blocking:
    a call to the GCS). MetricsUnavailable if the node has no export port."""
    import ray
    from ray import serve

    node_id = ray.get_runtime_context().get_node_id()
    node = next((node for node in ray.nodes() if node["NodeID"] == node_id), {})
    port, address = node.get("MetricsExportPort"), node.get("NodeManagerAddress", "")
    if not port:
        raise MetricsUnavailable(f"Ray node {node_id} has no metrics export port")
    host = f"[{address}]" if ":" in address else address
    return NodeExport(f"http://{host}:{port}/metrics", serve.get_replica_context().app_name)


async def fetched(url: str, timeout_s: float = FETCH_TIMEOUT_S) -> str:
    """The text at url; MetricsUnavailable if it cannot be read within timeout_s."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url) as response:
                if response.status != 200:
                    raise MetricsUnavailable(f"Ray's metrics export at {url} answered "
                                             f"{response.status}")
                return await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        raise MetricsUnavailable(f"Ray's metrics export at {url} cannot be reached "
                                 f"({type(error).__name__}: {error})") from None


class NodeMetrics:
    """The router's /metrics: its node's export (node_export, fetched) translated for the
    router's first served name; scrapes closer than shared_s apart share one read, and the
    GCS lookup and the translation run on threads, off the event loop."""

    def __init__(self, model_name: str, pools: tuple[str, ...],
                 locate: Callable[[], NodeExport] = node_export,
                 fetch: Callable[[str], Awaitable[str]] = fetched,
                 shared_s: float = SHARED_S) -> None:
        self.model_name, self.pools, self.shared_s = model_name, pools, shared_s
        self.locate, self.fetch = locate, fetch
        self._export: NodeExport | None = None
        self._locating: asyncio.Future | None = None  # the GCS lookup under way
        self._read: tuple[float, asyncio.Future] | None = None  # (its start, the read)
        self._failed = ""  # the last unexpected error logged (once, however many scrapes)

    async def text(self) -> str:
        now = time.monotonic()
        if self._read is None or (self._read[1].done()
                                  and now - self._read[0] >= self.shared_s):
            self._read = (now, asyncio.ensure_future(self.read()))
        return await asyncio.shield(self._read[1])

    async def read(self) -> str:
        export = self._export = self._export or await self.located()
        try:
            text = await self.fetch(export.url)
        except MetricsUnavailable:
            self._export = None  # looked up again at the next scrape (a restarted agent)
            raise
        applications = frozenset({export.application, *self.pools})
        return await asyncio.to_thread(translated, text, self.model_name, applications)

    async def located(self) -> NodeExport:
        """The GCS lookup (locate) within FETCH_TIMEOUT_S; one that does not answer is left
        running, and a later scrape waits for it again rather than start another thread."""
        if self._locating is None:
            self._locating = asyncio.ensure_future(asyncio.to_thread(self.locate))
        try:
            return await asyncio.wait_for(asyncio.shield(self._locating), FETCH_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise MetricsUnavailable(f"Ray's GCS did not say within {FETCH_TIMEOUT_S:g} s "
                                     "where this node exports its metrics") from None
        finally:
            if self._locating.done():
                self._locating = None  # answered or failed: the next lookup is a new one

    async def response(self) -> Response:
        try:
            return Response(await self.text(), media_type=CONTENT_TYPE)
        except Exception as error:  # MetricsUnavailable, or another's (a bug's: logged once)
            cause = (error if isinstance(error, MetricsUnavailable)
                     else f"{type(error).__name__}: {error}")
            if not isinstance(error, MetricsUnavailable) and cause != self._failed:
                self._failed = cause
                logger.exception("/metrics failed")
            return error_response(retry_later(
                f"metrics are unavailable: {cause}; the router's /metrics reads its node's Ray "
                "metrics export (Ray's metrics agent, one on each node)", 503))

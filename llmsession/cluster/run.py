"""``llmsession serve --replicas N``: start (or join) Ray, run the front and ``N`` engine
replicas on Ray Serve, wait for SIGTERM or Ctrl-C, then stop what was started: the
application, Serve, and a Ray instance this command started (with every process it began)."""

from __future__ import annotations

import logging
import math
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

APP_NAME = "llmsession"
STATS_PERIOD_S = 1.0  # how often replicas report what they hold


@dataclass(frozen=True)
class Cluster:
    """What ``serve --replicas`` runs: the model (file and configs, as one replica loads it),
    the server app's settings, and where the replicas run."""

    path: Path
    config: Any  # ModelConfig
    memory: Any  # MemoryConfig
    app_settings: dict[str, Any]
    replicas: int
    replica_cpus: float
    host: str
    port: int
    address: str | None = None  # a Ray cluster to join; None: start one here
    max_body_bytes: int = 8 << 20


def application(cluster: Cluster) -> Any:
    """The Serve application: the front, bound to the engine deployment."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from llmsession.cluster.deployment import Engine, Front

    routing: Any = RequestRouterConfig  # (a pydantic model its stubs mistype)
    engine = serve.deployment(
        name="engine",
        num_replicas=cluster.replicas,
        ray_actor_options={"num_cpus": cluster.replica_cpus},
        max_ongoing_requests=64,
        request_router_config=routing(
            request_router_class="llmsession.cluster.router.ConversationRouter",
            request_routing_stats_period_s=STATS_PERIOD_S,
        ),
    )(Engine)
    front = serve.deployment(name="front", ray_actor_options={"num_cpus": 0})(serve.ingress()(Front))
    bound_engine = engine.bind(str(cluster.path), cluster.config, cluster.memory, cluster.app_settings)
    return front.bind(bound_engine, cluster.max_body_bytes)


def run(cluster: Cluster, ready: threading.Event | None = None) -> None:
    """Serve until SIGTERM or SIGINT (or ``stop``), then stop what was started."""
    import ray
    from ray import serve

    started = cluster.address is None
    if started:
        cpus = math.ceil(cluster.replicas * cluster.replica_cpus) + 1
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=cluster.address, logging_level=logging.WARNING)
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": cluster.host, "port": cluster.port})
        serve.run(application(cluster), name=APP_NAME, route_prefix="/")
        print(
            f"serving {cluster.path.name} on {cluster.replicas} replicas at http://{cluster.host}:{cluster.port}/v1",
            flush=True,
        )
        if ready is not None:
            ready.set()
        stopping.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            serve.shutdown()  # type: ignore[no-untyped-call]
        finally:
            if started:
                ray.shutdown()

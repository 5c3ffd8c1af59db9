"""``llmsession serve --replicas N``: start (or join) Ray, run the front and ``N`` engine
replicas on Ray Serve, wait for SIGTERM or Ctrl-C, then stop what was started: the
application, Serve, and a Ray instance this command started (with every process it began)."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

APP_NAME = "llmsession"
STATS_PERIOD_S = 1.0  # how often replicas report what they hold
STOP_GRACE_S = 30.0  # beyond the replicas' own shutdown timeout, for Serve to stop
DRAIN_MARGIN_S = 5.0  # beyond a replica's time to save its conversations, before Ray kills it
ENGINE_ONGOING = 64  # requests one replica takes at once (its server queues beyond its sessions)
# The request routers ``--request-router`` offers: ours, and Ray's own for comparison (``bench
# cluster``), which get the conversation's key alone as the session id.
ROUTERS = {
    "conversation": "llmsession.cluster.router.ConversationRouter",
    "power-of-two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "consistent-hash": "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
    "prefix-affinity": (  # (given each request's text: ``deployment.Text``)
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
    ),
}


def most_replicas(replicas: int, max_replicas: int | None) -> int:
    """The most engine replicas a cluster may run: ``replicas``, or more with autoscaling
    (``--min-replicas`` is at most ``replicas``)."""
    return max(replicas, max_replicas or 0)


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
    min_replicas: int | None = None  # with max_replicas or target_ongoing: Ray's autoscaling
    max_replicas: int | None = None
    target_ongoing: float | None = None
    downscale_delay: float | None = None  # seconds of low load before autoscaling removes a replica
    shutdown_timeout: float = 10.0  # how long a stopping replica lets its streams finish
    router: str = "conversation"  # a name in ``ROUTERS``
    secret: bytes | None = None  # to move conversations through memory.disk_cache_dir (``moving``)

    @property
    def drain_s(self) -> float:
        """How long a stopping replica may spend saving its conversations (with a shared disk
        cache folder): as long as its streams may take to finish."""
        return self.shutdown_timeout if self.secret is not None else 0.0

    @property
    def most_replicas(self) -> int:
        """The most engine replicas it may run (what Ray must have CPUs for, and the front must
        let through)."""
        return most_replicas(self.replicas, self.max_replicas)

    def engine_options(self) -> dict[str, Any]:
        """The engine deployment's Ray Serve options: a fixed count of replicas, or Ray's
        ``AutoscalingConfig`` starting from ``replicas`` when a bound or a target is given."""
        options: dict[str, Any] = {
            "name": "engine",
            "ray_actor_options": {"num_cpus": self.replica_cpus},
            "max_ongoing_requests": ENGINE_ONGOING,
            # (its streams finish, then it saves its conversations: ``drain_s``; then Ray kills it)
            "graceful_shutdown_timeout_s": self.shutdown_timeout + self.drain_s + DRAIN_MARGIN_S,
        }
        bounds = (self.min_replicas, self.max_replicas, self.target_ongoing)
        if all(bound is None for bound in bounds):
            if self.downscale_delay is not None:
                raise ValueError(
                    "--downscale-delay needs --min-replicas, --max-replicas or --target-ongoing-requests"
                )
            return {**options, "num_replicas": self.replicas}
        low = self.min_replicas if self.min_replicas is not None else 1
        high = self.max_replicas if self.max_replicas is not None else max(self.replicas, low)
        if not low <= self.replicas <= high:
            raise ValueError(
                f"--replicas {self.replicas} must lie within --min-replicas {low} and --max-replicas {high}"
            )
        scaling: dict[str, Any] = {
            "min_replicas": low,
            "max_replicas": high,
            "initial_replicas": self.replicas,
        }
        if self.target_ongoing is not None:
            scaling["target_ongoing_requests"] = self.target_ongoing
        if self.downscale_delay is not None:
            if not self.downscale_delay >= 0:
                raise ValueError(f"--downscale-delay must be 0 or more seconds, got {self.downscale_delay}")
            scaling["downscale_delay_s"] = self.downscale_delay
        return {**options, "autoscaling_config": scaling}


def application(cluster: Cluster) -> Any:
    """The Serve application: the front, bound to the engine deployment."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from llmsession.cluster.deployment import Board, Engine
    from llmsession.cluster.front import FRONT_MARGIN, UNKEYED_READERS, Front
    from llmsession.serve.access import Access

    routing: Any = RequestRouterConfig  # (a pydantic model its stubs mistype)
    engine = serve.deployment(
        **cluster.engine_options(),
        request_router_config=routing(
            request_router_class=ROUTERS[cluster.router],
            request_routing_stats_period_s=STATS_PERIOD_S,
        ),
    )(Engine)
    front = serve.deployment(
        name="front",
        ray_actor_options={"num_cpus": 0},
        # (every request passes through it: the replicas', keyless bodies read beside them, a margin)
        max_ongoing_requests=cluster.most_replicas * ENGINE_ONGOING + UNKEYED_READERS + FRONT_MARGIN,
        graceful_shutdown_timeout_s=cluster.shutdown_timeout,
    )(serve.ingress()(Front))
    board = cast(Any, Board).remote()  # (this process owns it: it ends with the command)
    bound_engine = engine.bind(
        str(cluster.path),
        cluster.config,
        cluster.memory,
        cluster.app_settings,
        board,
        cluster.secret,
        cluster.drain_s,
        cluster.router == "conversation",
    )
    access = Access(cluster.app_settings.get("api_key"), cluster.app_settings.get("operator_key"))
    answers = cluster.most_replicas * ENGINE_ONGOING
    return front.bind(bound_engine, cluster.max_body_bytes, board, cluster.router, access, answers)


def run(cluster: Cluster) -> None:
    """Serve until SIGTERM or SIGINT, then stop what was started: the application, and Serve and
    Ray themselves when this command started them (a joined cluster keeps its own)."""
    import ray
    from ray import serve

    stopping = threading.Event()

    def stop(*_: object) -> None:
        if stopping.is_set():  # (asked again: stop now, Ray's processes with this one)
            os._exit(1)
        stopping.set()

    def listen() -> dict[int, Any]:
        return {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}

    previous = listen()
    started = cluster.address is None
    try:
        if started:
            cpus = math.ceil(cluster.most_replicas * cluster.replica_cpus) + 1
            ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
        else:
            ray.init(address=cluster.address, logging_level=logging.WARNING)
        listen()  # (ray.init installs handlers of its own, which abort the process)
        try:
            if not stopping.is_set():
                serve.start(http_options={"host": cluster.host, "port": cluster.port})
                serve.run(application(cluster), name=APP_NAME, route_prefix="/")
                where = f"http://{cluster.host}:{cluster.port}/v1"
                print(f"serving {cluster.path.name} on {cluster.replicas} replicas at {where}", flush=True)
                stopping.wait()
        finally:
            _stop(started, cluster.shutdown_timeout + cluster.drain_s + STOP_GRACE_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop(started: bool, timeout: float) -> None:
    """Delete the application (Serve and all when this command started them), waiting at most
    ``timeout`` (a replica still starting can hold Serve's shutdown); then a Ray this command
    started is stopped, with every process of it, whatever Serve finished."""
    import ray
    from ray import serve

    def stop_serve() -> None:
        try:
            if started:
                serve.shutdown()  # type: ignore[no-untyped-call]
            else:
                serve.delete(APP_NAME)  # (the cluster's other applications go on)
        except Exception as error:  # (reported: Ray is stopped after all, if this command started it)
            logging.getLogger("llmsession.cluster").warning("stopping Serve failed: %s", error)

    stopper = threading.Thread(target=stop_serve, name="llmsession-serve-stop", daemon=True)
    stopper.start()
    stopper.join(timeout)
    if started:
        ray.shutdown()

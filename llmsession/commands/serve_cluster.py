"""``llmsession serve --replicas N``: the server on Ray Serve (``llmsession.cluster``), with
every ``serve`` option. Ray is imported only when the command runs with ``--replicas``."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from llmsession.cluster.run import ROUTERS
from llmsession.commands.argtypes import positive_int
from llmsession.commands.doctor import error
from llmsession.config import MemoryConfig, ModelConfig


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--replicas",
        type=positive_int,
        metavar="N",
        help="N replicas of the engine on Ray Serve, each conversation routed to the replica that "
        "holds it (needs pip install 'llmsession[cluster]'; default: one process, no Ray)",
    )
    add(
        "--ray-address",
        metavar="ADDRESS",
        help="with --replicas: join this Ray cluster (auto: the one started on this host with "
        "`ray start`); default: start a Ray instance here and stop it on exit",
    )
    add("--min-replicas", type=positive_int, metavar="N", help="with --replicas: Ray's autoscaling floor")
    add("--max-replicas", type=positive_int, metavar="N", help="with --replicas: Ray's autoscaling ceiling")
    add(
        "--target-ongoing-requests",
        type=float,
        metavar="R",
        help="with --replicas: requests in flight per replica that Ray's autoscaling aims at",
    )
    add(
        "--downscale-delay",
        type=float,
        metavar="S",
        help="with --replicas: seconds the load must stay low before Ray's autoscaling removes a "
        "replica (Ray's default: 600); a removed replica's conversations move with their state "
        "through a shared --disk-cache-dir",
    )
    add(
        "--request-router",
        choices=sorted(ROUTERS),
        help="with --replicas: how requests find replicas: conversation (ours: the replica holding "
        "it; the default), or Ray's power-of-two, consistent-hash or prefix-affinity, for comparison "
        "(under these a conversation moves only through a replica that stops)",
    )
    add(
        "--replica-cpus",
        type=float,
        metavar="C",
        help="with --replicas: CPUs Ray reserves for each replica (default: its --threads)",
    )


def serve_replicas(
    args: argparse.Namespace,
    model_path: Path,
    config: ModelConfig,
    memory: MemoryConfig,
    app_settings: dict[str, Any],
) -> int:
    """Run the cluster until SIGTERM or Ctrl-C; 2 when Ray is missing."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ModuleNotFoundError:
        error("`llmsession serve --replicas` needs Ray Serve: pip install 'llmsession[cluster]'")
        return 2
    from llmsession.cluster.run import Cluster, most_replicas, run
    from llmsession.native.machine import usable_cores

    if config.threads is None:  # (the machine's cores shared among the most replicas it may run)
        most = most_replicas(args.replicas, args.max_replicas)
        config = dataclasses.replace(config, threads=max(1, usable_cores() // most))
    threads = config.threads or 1
    cluster = Cluster(
        path=model_path,
        config=config,
        memory=memory,
        app_settings=app_settings,
        replicas=args.replicas,
        replica_cpus=args.replica_cpus if args.replica_cpus is not None else float(threads),
        host=args.host,
        port=args.port,
        address=args.ray_address,
        max_body_bytes=args.max_body_bytes,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing=args.target_ongoing_requests,
        downscale_delay=args.downscale_delay,
        router=args.request_router or "conversation",
        shutdown_timeout=args.shutdown_timeout,
        secret=_secret() if memory.disk_cache_dir is not None else None,
    )
    try:
        cluster.engine_options()  # (a bad combination refused before Ray starts)
    except ValueError as e:
        error(str(e))
        return 1
    from ray.serve.exceptions import RayServeException

    try:
        run(cluster)
    except (RayServeException, RuntimeError, ConnectionError) as e:  # (a replica that did not start)
        error(f"the cluster did not start: {e}")
        return 1
    return 0


def _secret() -> bytes:
    """The cluster's secret, kept in the cache root (``moving.load_secret``)."""
    from llmsession.cluster.moving import load_secret
    from llmsession.commands.paths import cache_root

    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return load_secret(root / "cluster-secret")


def check_cluster_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the cluster options given, if anything: each needs ``--replicas``."""
    if args.replicas is not None:
        return None
    names = ["ray_address", "replica_cpus", "min_replicas", "max_replicas", "target_ongoing_requests"]
    names += ["downscale_delay", "request_router"]
    given = [name for name in names if getattr(args, name) is not None]
    if given:
        return f"--{given[0].replace('_', '-')} needs --replicas"
    return None

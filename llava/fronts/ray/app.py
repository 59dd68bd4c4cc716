"""The Ray Serve application: an ingress and one replica per GPU behind the affinity router.

A Serve config points at `build` (`import_path: llava.fronts.ray.app:build`, as AWS's Ray Serve
container and KubeRay's RayService read it); `python -m llava serve-ray` runs it locally.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

# Every replica process: a replica's step loop is one thread doing the work of the whole device,
# so Ray's default of one CPU per actor would serialise nothing; its torch threads come from the
# kit's own setting (`torch_threads`).
REPLICA_CPUS = 1.0
# Read by every Ray process this one starts. Ray's own queue-length probe deadlines are kept:
# with routing tasks that never spin (router.py) a replica answers them in milliseconds, even
# mid-forward (measured: 16 clients at once, no probe missed its 0.1 s deadline).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


def default_replicas(gpus: float, per_replica: int = 1) -> int:
    """One replica per model copy (`per_replica` GPUs each: vLLM's tensor parallel size), or
    one on a machine without GPUs."""
    return max(1, int(gpus // per_replica))


def build(args: Mapping[str, Any]) -> Any:
    """Return the application: `model_dir` (required; relative to /opt/ml/model, where SageMaker
    puts a package), `model_name`, `replicas`, `num_gpus` (per replica), `settings`
    (ServerConfig fields, as in model-config.yaml)."""
    import ray
    from ray import serve

    from llava.fronts.ray.ingress import Ingress, routes
    from llava.fronts.ray.package import PACKAGE_DIR
    from llava.fronts.ray.replica import LlavaReplica
    from llava.fronts.ray.router import SessionAffinityRouter

    config = _config(args.get("settings"))
    spans = config.tensor_parallel_size if config.engine != "transformers" else 1
    gpus = _cluster_gpus(ray)
    gpus_per_replica = float(args.get("num_gpus", spans if gpus else 0))
    replicas = int(args.get("replicas") or default_replicas(gpus, spans))
    replica = serve.deployment(
        name="LlavaReplica",
        num_replicas=replicas,
        # The step loop batches everything in flight: never let Ray hold requests back.
        max_ongoing_requests=4096,
        ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": REPLICA_CPUS},
        request_router_config={
            "request_router_class": SessionAffinityRouter,
            "request_router_kwargs": {"resume_anywhere": bool(config.session_store)},
            "request_routing_stats_period_s": 1,
            "request_routing_stats_timeout_s": 5,
        },
        health_check_period_s=5,
        graceful_shutdown_timeout_s=30,
    )(LlavaReplica).bind(
        str(PACKAGE_DIR / args["model_dir"]),
        str(args.get("model_name", "llava")),
        args.get("settings"),
    )
    ingress = serve.deployment(
        name="Ingress", max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0}
    )(serve.ingress(routes)(Ingress))
    return ingress.bind(replica)


def _config(settings: Mapping[str, Any] | None) -> Any:
    """The replicas' settings (the package's, then the environment's): the shared store, and
    the GPUs one replica's model spans."""
    from llava.core.config import ServerConfig

    return ServerConfig.from_mapping(settings or {}, os.environ)


def _cluster_gpus(ray: Any) -> float:
    """Return the GPUs the connected Ray cluster has (0 before `ray.init`)."""
    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


def serve_forever(
    model_dir: str,
    *,
    model_name: str = "llava",
    replicas: int = 0,
    host: str = "127.0.0.1",
    port: int = 8080,
    address: str | None = None,
    proxy_location: str = "EveryNode",
    settings: Mapping[str, Any] | None = None,
    metrics_port: int | None = None,
) -> None:
    """Serve a checkpoint with Ray Serve on host:port until SIGTERM or Ctrl-C (`settings`:
    ServerConfig fields, as a model package's config.yaml gives them; `metrics_port`: where a
    new local cluster serves its Prometheus metrics)."""
    for name, value in RAY_ENV.items():  # read by every Ray process this one starts
        os.environ.setdefault(name, value)
    import ray
    from ray import serve

    # No address: a new local cluster ("local"), never one a past `ray start` left behind.
    ray.init(
        address=address or "local",
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=None if address else metrics_port,
    )
    # After ray.init, which installs Ray's own SIGTERM handler (it ends the process at once):
    # SIGTERM is heard even while the replicas start (the container's PID 1 has no default).
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve.start(proxy_location=proxy_location, http_options={"host": host, "port": port})
    app = build(
        {
            "model_dir": model_dir,
            "model_name": model_name,
            "replicas": replicas,
            "settings": settings,
        }
    )
    print(f"starting {replicas or 'one per GPU'} replica(s) of {model_dir}", file=sys.stderr)
    serve.run(app, name="llava", route_prefix="/")
    print(f"llava on Ray Serve: http://{host}:{port} (ready)", flush=True)
    stop.wait()
    grace = _config(settings).drain_grace_s
    print(f"draining: answers in flight finish (at most {grace:.0f} s)", file=sys.stderr)
    try:
        left = serve.get_app_handle("llava").drain.remote(grace).result(timeout_s=grace + 5)
        print(f"drained ({left} replies cut)", file=sys.stderr, flush=True)
    except Exception as error:  # the stop goes on: Ray's own graceful shutdown follows
        print(f"draining failed: {error!r}", file=sys.stderr, flush=True)
    print("shutting down: replicas flush their session snapshots", file=sys.stderr, flush=True)
    serve.shutdown()
    ray.shutdown()
    os._exit(0)  # Ray's threads would otherwise keep the process alive

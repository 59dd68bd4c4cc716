"""Command line: `python -m llava <command>`; `python -m llava -h` lists the commands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llava.tools.archive import add_model_arguments
from llava.tools.tiny.profiles import PROFILES


def _archive(args: argparse.Namespace) -> None:
    from llava.tools.archive import build_archive, resolve_model

    model_dir = resolve_model(args.model, args.cache_dir)
    path = build_archive(model_dir, args.out, name=args.name, archive_format=args.format)
    print(path)


def _build_tiny(args: argparse.Namespace) -> None:
    from llava.tools.tiny import build_checkpoint

    print(build_checkpoint(args.out, profile=args.profile, seed=args.seed, overwrite=True))


def _local_endpoint(args: argparse.Namespace) -> None:
    from llava.fronts.local_runtime.cli import serve
    from llava.tools.archive import resolve_model

    serve(
        host=args.host,
        port=args.port,
        name=args.name,
        instances=args.instances,
        model_store=args.model_store,
        model=args.model,
        front=args.front,
        checkpoint=resolve_model(args.source) if args.front == "ray" else "",
        replicas=args.replicas,
        prefix_length=args.prefix_length if args.routing == "prefix-aware" else None,
        concurrency_threshold=args.concurrency_threshold,
    )


def _package_ray(args: argparse.Namespace) -> None:
    from llava.fronts.ray.package import write_package
    from llava.tools.archive import resolve_model

    out = write_package(
        resolve_model(args.model, args.cache_dir),
        Path(args.out),
        model_name=args.name,
        replicas=args.replicas,
    )
    print(f"wrote {out}: upload it as the model data (make deploy FRONT=ray)")


def _serve_ray(args: argparse.Namespace) -> None:
    from llava.fronts.ray.app import serve_forever
    from llava.fronts.ray.package import read_package
    from llava.tools.archive import resolve_model

    package = read_package(Path(args.config)) if args.config else {}
    serve_forever(
        package.get("model_dir") or str(resolve_model(args.model, args.cache_dir)),
        model_name=package.get("model_name", args.name),
        replicas=args.replicas or int(package.get("replicas", 0)),
        host=args.host,
        port=args.port,
        address=args.address,
        proxy_location=args.proxy_location,
        settings=package.get("settings"),
        metrics_port=args.metrics_port,
    )


def _deploy(args: argparse.Namespace) -> None:
    from llava.tools.deploy import run_deploy

    run_deploy(args)


def _delete(args: argparse.Namespace) -> None:
    from llava.tools.deploy import run_delete

    run_delete(args)


def _chat(args: argparse.Namespace) -> None:
    from llava.tools.chat_page.app import serve

    serve(args)


def build_parser() -> argparse.ArgumentParser:
    """Describe every command and its options."""
    parser = argparse.ArgumentParser(prog="python -m llava", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    archive = commands.add_parser("archive", help="build the TorchServe model archive")
    add_model_arguments(archive)
    archive.add_argument("--out", default="model-store", help="export directory")
    archive.add_argument("--name", default="llava", help="model name in TorchServe")
    archive.add_argument("--format", default="no-archive", choices=["no-archive", "default", "tgz"])
    archive.set_defaults(run=_archive)

    tiny = commands.add_parser("build-tiny", help="write a random-weight LLaVA checkpoint")
    tiny.add_argument("out")
    tiny.add_argument("--profile", default="tiny", choices=sorted(PROFILES))
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=_build_tiny)

    local = commands.add_parser(
        "local-endpoint",
        help="a local SageMaker runtime (sticky sessions, streaming) in front of N TorchServes",
    )
    local.add_argument("--host", default="127.0.0.1")
    local.add_argument("--port", type=int, default=8090)
    local.add_argument("--name", default="llava", help="endpoint name (EndpointName)")
    local.add_argument("--instances", type=int, default=2, help="TorchServe instances")
    local.add_argument("--model-store", default="model-store")
    local.add_argument("--model", default="llava", help="model name in the model store")
    local.add_argument(
        "--front",
        default="torchserve",
        choices=["torchserve", "ray"],
        help="each instance's server",
    )
    local.add_argument("--source", default="shapes", help="--front ray: the checkpoint to serve")
    local.add_argument("--replicas", type=int, default=0, help="--front ray: replicas per instance")
    local.add_argument(
        "--routing",
        default="least-outstanding",
        choices=["least-outstanding", "prefix-aware"],
        help="how requests without a session id pick an instance (as deploy --routing)",
    )
    local.add_argument("--prefix-length", type=int, default=4096, help="prefix-aware: 1024-65536")
    local.add_argument("--concurrency-threshold", type=int, default=16, help="prefix-aware: 1-1024")
    local.set_defaults(run=_local_endpoint)

    ray = commands.add_parser(
        "serve-ray", help="serve with Ray Serve: one replica per GPU, sessions pinned to theirs"
    )
    add_model_arguments(ray)
    ray.add_argument("--name", default="llava", help="the model's name in the API")
    ray.add_argument("--replicas", type=int, default=0, help="default: one per GPU, 1 on CPU")
    ray.add_argument("--host", default="127.0.0.1")
    ray.add_argument("--port", type=int, default=8080)
    ray.add_argument("--address", default=None, help="a running Ray cluster (default: a new one)")
    ray.add_argument(
        "--config", default=None, help="a model package's config.yaml (`package-ray`): serve it"
    )
    ray.add_argument(
        "--proxy-location",
        default="EveryNode",
        choices=["EveryNode", "HeadOnly"],
        help="where Ray runs HTTP proxies (HeadOnly: several nodes on one machine share a port)",
    )
    ray.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="where a new local cluster serves its Prometheus metrics, the kit's gauges among "
        "them (ray_llava_sessions, ...; default: a port Ray picks)",
    )
    ray.set_defaults(run=_serve_ray)

    package = commands.add_parser(
        "package-ray", help="write the model package AWS's Ray Serve SageMaker container reads"
    )
    add_model_arguments(package)
    package.add_argument("--out", required=True, help="the package directory to write")
    package.add_argument("--name", default="llava", help="the model's name in the API")
    package.add_argument("--replicas", type=int, default=0, help="default: one per GPU")
    package.set_defaults(run=_package_ray)

    chat = commands.add_parser(
        "chat", help="a chat page (Gradio) over an endpoint: needs the ui extra"
    )
    target = chat.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--url", help="a TorchServe URL, e.g. http://127.0.0.1:8080/predictions/llava"
    )
    target.add_argument("--endpoint", help="a SageMaker endpoint name (or a local runtime's)")
    chat.add_argument("--region", default=None, help="the endpoint's AWS region")
    chat.add_argument("--host", default="127.0.0.1")
    chat.add_argument("--port", type=int, default=7860)
    chat.set_defaults(run=_chat)

    from llava.tools.deploy import add_delete_arguments, add_deploy_arguments

    deploy = commands.add_parser("deploy", help="upload the archive and deploy to SageMaker")
    add_deploy_arguments(deploy)
    deploy.set_defaults(run=_deploy)
    delete = commands.add_parser("delete", help="delete a SageMaker deployment")
    add_delete_arguments(delete)
    delete.set_defaults(run=_delete)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run the chosen command."""
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])

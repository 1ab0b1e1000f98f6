"""``scirl inference @ configs/X.toml [--field value ...] [--host H] [--port P] [--gpus N] [--print-command]``."""

from __future__ import annotations

import argparse

from scirl.commands.parser import Parser, refused

EPILOG = """\
One vLLM server for the run's model, started as `scirl train`'s launcher starts its servers (the same
flags, dtype, memory settings and environment), in the foreground. Give the trainer the URL it prints:
  node A: scirl inference @ configs/X.toml --host 0.0.0.0 --port 8000
  node B: scirl train @ configs/X.toml --inference.urls http://nodeA:8000
With the trainer on other machines, use --deployment.weight-sync nccl, or a run directory on a file
system every node mounts at the same path (filesystem weight sync: the servers read broadcasts/ there).
"""


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="scirl inference",
        description="One vLLM server for a run's model, for a trainer elsewhere.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--host",
        default=None,
        help="address to listen on (default: deployment.host); 0.0.0.0 for "
        "every address, or this node's address the trainer reaches",
    )
    parser.add_argument("--port", type=int, default=None, help="port (default: deployment.port; 0 picks a free one)")
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs the server spreads over, data parallel (default: every visible one; none on a CPU)",
    )
    parser.add_argument(
        "--print-command",
        action="store_true",
        help="print the server's command (environment, core pin, argv) as one shell line instead of running it",
    )
    args, config_args = parser.parse_known_args(argv)
    if args.port is not None and not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0..65535, got {args.port}")
    if args.gpus is not None and args.gpus < 1:
        parser.error(f"--gpus must be at least 1, got {args.gpus}")

    from scirl.deploy.preflight import check_hub_model, check_model, check_packages, on_cuda
    from scirl.deploy.server import serve, server_for
    from scirl.errors import ConfigError, DeployError, PreflightError
    from scirl.run.config_io import load_config

    try:
        cfg = load_config(config_args)
        host = args.host or cfg.deployment.host
        server = server_for(
            cfg, host=host, port=cfg.deployment.port if args.port is None else args.port, gpus=args.gpus
        )
        if args.print_command:
            print(server.process.shell())
            return 0
        check_model(cfg.model)  # now, not after the server's start-up wait
        check_hub_model(cfg.model)
        check_packages(on_cuda(cfg.device))
        return serve(server, cfg)
    except (ConfigError, PreflightError, DeployError) as exc:
        return refused("scirl inference", exc)

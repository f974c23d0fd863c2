"""``envhub-sched``: run the GPU scheduler service, manage its API keys, and use it.

    envhub-sched serve --gpus 0,1,2,3 [--host 127.0.0.1] [--port 8765] [--db FILE] [--auth]
    envhub-sched keys create --user NAME [--admin]      # prints the new key once
    envhub-sched submit --gpus 2 --kind sft --name run1 -- python train.py --lr 1e-5
    envhub-sched list [--json] | status ID | logs ID [-f] | cancel ID | gpus [--json] | nodes [--json]

Client commands find the service through ``--url`` or ``ENVHUB_SCHEDULER_URL`` and read the key
from ``ENVHUB_SCHEDULER_KEY`` or ``ENVHUB_SCHEDULER_KEY_FILE`` — never from the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from trainer.scheduler._jobs import JOB_KINDS
from trainer.scheduler.errors import SchedulerError

DEFAULT_PORT = 8765
DB_ENV = "ENVHUB_SCHEDULER_DB"


def _default_db() -> str:
    return os.environ.get(DB_ENV) or str(Path.home() / ".envhub" / "scheduler.db")


def _port_range(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    try:
        return int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"Expected a port range like 29500-29999, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="envhub-sched", description="envhub GPU scheduler")
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", help="run the scheduler service",
                           description="Run the scheduler: jobs get GPUs, ports and logs, and are cleaned up after "
                                       "(docs/scheduler.md).")
    serve.add_argument("--gpus", default="", help="declared GPU indices (0,1,2,3) or 'auto' (ask the driver)")
    serve.add_argument("--backend", choices=["local", "ray"], default="local",
                       help="local: this machine's GPUs (default); ray: a Ray cluster's nodes and GPUs")
    serve.add_argument("--ray-address", default=None, help="Ray cluster to join (default: 'auto', the local one)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address; anything but loopback needs --auth")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT}; 0 picks a free one)")
    serve.add_argument("--db", default=None, help=f"SQLite job store (default ${DB_ENV} or ~/.envhub/scheduler.db)")
    serve.add_argument("--log-dir", default=None, help="job logs (default: <db>.logs/)")
    serve.add_argument("--grace-s", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL when ending a job (default 5)")
    serve.add_argument("--ports", type=_port_range, default=(29500, 29999),
                       help="the port range handed to jobs (default 29500-29999)")
    auth = serve.add_mutually_exclusive_group()
    auth.add_argument("--auth", dest="auth", action="store_true", default=None, help="require API keys")
    auth.add_argument("--no-auth", dest="auth", action="store_false", help="no keys (loopback only)")

    keys = sub.add_parser("keys", help="manage API keys (works on the store directly)")
    keys.add_argument("action", choices=["create", "list", "revoke"])
    keys.add_argument("--user", help="owner of the new key")
    keys.add_argument("--admin", action="store_true", help="the key sees and cancels every job")
    keys.add_argument("--key-id", help="key to revoke (from `keys list`)")
    keys.add_argument("--db", default=None)

    def client_cmd(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--url", default=None, help="scheduler URL (default $ENVHUB_SCHEDULER_URL)")
        return p

    submit = client_cmd("submit", "queue a job; prints its id")
    submit.add_argument("--gpus", type=int, default=0, help="GPUs the job needs (default 0)")
    submit.add_argument("--kind", choices=JOB_KINDS, default="cmd")
    submit.add_argument("--name", default=None)
    submit.add_argument("--priority", type=int, default=0, help="higher runs first")
    submit.add_argument("--torchrun", action="store_true", help="rl/sft: wrap in torchrun --nproc_per_node=GPUS")
    submit.add_argument("--nodes", type=int, default=1, help="Ray backend: spread the GPUs over this many nodes")
    submit.add_argument("--replicas", type=int, default=1,
                        help="Ray backend, service/sampler: copies with --gpus each, port via {port}; restarted")
    submit.add_argument("--ports", type=int, default=1, help="TCP ports to reserve (ENVHUB_JOB_PORTS)")
    submit.add_argument("--heartbeat-timeout-s", type=float, default=None)
    submit.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="extra job environment")
    submit.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    client_cmd("status", "one job as JSON").add_argument("id")
    lister = client_cmd("list", "your jobs (all jobs for an admin)")
    lister.add_argument("--json", action="store_true")
    logs = client_cmd("logs", "a job's output")
    logs.add_argument("id")
    logs.add_argument("-f", "--follow", action="store_true")
    logs.add_argument("--tail", type=int, default=None)
    client_cmd("cancel", "cancel a job").add_argument("id")
    client_cmd("gpus", "the GPU inventory and who holds each GPU").add_argument("--json", action="store_true")
    client_cmd("nodes", "the inventory per node: GPUs, free GPUs, jobs").add_argument("--json", action="store_true")
    return parser


def _serve(args: argparse.Namespace) -> int:
    from trainer.scheduler._core import Scheduler, SchedulerConfig
    from trainer.scheduler._resources import parse_gpus
    from trainer.scheduler.server import bind_socket, resolve_auth, run_server

    gpus, note = parse_gpus(args.gpus)
    wildcard = args.host in ("0.0.0.0", "::")
    config = SchedulerConfig(gpus=gpus, db_path=args.db or _default_db(), log_dir=args.log_dir, grace_s=args.grace_s,
                             port_first=args.ports[0], port_last=args.ports[1],
                             advertise_host=socket.getfqdn() if wildcard else args.host)
    if args.backend == "ray":
        from trainer.scheduler._ray import RayScheduler  # imports ray: only when asked for

        ray_scheduler = RayScheduler(config, address=args.ray_address)
        note = f"Ray cluster: {ray_scheduler.gpus_total()} GPU(s) on {len(ray_scheduler.gpu_nodes())} node(s)"
        scheduler: Scheduler = ray_scheduler
    else:
        scheduler = Scheduler(config)
    auth = resolve_auth(args.host, args.auth, scheduler.store.key_count())
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"envhub-sched: {exc.strerror}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    print(f"envhub-sched: {note}; auth {'on' if auth else 'off'}; db {config.db_path}; "
          f"serving on http://{args.host}:{port}", flush=True)
    run_server(scheduler, sock, auth=auth)
    return 0


def _keys(args: argparse.Namespace) -> int:
    from trainer.scheduler._store import JobStore

    store = JobStore(args.db or _default_db())
    try:
        if args.action == "create":
            if not args.user:
                raise SchedulerError("Expected --user NAME for `keys create`")
            key = store.create_key(args.user, admin=args.admin)
            print(key)
            print("(shown once; store it in a file and point ENVHUB_SCHEDULER_KEY_FILE at it)", file=sys.stderr)
        elif args.action == "list":
            for row in store.list_keys():
                print(f"{row['key_id']}  {row['user']}{'  admin' if row['admin'] else ''}")
        else:
            if not args.key_id or not store.revoke_key(args.key_id):
                raise SchedulerError(f"Expected --key-id of an existing key (see `keys list`), got {args.key_id!r}")
    finally:
        store.close()
    return 0


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SchedulerError(f"Expected --env NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def _client_command(args: argparse.Namespace) -> int:
    from trainer.scheduler.client import SchedulerClient

    with SchedulerClient(args.url) as client:
        if args.cmd == "submit":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                raise SchedulerError("Expected a command after --, e.g. `envhub-sched submit --gpus 1 -- python x.py`")
            job = client.submit(command, gpus=args.gpus, kind=args.kind, name=args.name, priority=args.priority,
                                heartbeat_timeout_s=args.heartbeat_timeout_s, env=_parse_env(args.env),
                                cwd=os.getcwd(), torchrun=args.torchrun, ports=args.ports,
                                nodes=args.nodes, replicas=args.replicas)
            print(job["id"])
        elif args.cmd == "status":
            _print_json(client.status(args.id))
        elif args.cmd == "list":
            _print_jobs(client.list(), as_json=args.json)
        elif args.cmd == "logs":
            if args.follow:
                for text in client.logs(args.id, tail=args.tail, follow=True):
                    sys.stdout.write(text)
                    sys.stdout.flush()
            else:
                sys.stdout.write(client.logs(args.id, tail=args.tail))
        elif args.cmd == "cancel":
            print(client.cancel(args.id)["state"])
        elif args.cmd == "gpus":
            _print_gpus(client.gpus(), as_json=args.json)
        elif args.cmd == "nodes":
            _print_nodes(client.nodes(), as_json=args.json)
    return 0


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def _print_jobs(jobs: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(jobs))
        return
    print(f"{'ID':<10} {'NAME':<20} {'USER':<10} {'KIND':<9} {'STATE':<10} {'GPUS':<8} {'NODES':<16} REASON")
    for j in jobs:
        gpus = ",".join(map(str, j["gpus"])) or "-"
        nodes = ",".join(sorted({p["node_ip"] for p in j["placement"] if p.get("node_ip")})) or "-"
        print(f"{j['id']:<10} {j['name'][:20]:<20} {j['user'][:10]:<10} {j['kind']:<9} {j['state']:<10} "
              f"{gpus:<8} {nodes:<16} {j['reason']}")


def _print_gpus(gpus: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(gpus))
        return
    for gpu in gpus:
        node = f"{gpu['node_ip']} {gpu['node_id'][:12]}  " if gpu.get("node_id") else ""
        print(f"{node}{gpu['index']}  {gpu['name']}  {gpu['job'] or 'free'}")


def _print_nodes(nodes: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(nodes))
        return
    print(f"{'NODE':<14} {'ADDRESS':<16} {'GPUS':<5} {'FREE':<5} JOBS")
    for n in nodes:
        print(f"{n['node_id'][:12]:<14} {n['node_ip']:<16} {n['gpus']:<5} {n['gpus_free']:<5} {','.join(n['jobs']) or '-'}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``envhub-sched``."""
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "serve":
            return _serve(args)
        if args.cmd == "keys":
            return _keys(args)
        return _client_command(args)
    except (SchedulerError, ValueError) as exc:
        print(f"envhub-sched: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

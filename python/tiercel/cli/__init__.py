"""The `tiercel` command: look at, check, copy and clean up the checkpoints of a policy.

    tiercel ls [--json]
    tiercel inspect STEP [--tier T] [--rank R] [--json]
    tiercel verify [STEP] [--tier T] [--json]
    tiercel cp STEP --from TIER --to TIER [--json]
    tiercel gc [--dry-run] [--tmp-age SECONDS] [--json]
    tiercel rm STEP --tier T [--json]
    tiercel export STEP DIR [--format deepspeed|orbax|dcp|torch|safetensors] [--max-shard-size SIZE] [--json]
    tiercel placement --hosts N --replicas M [--failures K] [--json]
    tiercel stats --url HOST:PORT [--url ...] [--json]
    tiercel --version

`--policy FILE` and `--json` go before or after the command. The policy comes from
--policy, else $TIERCEL_POLICY, else ./tiercel.toml. The store is opened as rank 0 of a
world of 1; every rank's manifest is still readable through it. Bytes are moved and checked
by the core; this package only lists, formats and reports (docs/cli.md).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Sequence

from .. import _core
from ..errors import FIELDS
from ..exports import formats as export_formats
from .context import (
    EXIT_CORRUPT,
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    Ctx,
    UsageError,
)
from .copy import cmd_cp, cmd_rm
from .export import cmd_export
from .gc import DEFAULT_TMP_AGE, cmd_gc
from .inspect import cmd_inspect
from .ls import cmd_ls
from .output import json_out
from .stats import cmd_stats
from .verify import cmd_verify

EPILOG = """\
policy:
  --policy FILE, else $TIERCEL_POLICY, else ./tiercel.toml

exit codes:
  0  success (verify: every checksum holds)
  1  corruption found (verify), or stored bytes fail their checksum
  2  usage or configuration error (bad arguments, unknown tier, bad or missing policy file)
  3  step (or rank) not found
  4  any other error (a tier cannot be read or written, a capacity limit, ...)
"""



def _step(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer, got {s!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(
        prog="tiercel",
        description="Look at, check, copy and clean up the checkpoints of a tiercel policy.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--policy", metavar="FILE", help="policy file (default: $TIERCEL_POLICY, else ./tiercel.toml)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout (errors too)")
    p.add_argument("--version", action="version", version=f"tiercel {__version__} (format {_core.FORMAT_VERSION})")
    # The global options are taken before or after the command: `tiercel ls --policy p.toml
    # --json` works too. SUPPRESS keeps a value given before the command when none follows it.
    anywhere = argparse.ArgumentParser(add_help=False)
    anywhere.add_argument("--policy", metavar="FILE", default=argparse.SUPPRESS, help="policy file")
    anywhere.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    add = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        return add(name, parents=[anywhere], **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign]

    s = sub.add_parser("ls", help="steps per tier: state, ranks, size, commit time",
                       description="Lists every step on every tier: committed steps and uncommitted leftovers, "
                                   "with their size (stored bytes of all ranks), raw size, world size and commit time.")
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("inspect", help="the manifests of a step: items, dtypes, shapes, chunks, compression",
                       description="Shows the manifest of each rank of a step on one tier (default: the first tier "
                                   "in restore order that has it).")
    s.add_argument("step", type=_step, metavar="STEP")
    s.add_argument("--tier", metavar="T", help="the tier to read the manifests from")
    s.add_argument("--rank", type=int, metavar="R", help="only this rank")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("verify", help="re-read every chunk and check every checksum",
                       description="Reads every chunk of every rank of committed steps from each tier on its own "
                                   "and checks every checksum. Exit code 0: all good; 1: corruption found; "
                                   "3: the step is not committed on the tiers asked; 4: a tier could not be read.")
    s.add_argument("step", type=_step, nargs="?", metavar="STEP", help="default: every committed step")
    s.add_argument("--tier", metavar="T", help="default: every tier")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("cp", help="copy a committed step (every rank) between tiers",
                       description="Copies a committed step, every rank, from one tier to another and commits it there.")
    s.add_argument("step", type=_step, metavar="STEP")
    s.add_argument("--from", dest="source", required=True, metavar="TIER", help="the tier that has the step committed")
    s.add_argument("--to", dest="dest", required=True, metavar="TIER", help="the tier to copy it to")
    s.set_defaults(func=cmd_cp)

    s = sub.add_parser("gc", help="apply `keep`, remove uncommitted leftovers and what dead writers left",
                       description="On each tier: removes committed steps beyond `keep` and uncommitted steps older "
                                   "than the newest committed one, temporary files (\".tmp-\" in the name) whose "
                                   "writer is gone, spare shared-memory segments of dead processes, and multipart "
                                   "uploads that killed writers left (s3, gcs).")
    s.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    s.add_argument("--tmp-age", type=float, default=DEFAULT_TMP_AGE, metavar="SECONDS",
                   help=f"leave temporary files younger than this (default: {DEFAULT_TMP_AGE:.0f})")
    s.set_defaults(func=cmd_gc)

    s = sub.add_parser("rm", help="delete a step from a tier", description="Deletes a step from one tier (no question asked).")
    s.add_argument("step", type=_step, metavar="STEP")
    s.add_argument("--tier", required=True, metavar="T")
    s.set_defaults(func=cmd_rm)

    s = sub.add_parser("export", help="write a step in a framework's own format (DeepSpeed, Orbax, torch DCP, torch.save) "
                                      "or as safetensors",
                       description="Writes a committed step as a plain checkpoint of the framework that saved it, "
                                   "loadable without tiercel: a DeepSpeed checkpoint directory, an Orbax checkpoint, "
                                   "a torch.distributed.checkpoint directory, or (a plain save) one torch.save file per "
                                   "rank; the format is read from the step unless --format names it. --format "
                                   "safetensors writes the step's tensors as Hugging Face safetensors files.")
    s.add_argument("step", type=_step, metavar="STEP")
    s.add_argument("dir", metavar="DIR", help="the directory to write (created; if it exists, it must be empty)")
    s.add_argument("--format", choices=sorted(export_formats()),
                   help="the format to write (default: the one the step was saved in)")
    s.add_argument("--max-shard-size", metavar="SIZE",
                   help="safetensors: the most bytes per file (default 5GB; 500MB, 2GiB, or bytes); "
                        "above it the files are sharded with model.safetensors.index.json")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("placement", help="GEMINI replica placement and the chance of surviving k host failures",
                       description="Prints the groups (and ring) that GEMINI's placement forms for N hosts with m "
                                   "copies each, and the exact probability that no host loses every copy of its "
                                   "shards when k hosts fail at once, for group, ring and mixed placement, beside "
                                   "GEMINI's closed form. Needs no policy.")
    s.add_argument("--hosts", type=int, required=True, metavar="N")
    s.add_argument("--replicas", type=int, required=True, metavar="M")
    s.add_argument("--failures", type=int, metavar="K")
    s.set_defaults(func=cmd_placement, needs_store=False)

    s = sub.add_parser("stats", help="a running job's metrics per tier (what tiercel.metrics.serve serves)",
                       description="Reads the metrics that tiercel.metrics.serve(store, port) serves from each "
                                   "process of a running job and shows them per tier and rank: steps and bytes "
                                   "written, write rate, last step, lag behind the newest save, queue depth, "
                                   "skips, failures, bytes read. Needs no policy.")
    s.add_argument("--url", action="append", required=True, metavar="HOST:PORT",
                   help="a process's metrics address (http://host:port/metrics); repeat for several ranks")
    s.set_defaults(func=cmd_stats, needs_store=False)
    return p


def cmd_placement(ctx: Ctx) -> int:
    from ..placement import report, summary

    a = ctx.args
    if a.json:
        json_out(summary(a.hosts, a.replicas, a.failures))
    else:
        print(report(a.hosts, a.replicas, a.failures))
    return EXIT_OK


def _open_store(policy: str | None) -> Any:
    from ..store import Store

    origin = "--policy"
    if policy is None:
        env = os.environ.get("TIERCEL_POLICY")
        policy, origin = (env, "$TIERCEL_POLICY") if env else ("tiercel.toml", "default")
    if not os.path.isfile(policy):
        hint = "" if origin != "default" else "; give --policy FILE or set $TIERCEL_POLICY"
        raise UsageError(f"policy file {policy} (from {origin}) does not exist{hint}")
    # The tools look at tiers as they are: every job's steps.
    return Store(policy, rank=0, world_size=1, tool=True)


def _fail(e: BaseException, code: int, as_json: bool) -> int:
    """Reports an error: one line on stderr, and with --json a document on stdout (with the
    error's tier, step, rank, item, chunk and path where known), so a script that parses
    stdout always gets JSON."""
    message = str(e) or type(e).__name__
    print(f"tiercel: error: {message}", file=sys.stderr)
    if as_json:
        fields = {f: getattr(e, f, None) for f in FIELDS}
        fields.update({f: v for f, v in _named_in(message).items() if fields.get(f) is None})
        json_out({"ok": False, "exit_code": code, "error": {"type": type(e).__name__, "message": message, **fields}})
    return code


#: How messages name a tier, step and rank ("tier 'disk'", "step 12", "rank 3").
_NAMED = {"tier": re.compile(r"\btier '([^']+)'"), "step": re.compile(r"\bstep (\d+)\b"), "rank": re.compile(r"\brank (\d+)\b")}


def _named_in(message: str) -> dict[str, Any]:
    """The tier, step and rank an error's message names, for an error raised without its
    fields (by an adapter, say): each only when the message names exactly one, so a message
    about two steps ("step 8 ... replaced by step 9") fills in neither."""
    out: dict[str, Any] = {}
    for field, pattern in _NAMED.items():
        found = set(pattern.findall(message))
        if len(found) == 1:
            value = found.pop()
            out[field] = value if field == "tier" else int(value)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    store = None
    try:
        if getattr(args, "needs_store", True):
            store = _open_store(args.policy)
        return args.func(Ctx(store, args))
    except (UsageError, _core.ConfigError, _core.InvalidArgumentError) as e:
        return _fail(e, EXIT_USAGE, args.json)
    except _core.NotFoundError as e:
        return _fail(e, EXIT_NOT_FOUND, args.json)
    except _core.IntegrityError as e:
        return _fail(e, EXIT_CORRUPT, args.json)
    except (_core.TiercelError, CommandError) as e:
        return _fail(e, EXIT_ERROR, args.json)
    except KeyboardInterrupt as e:
        return _fail(e, 130, args.json)
    except BrokenPipeError:
        # `tiercel ls | head`: the reader went away; stay quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    finally:
        if store is not None:
            try:
                store.close()
            except Exception:
                pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

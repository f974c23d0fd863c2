"""``envhub list``: the envs installed distributions register, with their tools, and what is wrong with any."""

from __future__ import annotations

import argparse
import json

from envhub.registry import GROUP, EnvDescription, describe, registered


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``envhub list``."""
    parser.add_argument("--json", action="store_true",
                        help="print a JSON array: name, class, distribution, version, tools, description, error "
                             "(a conflict is one object per distribution that registers the name)")


def run(args: argparse.Namespace) -> int:
    """Print the registered envs; exit 1 when a name conflicts or an entry point fails to import."""
    rows: list[tuple[EnvDescription, str | None]] = []
    for name, entries in registered().items():
        conflict = None
        if len(entries) > 1:
            conflict = (f"name {name!r} is registered by {len(entries)} distributions ("
                        + ", ".join(e.distribution for e in entries) + "); `envhub serve " + name + "` refuses it")
        rows += [(describe(entry), conflict) for entry in entries]
    if args.json:
        print(json.dumps([{**d.to_json(), "conflict": c} for d, c in rows], indent=2))
    else:
        print(_table(rows))
    return 1 if any(d.error or c for d, c in rows) else 0


def _table(rows: list[tuple[EnvDescription, str | None]]) -> str:
    if not rows:
        return f"no envs registered (a distribution registers one in the {GROUP!r} entry-point group; " \
               "`envhub init NAME` makes such a package)"
    cells = [("NAME", "CLASS", "VERSION", "TOOLS", "DESCRIPTION")]
    problems: list[str] = []
    for d, conflict in rows:
        cells.append((d.entry.name, d.entry.target, f"{d.entry.distribution} {d.entry.version}", _tools(d.tools),
                      "(failed to load: see problems)" if d.error else d.summary))
        problems += [p for p in (conflict, d.error) if p and p not in problems]
    widths = [max(len(row[i]) for row in cells) for i in range(4)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4] for row in cells]
    if problems:
        lines += ["", "problems:"] + [f"  - {p}" for p in problems]
    return "\n".join(lines)


def _tools(names: list[str], width: int = 40) -> str:
    text = ", ".join(names) or "-"
    if len(text) <= width:
        return text
    shown: list[str] = []
    for name in names:
        if len(", ".join([*shown, name])) > width - 8:
            break
        shown.append(name)
    return ", ".join(shown) + f" (+{len(names) - len(shown)})"

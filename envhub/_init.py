"""``envhub init NAME``: scaffold a pip-installable env package in ``./NAME``.

What it writes (templates in ``envhub/templates``, package data)::

    NAME/
      pyproject.toml        registers the env: [project.entry-points."envhub.envs"] NAME = "pkg.env:Class"
      README.md
      Dockerfile            builds on the envhub image (envhub:local)
      .dockerignore
      PKG/__init__.py
      PKG/env.py            a working env of the chosen kind
      tests/test_env.py     check_env and a scripted episode

``PKG`` is NAME as a Python identifier ending in ``_env`` (``math`` becomes ``math_env``: a package
called ``math`` would shadow the standard library); the class is its CamelCase (``MathEnv``).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

from envhub.registry import registered

TEMPLATES = Path(__file__).resolve().parent / "templates"
_VALID_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
#: (--tools, --multi-turn) -> the template pair's stem
KINDS = {(False, False): "answer", (True, False): "tools", (False, True): "multi_turn",
         (True, True): "tools_multi_turn"}
SUMMARIES = {"answer": "A single-turn envhub env: one question, one answer, reward 1 when it is right.",
             "tools": "A tool-calling envhub env: compute with a tool, then submit the answer.",
             "multi_turn": "A multi-turn envhub env: guess a secret number, one guess per turn.",
             "tools_multi_turn": "A multi-turn tool-calling envhub env: guess a secret number with a tool."}


@dataclass(frozen=True)
class Scaffold:
    """The names one ``envhub init`` derives from NAME."""

    env_name: str
    dist_name: str
    package: str
    class_name: str
    kind: str

    @classmethod
    def from_name(cls, name: str, *, tools: bool = False, multi_turn: bool = False) -> Scaffold:
        if not _VALID_NAME.fullmatch(name):
            raise ValueError(f"Expected NAME to start with a letter and hold only letters, digits, '_' and '-' "
                             f"(at most 64 characters), got {name!r}.")
        package = name.lower().replace("-", "_")
        if not package.endswith("_env"):
            package += "_env"
        class_name = "".join(part.capitalize() for part in package.split("_") if part)  # ends in "Env"
        return cls(name, name, package, class_name, KINDS[(tools, multi_turn)])

    def values(self) -> dict[str, str]:
        return {"env_name": self.env_name, "dist_name": self.dist_name, "package": self.package,
                "class_name": self.class_name, "summary": SUMMARIES[self.kind]}

    def files(self) -> dict[str, str]:
        """Relative path -> template file name."""
        return {"pyproject.toml": "pyproject.toml.tmpl", "README.md": "README.md.tmpl",
                "Dockerfile": "Dockerfile.tmpl", ".dockerignore": "dockerignore.tmpl",
                f"{self.package}/__init__.py": "__init__.py.tmpl",
                f"{self.package}/env.py": f"env_{self.kind}.py.tmpl",
                "tests/test_env.py": f"test_{self.kind}.py.tmpl"}


def render(template: str, values: dict[str, str]) -> str:
    """A template's text with ``${name}`` filled in (``$$`` is a literal ``$``)."""
    return Template((TEMPLATES / template).read_text()).substitute(values)


def scaffold(name: str, parent: str | Path = ".", *, tools: bool = False, multi_turn: bool = False) -> Path:
    """Write the package for ``name`` into ``parent/name`` and return that directory; refuses to overwrite."""
    plan = Scaffold.from_name(name, tools=tools, multi_turn=multi_turn)
    root = Path(parent) / name
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(f"{root} already exists and is not an empty directory; choose another NAME or "
                              "remove it.")
    values = plan.values()
    rendered = {rel: render(template, values) for rel, template in plan.files().items()}  # all or nothing
    for rel, text in rendered.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``envhub init``."""
    parser.add_argument("name", metavar="NAME",
                        help="the env's registered name and directory (letters, digits, '_', '-'); the Python "
                             "package is NAME ending in _env")
    parser.add_argument("--tools", action="store_true",
                        help="a tool-calling env (@tool methods the model calls) instead of a free-text answer")
    parser.add_argument("--multi-turn", action="store_true",
                        help="a multi-turn env (several actions per episode) instead of a single answer")
    parser.add_argument("--dir", default=".", help="where to create NAME/ (default: the current directory)")


def run(args: argparse.Namespace) -> int:
    """Write the package and print what to do next."""
    try:
        root = scaffold(args.name, args.dir, tools=args.tools, multi_turn=args.multi_turn)
    except FileExistsError as exc:
        raise ValueError(str(exc)) from None
    except OSError as exc:  # --dir is a file, or not writable
        raise ValueError(f"Expected --dir to be a directory NAME/ can be created in, got {args.dir!r}: "
                         f"{exc.strerror or exc} ({exc.filename}).") from None
    plan = Scaffold.from_name(args.name, tools=args.tools, multi_turn=args.multi_turn)
    taken = registered().get(plan.env_name)
    if taken:  # installing this package would make the name a conflict, which `envhub serve NAME` refuses
        print(f"envhub init: warning: the env name {plan.env_name!r} is already registered by "
              + ", ".join(f"{e.distribution} ({e.target})" for e in taken)
              + f"; rename it in {root / 'pyproject.toml'} before installing", file=sys.stderr)
    kind = {"answer": "single-turn", "tools": "tool-calling", "multi_turn": "multi-turn",
            "tools_multi_turn": "multi-turn tool-calling"}[plan.kind]
    print(f"created {root}/ ({kind} env {plan.package}.env:{plan.class_name})\n"
          f"next:\n  pip install -e {root}\n  envhub list\n  envhub check {plan.env_name}\n"
          f"  envhub serve {plan.env_name} --port 8000\n"
          f"  envhub eval --env {plan.env_name} --model tiny --episodes 4 --samples 2 --max-tokens 64"
          "   # a random tiny model writes to the limit")
    return 0

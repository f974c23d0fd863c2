"""Run an eval: N tasks x K samples, C at a time, each episode appended to ``results.jsonl`` as it finishes.

Task ``i`` resets with seed ``seed + i`` (and ``reset_kwargs``), so its K samples face the same task
and a rerun faces the same tasks. The run's arguments go to ``run.json`` first; ``summary.json`` is
written at the end, also after Ctrl-C (the episodes in flight are dropped, the finished ones kept).
``resume=True`` plays only the (task, sample) pairs ``results.jsonl`` lacks (``retry_failed``: and the
failed ones, whose lines it removes first), and refuses when an argument that changes what an episode
does differs from ``run.json``.

>>> EvalConfig(env="math", model="tiny", episodes=2, samples=2).material()["env"]
'math'
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from envhub.chat import ChatModel
from envhub.eval.episode import (
    DEFAULT_SYSTEM_PROMPT,
    EnvConnection,
    EpisodeLimits,
    EpisodeRecord,
    EpisodeSpec,
    play_episode,
)
from envhub.eval.models import ModelOptions, check_model_path, load_chat_model
from envhub.eval.summary import summarize

#: the arguments that change what one episode does: a resumed run must keep them
MATERIAL = ("env", "model", "model_name", "seed", "max_turns", "max_tokens", "temperature", "system_prompt",
            "reset_kwargs", "env_config", "history_turns")
_SECRETS = ("api_key", "env_token")


@dataclass
class EvalConfig:
    """Everything ``envhub eval`` takes (see ``envhub eval --help`` and ``docs/eval.md``)."""

    env: str
    model: str
    episodes: int = 10
    samples: int = 1
    concurrency: int = 8
    out: str = "runs/eval"
    seed: int = 0
    max_turns: int = 10
    history_turns: int | None = None
    max_tokens: int = 1024
    temperature: float = 1.0
    pass_threshold: float = 1.0
    model_name: str | None = None
    api_key: str | None = None
    env_token: str | None = None
    episode_timeout_s: float | None = None
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    reset_kwargs: dict[str, Any] = field(default_factory=dict)
    env_config: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    retry_failed: bool = False

    def __post_init__(self) -> None:
        if self.retry_failed and not self.resume:
            raise ValueError("--retry-failed plays the failed episodes of a run again: use it with --resume.")
        if self.env_config and "://" in self.env:
            raise ValueError(f"Expected --set only with an env eval serves itself (a name or module:Class), got "
                             f"--env {self.env}: configure that server where it runs (envhub serve ... --set).")
        for name, low, high in (("episodes", 1, 1_000_000), ("samples", 1, 10_000), ("concurrency", 1, 4096),
                                ("max_turns", 1, 100_000)):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"Expected --{name.replace('_', '-')} in {low}..{high}, got {value}.")
        if self.history_turns is not None and self.history_turns < 0:
            raise ValueError(f"Expected --history-turns >= 0, got {self.history_turns}.")
        if self.episode_timeout_s is not None and self.episode_timeout_s <= 0:
            raise ValueError(f"Expected --episode-timeout > 0 seconds, got {self.episode_timeout_s}.")
        ModelOptions(max_tokens=self.max_tokens, temperature=self.temperature)  # validates both
        check_model_path(self.model)

    def material(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in MATERIAL}

    def to_json(self) -> dict[str, Any]:
        """The arguments as recorded on disk: secrets appear only as whether they were given."""
        out = asdict(self)
        for name in _SECRETS:
            out[name] = "***" if out[name] else None
        return out


class EvalRun:
    """The files of one eval directory: ``run.json``, ``results.jsonl``, ``summary.json``."""

    def __init__(self, config: EvalConfig):
        self.config = config
        self.dir = Path(config.out)
        self.results = self.dir / "results.jsonl"
        self.run_file = self.dir / "run.json"
        self.summary_file = self.dir / "summary.json"
        self.played_s = 0.0  # wall time spent playing in this invocation

    def prepare(self) -> tuple[set[tuple[int, int]], float]:
        """Check the directory against ``resume``; returns the pairs already done and their wall time."""
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"Expected --out to be a directory (made when missing), got {str(self.dir)!r}, "
                             "which is a file.")
        if not self.config.resume:
            if self.results.exists() and self.results.stat().st_size > 0:
                raise ValueError(f"{self.results} already holds results; pass --resume to continue that run, or "
                                 "choose another --out.")
            self.dir.mkdir(parents=True, exist_ok=True)
            self.results.write_text("")
            self._write_json(self.run_file, {"args": self.config.to_json()})
            return set(), 0.0
        if not self.run_file.exists():
            raise ValueError(f"Nothing to resume in {self.dir}: no run.json (run without --resume first).")
        args = self._read_json(self.run_file).get("args")
        self._check_material(args if isinstance(args, dict) else {})
        beyond = sorted((int(r["task_index"]), int(r["sample"])) for r in self.records()
                        if int(r["task_index"]) >= self.config.episodes or int(r["sample"]) >= self.config.samples)
        if beyond:  # the summary would count episodes outside N x K
            raise ValueError(f"Cannot resume {self.dir} with --episodes {self.config.episodes} --samples "
                             f"{self.config.samples}: results.jsonl holds task {beyond[-1][0]} sample {beyond[-1][1]}; "
                             "--episodes and --samples may only grow on resume.")
        kept = self.records(repair=True, drop_failed=self.config.retry_failed)
        done = {(int(r["task_index"]), int(r["sample"])) for r in kept}
        previous = self._read_json(self.summary_file) if self.summary_file.exists() else {}
        return done, float(previous.get("wall_s") or 0.0)

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any]:
        """A JSON object file of this directory; a broken one is a one-line error naming it."""
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"Expected {path} to hold a JSON object, got unreadable JSON ({exc}); restore it or "
                             "choose another --out.") from None
        if not isinstance(value, dict):
            raise ValueError(f"Expected {path} to hold a JSON object, got {type(value).__name__}.")
        return value

    def _check_material(self, recorded: dict[str, Any]) -> None:
        ours = json.loads(json.dumps(self.config.material()))  # compare as JSON, like the file
        diffs = [f"{name}: {recorded.get(name)!r} in run.json, {ours[name]!r} now" for name in MATERIAL
                 if recorded.get(name) != ours[name]]
        if diffs:
            raise ValueError(f"Cannot resume {self.dir}: arguments differ from the recorded run ("
                             + "; ".join(diffs) + "). Use the same arguments, or another --out.")

    def records(self, *, repair: bool = False, drop_failed: bool = False) -> list[dict[str, Any]]:
        """The recorded episodes, the last line of each (task, sample); a line cut by a kill is dropped
        (``repair``: and removed from the file; ``drop_failed``: failed episodes too, to play them again)."""
        if not self.results.exists():
            return []
        # split on "\n" alone: str.splitlines() also splits on U+2028, U+0085 ..., which json.dumps(ensure_ascii=False)
        # leaves raw inside a transcript's strings; a multi-byte character cut by a kill only spoils its own line
        lines = [line for line in self.results.read_bytes().decode("utf-8", errors="replace").split("\n") if line]
        good, by_pair = [], {}
        for line in lines:
            try:
                rec = json.loads(line)
                pair = (int(rec["task_index"]), int(rec["sample"]))
            except (ValueError, KeyError, TypeError):
                continue
            if drop_failed and rec.get("failure"):
                continue
            by_pair[pair] = rec
            good.append(line)
        if repair and len(good) != len(lines):
            self.results.write_text("".join(f"{line}\n" for line in good), encoding="utf-8")
        return list(by_pair.values())

    def write_summary(self, wall_s: float, *, interrupted: bool) -> dict[str, Any]:
        cfg = self.config
        summary = summarize(self.records(), episodes=cfg.episodes, samples=cfg.samples, threshold=cfg.pass_threshold,
                            wall_s=wall_s, args=cfg.to_json())
        summary["interrupted"] = interrupted
        self._write_json(self.summary_file, summary)
        return summary

    @staticmethod
    def _write_json(path: Path, value: Any) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        tmp.replace(path)


class Progress:
    """A progress bar on stderr: tqdm when installed, else one line rewritten in place."""

    def __init__(self, total: int, done: int, stream: TextIO = sys.stderr):
        self.total, self.done, self.failed, self.reward_sum, self.scored = total, done, 0, 0.0, 0
        self.stream = stream
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar: Any = None
        else:
            self.bar = tqdm(total=total, initial=done, desc="eval", unit="ep", file=stream, dynamic_ncols=True)

    def update(self, record: EpisodeRecord) -> None:
        self.done += 1
        if record.reward is None:
            self.failed += 1
        else:
            self.scored += 1
            self.reward_sum += record.reward
        text = f"failed={self.failed} reward={self.reward_sum / self.scored:.3f}" if self.scored else \
            f"failed={self.failed}"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        else:
            self.stream.write(f"\reval {self.done}/{self.total} {text}")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self.stream.write("\n")


def episode_specs(config: EvalConfig, done: set[tuple[int, int]]) -> list[EpisodeSpec]:
    """The episodes still to play, task by task (the samples of a task run close together)."""
    return [EpisodeSpec(task, sample, config.seed + task, dict(config.reset_kwargs))
            for task in range(config.episodes) for sample in range(config.samples) if (task, sample) not in done]


async def play_all(env_url: str, model: ChatModel, specs: list[EpisodeSpec], limits: EpisodeLimits,
                   concurrency: int, results: Path, progress: Progress) -> None:
    """Play ``specs`` with ``concurrency`` episodes in flight; append each record to ``results`` when it ends."""
    pending = iter(specs)
    live = [0]  # episodes being played now
    set_demand = getattr(model, "set_demand", None)
    if callable(set_demand):  # a batching model waits (briefly) for every live episode's turn to batch them
        set_demand(lambda: live[0])
    with open(results, "a", encoding="utf-8") as out:
        async def worker() -> None:
            env = EnvConnection(env_url, limits)  # one session per worker, reset for each of its episodes
            try:
                for spec in pending:  # one iterator shared by the workers: each spec is played once
                    live[0] += 1
                    try:
                        record = await play_episode(env, model, spec)
                    finally:
                        live[0] -= 1
                    out.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")
                    out.flush()  # a killed run keeps every finished episode
                    progress.update(record)
            finally:
                await env.drop()

        try:
            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
        finally:
            await model.aclose()


def run_eval(config: EvalConfig) -> dict[str, Any]:
    """Run (or resume) the eval ``config`` describes; returns the summary written to ``summary.json``."""
    if "://" not in config.env:
        from envhub.registry import resolve

        resolve(config.env)  # an unknown or conflicting name fails here, before anything starts
    run = EvalRun(config)
    done, previous_wall_s = run.prepare()
    specs = episode_specs(config, done)
    interrupted = False
    try:
        if specs:
            _play_specs(config, specs, run, len(done))
    except KeyboardInterrupt:
        interrupted = True
    return run.write_summary(previous_wall_s + run.played_s, interrupted=interrupted)


def _play_specs(config: EvalConfig, specs: list[EpisodeSpec], run: EvalRun, done: int) -> None:
    """Serve the env if it is not a URL, load the model, play (``run.played_s``: the wall time of play
    alone, model loading and env start-up left out). A Ctrl-C propagates once the env server is stopped."""
    from contextlib import ExitStack

    from envhub.eval.serve import LocalEnvServer

    limits = EpisodeLimits(max_turns=config.max_turns, timeout_s=config.episode_timeout_s,
                           system_prompt=config.system_prompt, env_token=config.env_token,
                           history_turns=config.history_turns)
    options = ModelOptions(max_tokens=config.max_tokens, temperature=config.temperature, seed=config.seed,
                           model_name=config.model_name, api_key=config.api_key)
    with ExitStack() as stack:
        env_url = config.env
        if "://" not in env_url:
            server = LocalEnvServer(env_url, env_config=config.env_config, max_sessions=max(64, config.concurrency))
            env_url = stack.enter_context(server).url
        model = load_chat_model(config.model, options)
        progress = Progress(config.episodes * config.samples, done)
        stack.callback(progress.close)
        start = time.monotonic()
        try:
            asyncio.run(play_all(env_url, model, specs, limits, config.concurrency, run.results, progress))
        finally:
            run.played_s += time.monotonic() - start


__all__ = ["EvalConfig", "EvalRun", "MATERIAL", "episode_specs", "play_all", "run_eval"]

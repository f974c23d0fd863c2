"""Names the service hands out: session, training-run and sampler ids, and ``tinker://`` paths.

The SDK assumes a training run created from a checkpoint is ``{session_id}:train:{model_seq_id}``
and parses checkpoint paths as ``tinker://<training_run_id>/<kind>/<checkpoint_id>`` (three
segments), so both follow that form exactly.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from trainer.service._errors import UserError

CHECKPOINT_KINDS = ("weights", "sampler_weights")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def new_session_id() -> str:
    return f"sess-{uuid.uuid4().hex[:16]}"


def session_of(run_or_sampler_id: str) -> str | None:
    """The session a training run (``<session>:train:<n>``) or sampler (``<session>:sample:<n>``) id belongs to."""
    for marker in (":train:", ":sample:"):
        session, sep, seq = run_or_sampler_id.rpartition(marker)
        if sep and session and seq.isdigit():
            return session
    return None


def model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampler_id(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


@dataclass(frozen=True)
class TinkerPath:
    training_run_id: str
    kind: str  # weights | sampler_weights
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.training_run_id}/{self.kind}/{self.name}"

    def directory(self, root: Path) -> Path:
        """Where this checkpoint lives under the service's state directory."""
        return root / "checkpoints" / self.training_run_id.replace(":", "_") / self.kind / self.name


def check_name(name: str) -> str:
    """A checkpoint name is one path segment: letters, digits, ``.``, ``_``, ``-``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise UserError(f"Expected a checkpoint name of letters, digits, '.', '_' or '-' (at most 128), "
                        f"got {str(name)[:80]!r}")
    return name


def parse(path: str, kind: str | None = None) -> TinkerPath:
    """``tinker://<run>/<kind>/<name>`` → :class:`TinkerPath`; otherwise a :class:`UserError` (400) saying why."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(f"Expected a path like tinker://<training_run_id>/weights/<name>, got {str(path)[:80]!r}")
    parts = path[len("tinker://"):].split("/")
    if len(path) > 512 or len(parts) != 3 or parts[1] not in CHECKPOINT_KINDS or not all(parts):
        raise UserError(f"Expected tinker://<training_run_id>/<weights|sampler_weights>/<name>, "
                        f"got {str(path)[:80]!r}")
    if kind is not None and parts[1] != kind:
        hint = ("save_state / create_training_client_from_state take tinker://.../weights/..." if kind == "weights"
                else "sampling clients take tinker://.../sampler_weights/... from save_weights_for_sampler")
        raise UserError(f"Expected a {kind} checkpoint, got {path[:80]!r} ({hint})")
    return TinkerPath(parts[0], parts[1], check_name(parts[2]))

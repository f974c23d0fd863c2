"""The REST listings ``tinker.RestClient`` reads: a client's training runs, their checkpoints, a checkpoint's weights.

Only the asking client's own runs are listed or found (``Ops.check_owned``); another client's are 404.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from trainer.service import _paths
from trainer.service._errors import NotFound
from trainer.service._ops import Ops


def training_runs(ops: Ops, owner: str, limit: int, offset: int) -> dict[str, Any]:
    runs, total = ops.store.models(owner, limit, offset)
    return {"training_runs": [training_run_record(ops, r) for r in runs],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


def training_run(ops: Ops, owner: str, run_id: str) -> dict[str, Any]:
    ops.check_owned(owner, run_id)
    row = ops.store.model(run_id)
    if row is None:
        raise NotFound(f"Unknown training run {run_id!r}.")
    return training_run_record(ops, row)


def checkpoints(ops: Ops, owner: str, run_id: str) -> dict[str, Any]:
    ops.check_owned(owner, run_id)
    if ops.store.model(run_id) is None:
        raise NotFound(f"Unknown training run {run_id!r}.")
    return {"checkpoints": [checkpoint_record(c) for c in ops.store.checkpoints(run_id)]}


def weights_info(ops: Ops, owner: str, tinker_path: str) -> dict[str, Any]:
    path = ops.owned_path(owner, tinker_path)
    checkpoint = ops.store.checkpoint(str(path))
    row = checkpoint and ops.store.model(checkpoint["model_id"])
    if not row:
        raise NotFound(f"Unknown checkpoint {tinker_path!r}.")
    return {"base_model": row["base_model"], "is_lora": row["is_lora"], "lora_rank": row["lora_rank"] or None}


def training_run_record(ops: Ops, row: dict[str, Any]) -> dict[str, Any]:
    records = ops.store.checkpoints(row["model_id"])
    last = {kind: next((c for c in reversed(records) if c["kind"] == kind), None) for kind in _paths.CHECKPOINT_KINDS}
    return {"training_run_id": row["model_id"], "base_model": row["base_model"], "model_owner": "envhub",
            "is_lora": row["is_lora"], "lora_rank": row["lora_rank"] or None, "corrupted": False,
            "last_request_time": _iso(row["last_request_at"]),
            "last_checkpoint": last["weights"] and checkpoint_record(last["weights"]),
            "last_sampler_checkpoint": last["sampler_weights"] and checkpoint_record(last["sampler_weights"]),
            "user_metadata": {str(k): str(v) for k, v in row["user_metadata"].items()}}


def checkpoint_record(c: dict[str, Any]) -> dict[str, Any]:
    return {"checkpoint_id": f"{c['kind']}/{c['checkpoint_id']}",
            "checkpoint_type": "training" if c["kind"] == "weights" else "sampler",
            "time": _iso(c["created_at"]), "tinker_path": c["tinker_path"], "size_bytes": c["size_bytes"],
            "public": False}


def _iso(ts: float | None) -> str:
    return datetime.fromtimestamp(ts or 0, tz=timezone.utc).isoformat()

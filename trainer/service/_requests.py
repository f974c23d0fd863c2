"""The JSON bodies the service accepts, as strict pydantic models: a body of the wrong shape never reaches the core.

Each model reads what SDK 0.38 sends (``model_dump(exclude_none=True)`` of its request types) and ignores
keys it does not use. Types are strict (``"3"`` is not an integer, ``1`` is not a boolean), floats must
be finite, strings and lists have static caps, and numbers have the ranges the core can honour; limits
that depend on the settings or on the model (vocabulary, context, ``--max-lora-rank``, ...) are checked
after parsing, by :mod:`trainer.service._limits`. :func:`parse` turns any failure into a 400 naming the
field, what was expected and what came.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from trainer.service._errors import UserError

#: the caps of this module (also in docs/service.md's limits table)
MAX_ID_CHARS = 256  # session, model, sampler and request ids, base model names
MAX_PATH_CHARS = 512  # tinker:// paths
MAX_METADATA_ENTRIES, MAX_METADATA_CHARS = 64, 1024
MAX_LIST_ITEMS = 1 << 20  # any list in a body (prompt tokens are checked against the model's context later)
MAX_CHUNKS = 4096
MAX_STOP, MAX_STOP_CHARS = 64, 512
MAX_SEQ = 2**62  # seq ids; model and sampler sequence numbers stay below 2**31
MAX_SEED = 2**63 - 1

Id = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS)]
Path = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH_CHARS)]
SeqId = Annotated[int, Field(ge=0, le=MAX_SEQ)]
SmallSeq = Annotated[int, Field(ge=0, lt=2**31)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Scalar = Annotated[str, StringConstraints(max_length=MAX_METADATA_CHARS)] | int | float | bool | None
Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=128)], Scalar],
                     Field(max_length=MAX_METADATA_ENTRIES)]


class Body(BaseModel):
    """Strict, finite, unknown keys ignored (the SDK adds ``type`` and newer SDKs may add more)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, frozen=True,
                              protected_namespaces=())


B = TypeVar("B", bound=Body)


def parse(model: type[B], body: bytes) -> B:
    """``body`` as ``model``, or a :class:`UserError` (400) that says which field is wrong and how."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise UserError(f"Invalid {model.__name__} request: {describe(exc)}") from None


def describe(exc: ValidationError, most: int = 3) -> str:
    """The first few validation errors, one clause each: ``field.path: message (got value)``."""
    clauses = []
    for error in exc.errors(include_url=False)[:most]:
        where = ".".join(str(part) for part in error["loc"]) or "body"
        got = repr(error.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        clauses.append(f"{where}: {error['msg']}" + ("" if error["type"] == "json_invalid" else f" (got {got})"))
    more = len(exc.errors()) - most
    return "; ".join(clauses) + (f"; and {more} more" if more > 0 else "")


# -- sessions --------------------------------------------------------------------------------------

class CreateSession(Body):
    user_metadata: Metadata | None = None
    tags: Annotated[list[Annotated[str, StringConstraints(max_length=MAX_ID_CHARS)]], Field(max_length=64)] = []


class SessionRef(Body):
    session_id: Id


# -- training --------------------------------------------------------------------------------------

class LoraConfig(Body):
    rank: Annotated[int, Field(ge=1, lt=2**31)] = 32
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    type: Annotated[str, StringConstraints(max_length=32)] = "adamw"


class CreateModel(Body):
    session_id: Id
    model_seq_id: SmallSeq = 0
    base_model: Id | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig | None = None
    user_metadata: Metadata | None = None


class ModelRef(Body):
    model_id: Id


class Adam(Body):
    learning_rate: Annotated[float, Field(ge=0)] = 1e-4
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: Annotated[float, Field(gt=0)] = 1e-12
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    grad_clip_norm: Annotated[float, Field(ge=0)] = 0.0


class OptimStep(Body):
    model_id: Id
    seq_id: SeqId | None = None
    adam_params: Adam | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeights(Body):
    model_id: Id
    seq_id: SeqId | None = None
    path: Path | None = None
    sampling_session_seq_id: SmallSeq | None = None
    user_metadata: Metadata | None = None


class LoadWeights(Body):
    model_id: Id | None = None
    seq_id: SeqId | None = None
    session_id: Id | None = None
    model_seq_id: SmallSeq = 0
    path: Path
    optimizer: bool = False
    user_metadata: Metadata | None = None


# -- sampling --------------------------------------------------------------------------------------

class Chunk(Body):
    type: Annotated[str, StringConstraints(max_length=64)] = "encoded_text"
    tokens: Annotated[list[int], Field(max_length=MAX_LIST_ITEMS)] = []


class Prompt(Body):
    chunks: Annotated[list[Chunk], Field(max_length=MAX_CHUNKS)] = []


StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]


class Sampling(Body):
    max_tokens: Annotated[int, Field(ge=1, lt=2**31)] | None = None
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1, lt=2**31)] = -1
    seed: Seed | None = None
    stop: (StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)]
           | Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=MAX_STOP)] | None) = None


class CreateSamplingSession(Body):
    session_id: Id
    sampling_session_seq_id: SmallSeq = 0
    base_model: Id | None = None
    model_path: Path | None = None


class Sample(Body):
    sampling_session_id: Id | None = None
    seq_id: SeqId | None = None
    base_model: Id | None = None
    model_path: Path | None = None
    num_samples: Annotated[int, Field(ge=1, lt=2**31)] = 1
    prompt: Prompt
    sampling_params: Sampling
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: Annotated[int, Field(ge=0, lt=2**31)] = 0
    topk_sample_logprobs: Annotated[int, Field(ge=0, lt=2**31)] = 0
    prompt_alt_tokens_k: Annotated[int, Field(ge=0, lt=2**31)] = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_logprobs_last_n: Annotated[int, Field(ge=0, lt=2**31)] | None = None


# -- futures and REST ------------------------------------------------------------------------------

class RetrieveFuture(Body):
    request_id: Annotated[str, StringConstraints(min_length=1, max_length=32)] | Annotated[int, Field(ge=0)]


class WeightsInfo(Body):
    tinker_path: Path


__all__ = ["Body", "CreateModel", "CreateSamplingSession", "CreateSession", "LoadWeights", "ModelRef", "OptimStep",
           "RetrieveFuture", "Sample", "SaveWeights", "SessionRef", "WeightsInfo", "describe", "parse"]

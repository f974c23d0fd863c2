"""``envhub-train serve``'s settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ServiceSettings:
    """``envhub-train serve``'s settings (see ``docs/service.md``)."""

    model: str = "tiny"
    served_name: str | None = None
    sampler: str = "hf"
    token: str | None = None
    state_dir: Path = field(default_factory=lambda: Path(".envhub-service"))
    max_tenants: int = 4
    full_parameter: bool = False
    idle_timeout_s: float = 600.0
    max_batch_tokens: int = 32768
    max_batch_datums: int = 1024
    max_samples: int = 256
    max_request_bytes: int = 64 * 2**20
    long_poll_s: float = 20.0
    device: str = "auto"
    max_lora_rank: int = 64
    threads: int | None = None  # torch CPU threads for model work (None: torch's default)

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir)
        if self.token is not None and not self.token.startswith(("tml-", "eyJ")):
            raise ValueError(f"Expected --token to start with 'tml-' (the tinker SDK only sends such keys), "
                             f"got {self.token[:4]!r}...")
        if self.max_tenants < 1 or self.max_batch_tokens < 1 or self.idle_timeout_s <= 0 or self.max_lora_rank < 1:
            raise ValueError("Expected --max-tenants >= 1, --max-batch-tokens >= 1, --max-lora-rank >= 1 and "
                             "--idle-timeout-s > 0.")
        if self.full_parameter and self.max_tenants != 1:
            self.max_tenants = 1  # a full-parameter run owns the base weights
        if self.sampler not in ("hf", "vllm"):
            raise ValueError(f"Expected --sampler hf or vllm, got {self.sampler!r}.")

    @property
    def name(self) -> str:
        return self.served_name or self.model

"""``envhub-train serve``'s settings, validated at construction.

The ``max_*`` fields are the service's limits: every size a client controls is checked against one of
them before anything that size is allocated (``docs/service.md`` has the table).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

#: limits that must be at least 1 (the flag that sets each, where there is one, is named in errors)
_POSITIVE = ("max_tenants", "max_batch_tokens", "max_batch_datums", "max_samples", "max_sample_tokens",
             "max_lora_rank", "max_request_bytes", "max_json_bytes", "max_inflight_bytes", "max_pending",
             "max_queued", "max_queued_bytes", "sampler_slots", "max_sessions", "max_checkpoints_per_run",
             "max_pass_tokens")


@dataclass
class ServiceSettings:
    """``envhub-train serve``'s settings (see ``docs/service.md``)."""

    model: str = "tiny"
    served_name: str | None = None
    sampler: str = "hf"
    token: str | None = None  # one API key; ``tokens`` holds more
    tokens: tuple[str, ...] = ()
    state_dir: Path = field(default_factory=lambda: Path(".envhub-service"))
    max_tenants: int = 4
    full_parameter: bool = False
    idle_timeout_s: float = 600.0
    long_poll_s: float = 20.0
    device: str = "auto"
    threads: int | None = None  # torch CPU threads for model work (None: torch's default)
    batch_window_s: float = 0.005  # a sample request waits this long for others to share its engine batch
    sampler_slots: int = 4  # sampler adapters loaded at once (LRU swapped past them), here or on the servers
    # padded tokens in one pass of merged forward_backward work (trainer.core.host.MAX_PASS_TOKENS): more runs
    # as several passes, the gradients the same
    max_pass_tokens: int = 8192
    sampler_servers: tuple[str, ...] = ()  # envhub-train sampler servers that sample instead of this process
    sampler_token: str | None = None  # their bearer token
    sampler_weight_group: str = "off"  # "gloo": pushes to the servers go through a torch.distributed group
    sampler_servers_file: Path | None = None  # more servers, one URL a line; re-read while the service runs
    listed_servers: tuple[str, ...] = field(default=(), init=False)  # of sampler_servers, those the file listed
    # -- limits ----------------------------------------------------------------------------------------
    max_batch_tokens: int = 32768  # tokens in one forward_backward
    max_batch_datums: int = 1024  # datums in one forward_backward
    max_samples: int = 256  # num_samples of one asample
    max_sample_tokens: int = 131072  # num_samples * (prompt + max_tokens) of one asample
    max_lora_rank: int = 64
    max_request_bytes: int = 16 * 2**20  # a forward_backward (protobuf) body
    max_json_bytes: int = 4 * 2**20  # any other (JSON) body
    max_inflight_bytes: int = 128 * 2**20  # bodies being received at once, all clients
    max_pending: int = 1024  # futures pending per client (API key)
    max_queued: int = 4096  # futures queued in all, every client: past it the service is overloaded (429)
    max_queued_bytes: int = 512 * 2**20  # request data held by queued work, all clients
    max_sessions: int = 256  # live sessions per client
    max_checkpoints_per_run: int = 128
    body_timeout_s: float = 60.0  # a body must arrive within this (slow uploads hold memory)

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir)
        self.tokens = tuple(self.tokens) + ((self.token,) if self.token else ())
        for token in self.tokens:
            if not token.startswith(("tml-", "eyJ")):
                raise ValueError(f"Expected --token to start with 'tml-' (the tinker SDK only sends such keys), "
                                 f"got {token[:4]!r}...")
        bad = [name for name in _POSITIVE if getattr(self, name) < 1]
        if bad:
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in bad)
            raise ValueError(f"Expected {flags} >= 1 (limits are positive), got {[getattr(self, n) for n in bad]}.")
        if self.idle_timeout_s <= 0 or self.long_poll_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("Expected --idle-timeout-s, long_poll_s and body_timeout_s > 0.")
        if not 0 <= self.batch_window_s <= 1:
            raise ValueError(f"Expected --batch-window-ms in [0, 1000], got {self.batch_window_s * 1000:g}.")
        if self.full_parameter and self.max_tenants != 1:
            self.max_tenants = 1  # a full-parameter run owns the base weights
        if self.sampler not in ("hf", "vllm"):
            raise ValueError(f"Expected --sampler hf or vllm, got {self.sampler!r}.")
        self.sampler_servers = tuple(u.strip().rstrip("/") for u in self.sampler_servers if u.strip())
        bad_urls = [u for u in self.sampler_servers if not u.startswith(("http://", "https://"))]
        if bad_urls:
            raise ValueError(f"Expected --sampler-servers URLs like http://host:8100, got {bad_urls}.")
        if self.sampler_servers_file is not None:
            self._add_listed_servers(Path(self.sampler_servers_file))
        if self.sampler_weight_group not in ("off", "gloo"):
            raise ValueError(f"Expected --sampler-weight-group off or gloo, got {self.sampler_weight_group!r}.")
        if self.sampler_weight_group != "off" and not self.sampler_servers:
            raise ValueError("Expected --sampler-servers with --sampler-weight-group: the group carries pushes to "
                             "sampler servers.")
        if self.sampler_servers and self.sampler != "hf":
            raise ValueError("Expected no --sampler vllm with --sampler-servers: the servers sample (start them with "
                             "`envhub-train sampler --backend vllm`), this process only trains.")

    def _add_listed_servers(self, path: Path) -> None:
        """The servers ``--sampler-servers-file`` lists, after ``--sampler-servers``'."""
        self.sampler_servers_file = path
        try:
            listed, bad_urls = read_server_list(path)
        except OSError as exc:
            raise ValueError(f"Expected --sampler-servers-file to name a readable file, got {path} ({exc}).") from exc
        if bad_urls:
            raise ValueError(f"Expected URLs like http://host:8100 in {path}, got {bad_urls}.")
        self.listed_servers = tuple(listed)
        self.sampler_servers += tuple(u for u in listed if u not in self.sampler_servers)
        if not self.sampler_servers:
            raise ValueError(f"Expected at least one sampler server URL in --sampler-servers or {path}, got none.")

    @property
    def name(self) -> str:
        return self.served_name or self.model


def read_server_list(path: Path) -> tuple[list[str], list[str]]:
    """The sampler server URLs a ``--sampler-servers-file`` lists (one a line; blank lines and ``#`` comments
    skipped) and the lines that are no such URL; ``OSError`` if the file cannot be read."""
    urls: list[str] = []
    bad: list[str] = []
    for line in path.read_text().splitlines():
        entry = line.split("#", 1)[0].strip().rstrip("/")
        if entry:
            (urls if entry.startswith(("http://", "https://")) else bad).append(entry)
    return urls, bad

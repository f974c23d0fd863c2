"""The Tinker-compatible training service: HTTP requests → durable futures → the training core.

``envhub-train serve`` runs it; ``tinker.ServiceClient(base_url=...)`` drives it unmodified. It samples in
process, or on ``envhub-train sampler`` servers (``--sampler-servers``: ``_remote``). See ``docs/service.md``.
"""

from trainer.service._settings import ServiceSettings
from trainer.service.serve import build_app

__all__ = ["ServiceSettings", "build_app"]

"""``python -m trainer.sampler_server``: run one sampler server (the same as ``envhub-train sampler``)."""

import sys

from trainer.sampler_server.serve import main

sys.exit(main())

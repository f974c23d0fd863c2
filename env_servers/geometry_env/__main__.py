"""``python -m env_servers.geometry_env --host H --port P [--max-sessions N] [--mode tools|single] [env options]``."""

from env_servers.geometry_env.env import GeometryConfig, GeometryEnv
from env_servers.serve_cli import main

if __name__ == "__main__":
    main({"geometry": (GeometryEnv, GeometryConfig)}, prog="python -m env_servers.geometry_env")

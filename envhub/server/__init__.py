"""The env server: one FastAPI/uvicorn process serving one env class over ``/ws`` (OpenEnv protocol) and HTTP."""

from envhub.server.app import create_app
from envhub.server.run import ServerThread, load_target, serve

__all__ = ["create_app", "serve", "ServerThread", "load_target"]

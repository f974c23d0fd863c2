"""Environment servers: math, gomoku, geometry and a code sandbox, each a package of pure domain modules plus an envhub adapter."""

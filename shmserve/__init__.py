"""shmserve: a multiprocess shared-memory inference server for transformer models.

This package holds what the frontends and the workers both import: the messages and their wire
format, the shared-memory arena, configuration, model metadata and the CLI. It never imports
torch or aiohttp.
"""

__version__ = "0.1.0"

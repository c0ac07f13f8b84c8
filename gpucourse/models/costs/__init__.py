"""Back-of-the-envelope cost models used throughout the course (the module, moved whole: split by topic next)."""
from .pipeline_parallel import *  # noqa: F401,F403

"""`gpucourse gpu-check` (the module, moved whole into command.py: split by topic next)."""
from .command import *  # noqa: F401,F403

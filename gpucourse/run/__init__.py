"""Both sides of the process boundary: running jobs: the launcher and its agent, the ranks' runtime, the live view, what
a run leaves on disk.

Imports nothing from the other layers.
"""

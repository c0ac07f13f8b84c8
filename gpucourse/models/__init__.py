"""Numbers: units, the cost models (chapter by chapter), memory counts, and what a profiler trace says.

Imports from run/ only (where a run left its traces).
"""

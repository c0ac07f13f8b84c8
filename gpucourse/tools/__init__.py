"""What people run: the CLI, grading, releases, the course in batch, the GPU check, the lab's settings.
"""

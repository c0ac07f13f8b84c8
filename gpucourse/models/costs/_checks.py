"""The argument checks every cost model shares: each names the bad argument in its ValueError."""


def require(ok, message):
    """Raise ValueError(message) unless ok: every check names the bad argument."""
    if not ok:
        raise ValueError(message)


def check_nonneg(value, name):
    require(value >= 0, f"{name} must be >= 0, got {value}")

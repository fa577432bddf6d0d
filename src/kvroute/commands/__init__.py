"""One module per CLI subcommand. Each defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``; ``kvroute.cli`` imports a module only when its command runs."""


def port_number(text: str) -> int:
    """argparse type for a TCP port (0 picks a free one)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def seconds(text: str) -> float:
    """argparse type for a duration in seconds: a finite number >= 0."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"seconds must be a finite number >= 0, got {text}")
    return value

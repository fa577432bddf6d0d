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

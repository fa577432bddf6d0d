"""One module per CLI subcommand. Each defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``; ``kvroute.cli`` imports a module only when its command runs."""

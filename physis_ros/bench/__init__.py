"""Benchmarks behind the ``physis-bench`` console script, one module per subcommand.

``engine`` imports torch; ``link`` and ``ros`` (robot side) must not, so the CLI
imports a subcommand's module only when that subcommand runs.
"""

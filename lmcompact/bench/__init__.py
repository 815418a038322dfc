"""Benchmarks behind ``lmcompact bench``; each module defines NAME, HELP, add_arguments, run."""

"""Placeholder: replaced by the module that implements this command."""


def add_arguments(parser, name):
    pass


def run(args):
    raise SystemExit(f"rlhf-pipeline {args.command}: not built yet")

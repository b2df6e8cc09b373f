"""Command groups that several modules add commands to."""

import typer

config_app = typer.Typer(
    help="Show the resolved build spec; migrate Neuron configs.", no_args_is_help=True
)
artifacts_app = typer.Typer(
    help="List, show, remove, garbage-collect, push and pull artifacts.", no_args_is_help=True
)

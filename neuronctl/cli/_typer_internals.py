"""What the CLI uses of typer that typer does not offer publicly, in one place.

typer vendors click as `typer._click` (fastapi/typer#1774: "Any code in the new subfolder
typer/_click should not be used by external applications, as it will be subject to change"),
and its help is drawn by `typer.rich_utils`, whose helpers are private too. No other module
touches either (tests/test_torch_internals.py fails on a `typer._...` or
`typer.rich_utils._...` elsewhere); pyproject.toml pins typer to the minor version tested.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer.rich_utils
from typer._click.core import ParameterSource
from typer._click.exceptions import ClickException, NoArgsIsHelpError

__all__ = ["ClickException", "NoArgsIsHelpError", "ParameterSource", "fold_help"]


def fold_help(table: type, fold: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Draw --help with `table` as rich's Table, and each option's help through
    `fold(typer's own renderer)`."""
    typer.rich_utils.Table = table  # type: ignore[attr-defined,misc,assignment]
    typer.rich_utils._get_parameter_help = fold(typer.rich_utils._get_parameter_help)

"""Imports a name that does not exist in an installed package: found by no pre-check, fails in
every rank at import."""

from torch import no_such_name_in_torch  # noqa: F401

print("never reached")

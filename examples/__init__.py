"""Example programs to tune with autofuse."""

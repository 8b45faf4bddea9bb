"""laminarctl: the command-line client of the Laminar node agent."""

__version__ = "0.1.0"

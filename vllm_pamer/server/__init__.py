"""Server glue (API-server process): endpoint plugin, sessions, metrics."""

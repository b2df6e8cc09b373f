"""The command line: parse, call the core, render. No logic lives here."""

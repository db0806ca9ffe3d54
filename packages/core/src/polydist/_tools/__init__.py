"""The command line and the demo."""

"""The `telerag` command line, the top layer: one module per subcommand, each parsing its flags and
calling into `server` or `benchmarks`. Importing a command module imports no torch (so that
`telerag --help` answers at once and `telerag serve` listens before loading); what a command
runs is imported when it runs."""
